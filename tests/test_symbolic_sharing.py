"""The symbolic front-end traces one model per group of models that run the same program
(hftc/frontends/same_program.py) and gives the others a copy of its graph, read at their
own modules.  Sound only where forward read nothing that differs between the models: each
test here has models whose forward reads something that may differ (a Python attribute it
branches on or scales by, a per-model hyper-parameter, a parameter's value read as a real
tensor) and checks the fused module against the plain loop over the models (check=False:
the first-call check would hide a wrong shared graph behind the models' own forwards), and
how many symbolic traces ran.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import check_equivalence

import hftc
from hftc.errors import MismatchError
from hftc.frontends import symbolic


@pytest.fixture
def traces(monkeypatch):
    """Counts the symbolic traces hftc runs (every one goes through its tracer's trace)."""
    calls = []
    trace = symbolic._Tracer.trace

    def counted(self, root, *args, **kwargs):
        calls.append(root)
        return trace(self, root, *args, **kwargs)

    monkeypatch.setattr(symbolic._Tracer, "trace", counted)
    return calls


def _fuse(models, in_dims):
    return hftc.fuse(models, in_dims=in_dims, check=False)


def _fuse_checked(models, in_dims):
    """With the first-call check, which the token trace of differing floats needs."""
    return hftc.fuse(models, in_dims=in_dims)


class Net(nn.Module):
    """pytorch/examples-style MLP with a batch norm (buffers updated in train mode), dropout,
    a tied weight, a layer norm and a Python scale."""

    def __init__(self, scale=1.0, eps=1e-5):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.norm = nn.LayerNorm(6, eps=eps)
        self.drop = nn.Dropout(0.0)
        self.out = nn.Linear(6, 4)
        self.back = nn.Linear(4, 6)
        self.back.weight = self.fc.weight
        self.scale = scale

    def forward(self, x):
        h = F.relu(self.bn(self.fc(x) - self.back(x).flip(-1)))
        return self.out(self.drop(self.norm(h))) * self.scale + self.extra(x)

    def extra(self, x):
        return 0.0


@pytest.mark.parametrize("train", [True, False])
def test_alike_models_are_traced_once_per_mode(traces, train):
    """Four models of the same code and attributes (different weights): two traces (train
    and eval), not eight, and each model's own weights, buffers and gradients."""
    x = torch.randn(5, 4, dtype=torch.float64)
    fused = check_equivalence([Net() for _ in range(4)], x, train=train, steps=2, fuser=_fuse)
    assert fused.frontend == "symbolic"
    assert len(traces) == 2


def test_alike_models_float32(traces):
    x = torch.randn(5, 4)
    check_equivalence([Net() for _ in range(3)], x, dtype=torch.float32, fuser=_fuse)
    assert len(traces) == 2


def test_a_python_scale_that_differs_is_each_models_in_one_trace(traces):
    """``self.scale`` differs (a per-model scalar of the fused multiply) and forward only
    passes it on to an op: one trace per mode with the scale as a token
    (hftc/frontends/numbers.py), run again with the tokens holding model 1's values to
    find a float read in C, each model's graph with its own value."""
    x = torch.randn(5, 4, dtype=torch.float64)
    check_equivalence([Net(0.5), Net(2.0), Net(0.5), Net(0.5)], x, fuser=_fuse_checked)
    assert len(traces) == 4  # two token traces per mode (the second finds C reads)


def test_without_the_check_floats_that_differ_are_traced_per_group(traces):
    """check=False: nothing would run a model's own forward, so no token trace."""
    x = torch.randn(5, 4, dtype=torch.float64)
    check_equivalence([Net(0.5), Net(2.0), Net(0.5), Net(0.5)], x, fuser=_fuse)
    assert len(traces) == 4


def test_a_per_model_eps_is_each_models(traces):
    """LayerNorm eps differs (a per-model hyper-parameter): one trace per mode, and each
    model normalizes with its own eps."""
    x = torch.randn(5, 4, dtype=torch.float64) * 1e-3
    models = [Net(eps=1e-1), Net(eps=1e-5), Net(eps=1e-1)]
    check_equivalence(models, x, fuser=_fuse_checked)
    assert len(traces) == 4  # two token traces per mode (the second finds C reads)


def test_dropout_p_that_differs_is_each_models_in_one_trace(traces):
    """A sweep over dropout p: every model differs in `drop.p` only; one trace per mode,
    and each model drops with its own p (p = 0 keeps everything, p = 1 nothing)."""
    models = [Net().double() for _ in range(3)]
    for model, p in zip(models, (0.0, 1.0, 0.0)):
        model.drop.p = p
    x = torch.randn(5, 4, dtype=torch.float64)
    fused = hftc.fuse(models)
    out = fused(x)
    assert len(traces) == 4  # two token traces per mode (the second finds C reads)
    for k, model in enumerate(models):  # (p = 1 drops all of `h`: only out's bias is left)
        torch.testing.assert_close(out[k], model(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[1], models[1].out.bias.expand(5, 4))


class ScaleBranch(Net):
    """Branches on its float: the program depends on the value."""

    def extra(self, x):
        return x if self.scale > 1.0 else 0.0


def test_a_float_forward_branches_on_is_traced_per_group(traces):
    """``self.scale > 1.0`` reads the token in Python: each group is traced itself, and
    the two programs do not match (refused), never model 0's branch for model 1."""
    with pytest.raises(MismatchError, match="model 1"):
        hftc.fuse([ScaleBranch(0.5).double(), ScaleBranch(2.0).double()])
    assert len(traces) == 2 + 4  # the token trace per mode, then each group itself
    x = torch.randn(5, 4, dtype=torch.float64)
    check_equivalence([ScaleBranch(2.0), ScaleBranch(3.0)], x, fuser=_fuse)


class ScaleComputed(Net):
    """Computes with its float in Python before an op gets it."""

    def extra(self, x):
        return x * (self.scale * 2.0 - 1.0)


def test_a_float_forward_computes_with_is_each_models(traces):
    x = torch.randn(5, 4, dtype=torch.float64)
    check_equivalence([ScaleComputed(0.5), ScaleComputed(2.0)], x, fuser=_fuse)


class Residual(Net):
    """Branches on a plain attribute: another program where it differs."""

    def __init__(self, residual):
        super().__init__()
        self.residual = residual

    def extra(self, x):
        return x if self.residual else 0.0


def test_a_python_branch_that_differs_is_refused_not_shared():
    """Model 1 adds its input, model 0 does not: different programs, refused (the graphs
    do not match), never model 0's graph run with model 1's weights."""
    x = torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(MismatchError, match="model 1"):
        hftc.fuse([Residual(False).double(), Residual(True).double()], check=False)
    check_equivalence([Residual(True), Residual(True)], x, fuser=_fuse)


class SignBranch(Net):
    """Branches on a parameter's value, read through ``self.parameters()`` (a real tensor
    while fx traces, not a traced value)."""

    def extra(self, x):
        if next(self.parameters()).sum() > 0:
            return x
        return 0.0


def test_a_branch_on_a_parameter_value_is_traced_per_model(traces):
    """The models' weights take different branches: each model is traced itself and the
    graphs do not match (refused), where model 0's graph shared would have run model 0's
    branch for model 1."""
    positive, negative = SignBranch().double(), SignBranch().double()
    with torch.no_grad():
        positive.fc.weight.fill_(0.1)
        negative.fc.weight.fill_(-0.1)
    with pytest.raises(MismatchError, match="model 1"):
        hftc.fuse([positive, negative], check=False)
    assert len(traces) == 4  # each model itself, in both modes


class ParameterConstant(Net):
    """Computes a constant from a parameter's value in Python: fx lifts it into the graph
    (``_tensor_constant0``), each model's own."""

    def extra(self, x):
        return x * next(self.parameters()).detach().sum()


def test_a_constant_made_from_a_parameter_is_each_models(traces):
    x = torch.randn(5, 4, dtype=torch.float64)
    check_equivalence([ParameterConstant() for _ in range(3)], x, fuser=_fuse)
    assert len(traces) == 6


class DtypeOfParameters(Net):
    """Reads only the parameters' metadata (a common idiom), which alike models share."""

    def extra(self, x):
        weight = next(self.parameters())
        return torch.ones(x.shape, dtype=weight.dtype, device=weight.device) * weight.shape[0]


def test_reading_parameter_metadata_still_shares_the_trace(traces):
    x = torch.randn(5, 4, dtype=torch.float64)
    check_equivalence([DtypeOfParameters() for _ in range(3)], x, fuser=_fuse)
    assert len(traces) == 2


def test_the_check_runs_every_model_the_token_trace_shared():
    """The token trace's models differ from model 0 in Python state: the first-call check
    runs each of them against its own forward."""
    models = [Net().double() for _ in range(4)]
    for k, model in enumerate(models):
        model.drop.p = 0.1 * k
    assert hftc.fuse(models).model_copies.differing == [1, 2, 3]


class ScaleInC(Net):
    """Reads its float in C (math.exp takes a float's value without a method call): the
    token notes nothing and model 0's exp(scale) is baked into the shared graph."""

    def extra(self, x):
        return x * math.exp(self.scale)


def test_a_float_read_in_c_is_each_models_and_fused(traces):
    """math.exp(self.scale) bakes the token's value into the graph unnoted: the second
    token trace (the tokens holding model 1's values) gives another graph, so each model
    is traced itself and fuses with its own exp(scale) as a per-model constant. Before,
    model 0's was in both graphs: the first-call check found model 1 wrong and the
    models ran one by one with a FusionWarning blaming isinstance checks."""
    models = [ScaleInC(0.5).double(), ScaleInC(2.0).double()]
    x = torch.randn(5, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = hftc.fuse(models)
        out = fused(x)
    assert fused.strategy == "fused"
    assert len(traces) == 4 + 4  # two token traces per mode, then each model per mode
    for k, model in enumerate(models):
        torch.testing.assert_close(out[k], model(x), rtol=1e-12, atol=1e-12)


class ScaleNamed(Net):
    """Makes a name of its float (``repr``): the program may depend on the text."""

    def extra(self, x):
        return x if repr(self.scale) == "2.0" else 0.0


def test_a_float_forward_formats_is_traced_per_group(traces):
    with pytest.raises(MismatchError, match="model 1"):
        hftc.fuse([ScaleNamed(2.0).double(), ScaleNamed(3.0).double()])
    assert len(traces) == 2 + 4
