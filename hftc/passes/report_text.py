"""The fusion report as text for a person: ``print(fused.fusion_report)`` and ``hftc inspect``.

One table row per op of model 0, as the user wrote it; for three models whose forward
is ``self.fc(torch.fft.rfft(self.conv(x).flatten(1)).abs()[:, :5] * x.size(0))``::

    hftc fusion report: 3 models (N = 3), matched by trace order
    6 ops fused, 1 computed once (shared), 1 run model by model

      node      op        module path  kind            output           rule
      conv      Conv2d    conv         fused           [N, 2, 4, 6, 6]  fuse_conv
      flatten   flatten   -            fused           [N, 2, 144]      fuse_flatten
      fft_rfft  fft.rfft  -            model by model  [N, 2, 73]       loop
      abs_1     abs       -            fused           [N, 2, 73]       fuse_pointwise[abs]
      getitem   getitem   -            fused           [N, 2, 5]        fuse_getitem
      size      size      -            shared          -                shared
      mul       mul       -            fused           [N, 2, 5]        fuse_pointwise[mul]
      fc        Linear    fc           fused           [N, 2, 2]        fuse_linear

    run model by model (exact, but not faster):
      node `fft_rfft` (module path `<root>`, torch._C._fft.fft_rfft): no fusion rule for ...

    strategy: runs the fused program (checked; not timed, the same program every run)
    checked against models 0, 1 and 2's own forward: values agree (largest difference ...)

The op is the user's (``Conv2d``, ``max_pool2d``, ``view``), not hftc's kernel
(``channelwise__max_pool2d``); where the models' ops differ, each model's (``relu (models
0, 2), gelu (model 1)``); the kind in words (:data:`KIND_WORDS`); the fused output's
shape with the model axis written ``N`` (model 0's shape after it; a value computed once
for all models has none); hftc's rule last, where asked for (``hftc inspect`` leaves it
out).  The columns are as wide as their longest entry, so long names keep them straight.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..match import public_name

#: A record's kind, in the words of the report (docs/ARCHITECTURE.md's "Words").
KIND_WORDS = {"fused": "fused", "shared": "shared", "loop": "model by model",
              "per_model": "per model (ops differ)"}
_SOURCE = re.compile(r"module path `([^`]*)`, (.*)\)$")
_PREFIXES = ("torch._C._nn.", "torch.nn.functional.", "torch.Tensor.", "Tensor.", "torch.",
             "operator.", "_operator.", "builtins.")


def user_op(source: str) -> str:
    """The op as the user wrote it, from a record's source: ``node `fc1` (module path
    `fc1`, Linear)`` -> ``Linear``; ``..., torch.nn.functional.max_pool2d)`` ->
    ``max_pool2d``; ``..., Tensor.view)`` -> ``view``; ``..., torch._C._fft.fft_rfft)`` ->
    ``fft.rfft``; ``..., hftc.ir.apply_function__ReverseGradient)`` ->
    ``ReverseGradient.apply``; an op hftc's tracing put in model 0's graph, not the user
    (``hftc.lowering.runtime.guards.check_input_shape``, torch.export's input guard) ->
    ``hftc's check_input_shape``, not a path into hftc's internals."""
    found = _SOURCE.search(source)
    if not found:
        return source
    op = public_name(found.group(2))
    if op.startswith("hftc."):
        return f"hftc's {op.rpartition('.')[2]}"
    for prefix in _PREFIXES:
        if op.startswith(prefix):
            return op[len(prefix):]
    return op


def record_op(record: Any) -> str:
    """A record's op as the report and the graph show it: the user's (:func:`user_op`);
    for an op that differs per model, each model's (``relu (models 0, 2), gelu (model 1)``,
    not model 0's alone)."""
    if record.kind == "per_model":
        return record.reason.partition(": ")[2] or user_op(record.source)
    return user_op(record.source)


def module_path_text(source: str) -> str:
    """The module path of a record's source: ``node `fc1` (module path `fc1`, Linear)`` ->
    ``fc1``; ``-`` for the root module (an op written in forward itself)."""
    found = _SOURCE.search(source)
    path = found.group(1) if found else ""
    return "-" if path in ("", "<root>") else path


def shape_text(value: Any, batched: bool) -> str:
    """Model 0's value ``[2, 6, 28, 28]`` -> ``[N, 2, 6, 28, 28]``, the fused value with
    its model axis (``batched``); a value computed once keeps its own shape; a tuple's
    parts in parentheses; ``-`` for a non-tensor."""
    if hasattr(value, "shape"):
        return "[" + ", ".join(["N"] * batched + [str(d) for d in value.shape]) + "]"
    if isinstance(value, (tuple, list)):
        parts = [shape_text(v, batched) for v in value]
        parts = [p for p in parts if p != "-"]
        return "(" + ", ".join(parts) + ")" if parts else "-"
    return "-"


def table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns two spaces apart, each as wide as its longest entry (long
    names keep the columns straight)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in rows]


def op_rows(records: Sequence[Any], rules: bool = True) -> list[tuple[str, ...]]:
    """The op table's rows, the heading first: one per op record (inputs and parameters
    left out), its rule last where ``rules``."""
    rows = [("node", "op", "module path", "kind", "output") + ("rule",) * rules]
    for r in records:
        if r.kind in ("input", "parameter"):
            continue
        rows.append((r.node, record_op(r), module_path_text(r.source),
                     KIND_WORDS.get(r.kind, r.kind), r.shape or "-") + (r.rule,) * rules)
    return rows


def report_lines(report: Any, heading: str, rules: bool = True) -> list[str]:
    """A :class:`~hftc.passes.driver.FusionReport` as lines (the module docstring's
    text), under ``heading`` (``"hftc fusion report"``, ``"hftc inspect lenet5"``)."""
    n = report.num_models
    shared = sum(r.kind == "shared" for r in report.records)
    lines = [f"{heading}: {n} models (N = {n}), matched by {report.match_method}",
             f"{len(report.fused)} ops fused, {shared} computed once (shared), "
             f"{len(report.fallbacks)} run model by model"
             + (f", {len(report.per_model)} that differ per model" if report.per_model else "")]
    rows = op_rows(report.records, rules)
    if len(rows) > 1:
        lines += ["", *table(rows)]
    for title, records in (("run model by model (exact, but not faster):", report.fallbacks),
                           ("run on each model's slice (the models' ops differ; exact):",
                            report.per_model)):
        if records:
            lines += ["", title, *(f"  {r.source}: {r.reason}" for r in records)]
    after = []
    if report.strategy is not None:
        after.append(f"strategy: {report.strategy}")
    if report.check is not None:
        after.append(str(report.check))
    if report.padding is not None:
        after.append(report.padding)
    if report.exported is not None:
        after.append(f"torch.export: the example inputs exported {report.exported}")
    if report.lowerings:
        after.append("lowerings chosen by autotune (median forward + backward per call):")
        after.extend(f"  {choice}" for choice in report.lowerings)
    return lines + ([""] + after if after else [])
