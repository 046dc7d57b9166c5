"""``hftc.fuse_groups(..., pad_widths=True)`` decides pad-or-split, with
``autotune=True``, from a measured step time (recorded, else measured and recorded);
without it from the arithmetic estimate, whatever the table holds, so that the arrays
(and the bits) are the same every run; and says which decided (hftc/module/group.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import hftc
from hftc.module.group import grouping_cost, grouping_key, record_grouping_cost


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(20, width), nn.Tanh(), nn.Linear(width, 5)).double()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    return tmp_path


def _arrays(groups):
    return [indices for _, indices in groups]


def _equal_alone(groups, models, x):
    for fused, indices in groups:
        out = fused(x)
        for j, i in enumerate(indices):
            torch.testing.assert_close(out[j], models[i](x), rtol=1e-12, atol=1e-12)


def test_a_measurement_favouring_split_overrides_an_estimate_favouring_padding():
    torch.manual_seed(0)
    models = [mlp(96), mlp(128)]  # padded: 1.14x the arithmetic, within max_padding 1.25
    x = torch.randn(8, 20, dtype=torch.float64)
    assert _arrays(hftc.fuse_groups(models, pad_widths=True, example_inputs=x)) == [[0, 1]]
    # the widest group first, then the next: the key's model order
    record_grouping_cost(grouping_key([models[1], models[0]], x), padded_s=2e-3, apart_s=1e-3)
    groups = hftc.fuse_groups(models, pad_widths=True, example_inputs=x, autotune=True)
    assert _arrays(groups) == [[0], [1]]
    assert "the next narrower models are apart: measured 2 ms a step padded into one " \
           "array vs 1 ms apart (1.14x" in groups[1][0].grouping
    _equal_alone(groups, models, x)


def test_a_measurement_favouring_padding_overrides_an_estimate_favouring_split():
    torch.manual_seed(1)
    models = [mlp(32), mlp(128)]  # padded: 1.60x, beyond max_padding 1.25
    x = torch.randn(8, 20, dtype=torch.float64)
    assert _arrays(hftc.fuse_groups(models, pad_widths=True, example_inputs=x)) == [[0], [1]]
    record_grouping_cost(grouping_key([models[1], models[0]], x), padded_s=1e-3, apart_s=3e-3)
    [(fused, indices)] = hftc.fuse_groups(models, pad_widths=True, example_inputs=x,
                                          autotune=True)
    assert indices == [0, 1] and fused.padding is not None
    assert fused.grouping == ("2 widths padded into one array: measured 1 ms a step padded "
                              "into one array vs 3 ms apart (1.60x the models' own arithmetic "
                              "padded)")
    _equal_alone([(fused, indices)], models, x)


def test_the_key_separates_inputs_widths_and_dtypes():
    models = [mlp(32), mlp(128)]
    x = torch.randn(8, 20, dtype=torch.float64)
    key = grouping_key(models, x)
    record_grouping_cost(key, padded_s=1e-3, apart_s=3e-3)
    assert grouping_cost(key) == (1e-3, 3e-3)
    assert grouping_key(models, torch.randn(16, 20, dtype=torch.float64)) != key
    assert grouping_key([mlp(32), mlp(64)], x) != key
    assert grouping_key([m.float() for m in models], x.float()) != key
    assert grouping_key(models + [mlp(128)], x) != key
    assert json.loads(key)[1] == hftc.lowering.timing.device_key(torch.device("cpu"))
    # another batch size: nothing recorded for it, the estimate decides (1.60x: apart)
    other = torch.randn(16, 20, dtype=torch.float64)
    assert _arrays(hftc.fuse_groups(models, pad_widths=True, example_inputs=other)) == [[0], [1]]


def test_without_autotune_the_table_decides_nothing():
    """The default's arrays are the same with an empty table or one whose measurement
    says the opposite of the estimate: which models share an array changes the bits."""
    torch.manual_seed(3)
    models = [mlp(96), mlp(128)]  # padded: 1.14x, within max_padding: one array
    x = torch.randn(8, 20, dtype=torch.float64)
    before = hftc.fuse_groups(models, pad_widths=True, example_inputs=x)
    record_grouping_cost(grouping_key([models[1], models[0]], x), padded_s=2e-3, apart_s=1e-3)
    after = hftc.fuse_groups(models, pad_widths=True, example_inputs=x)
    assert _arrays(before) == _arrays(after) == [[0, 1]]
    assert before[0][0].grouping == after[0][0].grouping
    assert "estimated" in after[0][0].grouping and "measured" not in after[0][0].grouping
    assert all(torch.equal(a, b) for a, b in zip(before[0][0](x), after[0][0](x)))


def test_the_table_survives_a_new_process(own_cache):
    models = [mlp(32), mlp(128)]
    x = torch.randn(8, 20, dtype=torch.float64)
    key = grouping_key(models, x)
    record_grouping_cost(key, padded_s=1.5e-3, apart_s=2.5e-3)
    code = ("import json, sys; from hftc.module.group import grouping_cost; "
            "print(json.dumps(grouping_cost(sys.stdin.read())))")
    out = subprocess.run([sys.executable, "-c", code], input=key, capture_output=True,
                         text=True, check=True, env={**__import__("os").environ,
                                                     "HFTC_CACHE_DIR": str(own_cache)})
    assert json.loads(out.stdout) == [1.5e-3, 2.5e-3]


def test_autotune_measures_records_and_the_result_is_each_model_alone(single_thread):
    torch.manual_seed(2)
    models = [mlp(48), mlp(64)]
    x = torch.randn(8, 20, dtype=torch.float64)
    key = grouping_key([models[1], models[0]], x)
    assert grouping_cost(key) is None
    state = torch.get_rng_state()
    groups = hftc.fuse_groups(models, pad_widths=True, example_inputs=x, autotune=True)
    assert torch.equal(torch.get_rng_state(), state)  # the timing runs drew nothing of ours
    padded_s, apart_s = grouping_cost(key)
    assert padded_s > 0 and apart_s > 0
    reasons = " ".join(fused.grouping for fused, _ in groups)
    assert f"measured {padded_s * 1e3:.3g} ms a step padded into one array vs " \
           f"{apart_s * 1e3:.3g} ms apart" in reasons
    assert _arrays(groups) == ([[0, 1]] if padded_s <= apart_s else [[0], [1]])
    _equal_alone(groups, models, x)
    # a later call with autotune reads the measurement: nothing is timed again
    again = hftc.fuse_groups(models, pad_widths=True, example_inputs=x, autotune=True)
    assert _arrays(again) == _arrays(groups)
    assert " ".join(fused.grouping for fused, _ in again) == reasons


@pytest.fixture
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
