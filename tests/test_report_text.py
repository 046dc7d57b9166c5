"""``print(fused.fusion_report)``: hftc inspect's table (the user's ops, module paths, kinds
in words, shapes [N, ...]) with hftc's rule last, columns as wide as their longest entry;
a fallback reads "run model by model"."""

from __future__ import annotations

import re

import torch
from cli_factories import LongNames
from torch import nn

import hftc
from hftc.passes.report_text import module_path_text, shape_text, table, user_op


class ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -grad


class WithFallbacks(nn.Module):
    """An op no rule fuses (torch.fft.rfft), a custom Function, a value computed once."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        h = torch.fft.rfft(self.conv(x).flatten(1)).abs()
        return self.fc(ReverseGradient.apply(h[:, :5]) * x.size(0))


def _table_of(text: str) -> list[str]:
    """The op table: the lines from its heading to the first blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  node "))
    end = lines.index("", start)
    return lines[start:end]


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_the_report_names_the_users_ops_and_says_model_by_model():
    models = [WithFallbacks() for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(2, 3, 8, 8)
    out = fused(x)
    for i, m in enumerate(models):  # (the report describes a program that is exact)
        torch.testing.assert_close(out[i], m(x))
    report = fused.fusion_report
    text = str(report)
    assert text.startswith("hftc fusion report: 3 models (N = 3), matched by trace order\n"
                           "6 ops fused, 1 computed once (shared), 2 run model by model\n")
    rows = {_cells(line)[0]: _cells(line) for line in _table_of(text)}
    assert rows["node"] == ["node", "op", "module path", "kind", "output", "rule"]
    assert rows["conv"] == ["conv", "Conv2d", "conv", "fused", "[N, 2, 4, 6, 6]", "fuse_conv"]
    assert rows["fft_rfft"] == ["fft_rfft", "fft.rfft", "-", "model by model", "[N, 2, 73]",
                                "loop"]
    function_row = next(r for node, r in rows.items() if node.startswith("apply_function"))
    assert function_row[1:4] == ["ReverseGradient.apply", "-", "model by model"]
    assert rows["size"] == ["size", "size", "-", "shared", "-", "shared"]  # no model axis
    assert "\nrun model by model (exact, but not faster):\n  node `fft_rfft`" in text
    assert "per-model loop" not in text
    # the table is the records': the rule column is rule_counts()'s names
    assert {row[-1] for node, row in rows.items() if node != "node"} <= \
        set(report.rule_counts()) | {"shared"}
    assert [r.node for r in report.fallbacks] == ["fft_rfft", function_row[0]]


def test_the_reports_columns_hold_with_long_names():
    fused = hftc.fuse([LongNames() for _ in range(2)])
    fused(torch.randn(4, 8))
    lines = _table_of(str(fused.fusion_report))
    header = lines[0]
    starts = [header.index(name) for name in ("op", "module path", "kind", "output", "rule")]
    for line in lines[1:]:  # every cell starts under its heading, after a gap of two
        for start in starts:
            assert line[start - 2:start] == "  " and line[start] != " ", (line, header)
    long = "encoder_projection_to_hidden_features_layer"
    row = next(_cells(line) for line in lines if line.startswith(f"  {long} "))
    assert row == [long, "Linear", long, "fused", "[N, 4, 16]", "fuse_linear"]


def test_the_text_helpers():
    assert user_op("node `fc1` (module path `fc1`, Linear)") == "Linear"
    assert user_op("node `p` (module path `<root>`, torch.nn.functional.max_pool2d)") == \
        "max_pool2d"
    assert user_op("node `v` (module path `<root>`, Tensor.view)") == "view"
    assert user_op("node `f` (module path `<root>`, torch._C._linalg.linalg_norm)") == \
        "linalg.norm"
    assert module_path_text("node `fc1` (module path `enc.fc1`, Linear)") == "enc.fc1"
    assert module_path_text("node `v` (module path `<root>`, Tensor.view)") == "-"
    assert shape_text(torch.zeros(2, 3), True) == "[N, 2, 3]"
    assert shape_text((torch.zeros(2), 4, torch.zeros(1, 5)), False) == "([2], [1, 5])"
    assert shape_text(7, True) == "-"
    assert table([("a", "bb"), ("cccc", "d")]) == ["  a     bb", "  cccc  d"]
