"""The compile pipeline (hftc/lowering/pipeline.py): one list of stages, run by one loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hftc
from hftc.errors import TraceError
from hftc.lowering import pipeline


def test_the_stages_in_order():
    assert [stage.name for stage in pipeline.STAGES] == [
        "shape propagation", "fusion", "chains", "codegen", "check", "strategy choice",
        "autotune", "layout choice", "checkpointing"]


@pytest.mark.parametrize("autotune", [False, True])
def test_each_stage_runs_once_in_order(monkeypatch, autotune):
    ran = []
    stages = tuple(pipeline.Stage(s.name, lambda state, options, s=s: (ran.append(s.name),
                                                                      s.run(state, options)),
                                  s.autotune_only, s.not_autotune) for s in pipeline.STAGES)
    monkeypatch.setattr(pipeline, "STAGES", stages)
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    fused = hftc.fuse(models, autotune=autotune)
    x = torch.randn(5, 4)
    out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
    expected = [s.name for s in pipeline.STAGES
                if (autotune or not s.autotune_only) and not (autotune and s.not_autotune)]
    assert ran == expected


def test_an_error_from_inside_names_the_stage_it_came_from(monkeypatch):
    def broken(graph, root):
        raise RuntimeError("a bug in a graph pass")

    monkeypatch.setattr(pipeline, "chain_linears", broken)
    fused = hftc.fuse([nn.Linear(4, 2) for _ in range(2)])
    with pytest.raises(RuntimeError, match="a bug in a graph pass") as info:
        fused(torch.randn(5, 4))
    assert info.value.__notes__ == ["hftc: raised in the compile stage 'chains'"]


def test_hftcs_own_errors_are_left_as_they_are():
    # They name the model, the input and what to change; a note would add nothing.
    fused = hftc.fuse([nn.Linear(4, 2) for _ in range(2)])
    with pytest.raises(TraceError, match=r"model 0 \(Linear\) fails on this call's inputs") \
            as info:
        fused(torch.randn(5, 3))
    assert not hasattr(info.value, "__notes__")


def test_the_checks_fallback_ends_the_pipeline(monkeypatch):
    ran = []
    stages = tuple(pipeline.Stage(s.name, lambda state, options, s=s: (ran.append(s.name),
                                                                      s.run(state, options)),
                                  s.autotune_only, s.not_autotune) for s in pipeline.STAGES)
    monkeypatch.setattr(pipeline, "STAGES", stages)
    monkeypatch.setattr(hftc.module.fused.FusedModule, "_why_not_fused",
                        lambda self, *args: "the test asks for it")
    models = [nn.Linear(4, 2) for _ in range(2)]
    fused = hftc.fuse(models, autotune=True)
    x = torch.randn(5, 4)
    with pytest.warns(hftc.FusionWarning, match="the test asks for it"):
        out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
    assert ran == ["shape propagation", "fusion", "chains", "codegen", "check"]
