"""Fuzzing what users write beyond tests/test_fuzz.py's two families.

Random models of :mod:`fuzz_families` (recurrent layers, attention, embeddings,
transposed and 3-d convs, upsampling, in-place ops, buffers written in forward, several
inputs and outputs with ``in_dims`` tuples, per-model settings) against the loop over
the models, forward and backward, in float64 and float32; dropout with ``p > 0`` per model
against its distribution; every family under CPU bf16 autocast and through the export
front-end; and models that differ structurally, which must be refused with an
``hftc.errors`` class.  Profiles: tests/fuzz_profiles.py (``make test``: the ``ci``
counts below; ``make fuzz``: HFTC_FUZZ_EXAMPLES each).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from equivalence import DEFAULT_TOL, check_equivalence, loop_rounding_error, model_inputs
from fuzz_families import build, dropout_p, exportable, families, mutated, spec_inputs
from fuzz_models import architectures
from fuzz_profiles import examples
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import hftc
from hftc.errors import MismatchError

MODEL_COUNTS = st.sampled_from([1, 2, 3, 5, 8])

# A model hftc could not fuse as traced runs one by one with a FusionWarning: correct, but
# nothing fused was checked; these models have no Python that inspects values.
pytestmark = pytest.mark.filterwarnings("error::hftc.errors.FusionWarning")


def _log(*what) -> None:
    log = os.environ.get("HFTC_FUZZ_LOG")  # make fuzz counts the examples it checked
    if log:
        with open(log, "a") as f:
            f.write(" ".join(map(repr, what)) + "\n")


def _inputs(spec: dict, n: int, stacked: tuple[bool, ...], seed: int):
    """The spec's inputs and their ``in_dims`` (a tuple where there are several)."""
    if spec["family"] in ("image", "sequence"):
        shape = ((n,) if stacked[0] else ()) + tuple(spec["input"])
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)), \
            0 if stacked[0] else None
    xs = spec_inputs(spec, n, stacked, torch.Generator().manual_seed(seed))
    in_dims = tuple(0 if s else None for s in stacked[:len(xs)])
    return (xs[0], in_dims[0]) if len(xs) == 1 else (xs, in_dims)


def _without_dropout(spec: dict) -> dict:
    """Training-mode dropout draws other masks than the loop's: exact checks drop it
    (its distribution is :func:`test_dropout_per_model_rates_and_masks`'s)."""
    return {**spec, "layers": [("dropout", 0.0) if layer[0] == "dropout" else layer
                               for layer in spec["layers"]]}


def check_family(spec, n, stacked, train, seed, *, dtype=torch.float64, fuser=None,
                 autocast=False):
    """Model i of ``spec`` for i < n against their loop, forward and backward."""
    if train:
        spec = _without_dropout(spec)
    _log(spec, n, stacked, train, seed, dtype, autocast, fuser is not None)
    torch.manual_seed(seed)
    models = [build(spec, i) for i in range(n)]
    x, in_dims = _inputs(spec, n, stacked, seed)
    tol = None
    region = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else _nothing()
    with region:
        if dtype != torch.float64:
            # As tests/test_fuzz.py: the loop's own rounding sets the bar (under autocast,
            # the bf16 loop's distance from float64, which autocast leaves alone).
            rounding = loop_rounding_error(models, x, in_dims=in_dims, train=train, dtype=dtype)
            assume(rounding < (3e-2 if autocast else 1e-4))
            tol = max(DEFAULT_TOL[torch.bfloat16 if autocast else dtype], 30 * rounding)
        fuser = fuser or hftc.fuse
        check_equivalence(models, x, in_dims=in_dims, train=train, dtype=dtype, tol=tol,
                          fuser=fuser)


class _nothing:  # noqa: N801 - a context manager
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


STACKED = st.tuples(st.booleans(), st.booleans())


@examples(ci=40)
@given(spec=families, n=MODEL_COUNTS, stacked=STACKED, train=st.booleans(),
       seed=st.integers(0, 2**16))
def test_random_families_fuse_exactly(spec, n, stacked, train, seed):
    check_family(spec, n, stacked, train, seed)


@examples(ci=25)
@given(spec=families, n=MODEL_COUNTS, stacked=STACKED, train=st.booleans(),
       seed=st.integers(0, 2**16))
def test_random_families_in_float32(spec, n, stacked, train, seed):
    check_family(spec, n, stacked, train, seed, dtype=torch.float32)


@examples(ci=20)
@given(spec=st.one_of(families, architectures), n=st.sampled_from([2, 3]), stacked=STACKED,
       train=st.booleans(), seed=st.integers(0, 2**16))
def test_random_models_under_bf16_autocast(spec, n, stacked, train, seed):
    """The caller's ``torch.autocast("cpu", bfloat16)`` around the fused module and the
    loop alike, float32 models."""
    check_family(spec, n, stacked, train, seed, dtype=torch.float32, autocast=True)


@examples(ci=4)
@given(spec=st.one_of(families, architectures), n=st.sampled_from([2, 3]), stacked=STACKED,
       train=st.booleans(), seed=st.integers(0, 2**16))
def test_random_models_through_the_export_front_end(spec, n, stacked, train, seed):
    spec = exportable(spec)
    x, _ = _inputs(spec, n, stacked, seed)
    example = tuple(t.double() if t.is_floating_point() else t
                    for t in (x if isinstance(x, tuple) else (x,)))

    def fuser(models, in_dims):
        return hftc.fuse(models, in_dims=in_dims, example_inputs=example, frontend="export")

    check_family(spec, n, stacked, train, seed, fuser=fuser)


@examples(ci=30)
@given(pair=mutated(st.one_of(families, architectures)), n=st.sampled_from([2, 3, 5]),
       odd=st.integers(0, 4), stacked=STACKED, seed=st.integers(0, 2**16))
def test_models_that_differ_structurally_are_refused(pair, n, odd, stacked, seed):
    """One model (index ``odd``) built from a mutated spec: fusing, or the first call,
    raises a MismatchError naming that model (or, where it is model 0, all the others),
    and the module path where they differ; never another exception or a result."""
    spec, other, what = pair
    odd = odd % n
    _log("mismatch", spec, other, n, odd)
    torch.manual_seed(seed)
    models = [build(other if i == odd else spec, i) for i in range(n)]
    x, in_dims = _inputs(spec, n, stacked, seed)
    others = ", ".join(str(i) for i in range(1, n)) if odd == 0 else str(odd)
    named = rf"^models? {others} of {n} cannot be fused with model 0: "
    with pytest.raises(MismatchError, match=named) as caught:
        fused = hftc.fuse(models, in_dims=in_dims)
        fused(*(x if isinstance(x, tuple) else (x,)))
    where = r"(module path|models? [\d, and]+'s) `[^`]+`|the model itself|numbers of nodes"
    assert re.search(where, str(caught.value)), str(caught.value)


@examples(ci=30)
@given(n=MODEL_COUNTS, rates=st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.8, 1.0]),
                                      min_size=8, max_size=8),
       functional=st.booleans(), stacked=st.booleans(), rows=st.sampled_from([64, 200]),
       seed=st.integers(0, 2**16))
def test_dropout_per_model_rates_and_masks(n, rates, functional, stacked, rows, seed):
    """Dropout with a rate per model, in training: hftc draws each model's mask itself
    (docs/API.md: never the loop's draws), so what is compared is what a mask must be:

    * model i's share of dropped elements is p_i (within 5 binomial sigmas),
    * kept elements are model i's eval-mode output times ATen's 1 / (1 - p_i),
    * gradients flow through the same mask, scaled the same way,
    * models' masks differ from each other and from call to call, and
      ``torch.manual_seed`` reproduces them.
    """
    rates = rates[:n]
    _log("dropout", n, rates, functional, stacked, rows, seed)
    torch.manual_seed(seed)
    width = 32
    models = [_DropoutNet(width, p, functional) for p in rates]
    fused = hftc.fuse(models, in_dims=0 if stacked else None).double()
    x = torch.randn(((n,) if stacked else ()) + (rows, width), dtype=torch.float64)

    fused.eval()
    clean = fused(x)
    expected_eval = torch.stack([m.double().eval()(*model_inputs(x, 0 if stacked else None, i))
                                 for i, m in enumerate(models)])
    torch.testing.assert_close(clean, expected_eval, rtol=1e-12, atol=1e-12)

    fused.train()
    torch.manual_seed(seed + 1)
    out = fused(x)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    torch.manual_seed(seed + 1)
    again = fused(x).detach()
    assert torch.equal(out.detach(), again), "torch.manual_seed did not reproduce the masks"
    other_call = fused(x).detach()

    kept = out.detach() != 0
    for i, p in enumerate(rates):
        count = clean[i].numel()
        dropped = 1 - kept[i].double().mean().item()
        sigma = (p * (1 - p) / count) ** 0.5
        assert abs(dropped - p) <= 5 * sigma + 1e-12, (i, p, dropped)
        if p < 1:
            scale = 1 / (1 - p)
            torch.testing.assert_close(out[i][kept[i]], clean[i][kept[i]] * scale,
                                       rtol=1e-12, atol=0)
            # d out / d bias of the last linear: the mask over its rows, scaled
            bias_grad = (weights[i] * kept[i]).sum(0) * scale
            torch.testing.assert_close(fused.fc.bias.grad[i], bias_grad, rtol=1e-10, atol=1e-10)
        else:
            assert not kept[i].any()
            assert torch.equal(fused.fc.bias.grad[i], torch.zeros_like(fused.fc.bias.grad[i]))
        if 0 < p < 1:
            assert not torch.equal(kept[i], other_call[i] != 0), "the same mask on every call"
    for i in range(n):
        for j in range(i):
            if rates[i] == rates[j] and 0 < rates[i] < 1:
                assert not torch.equal(kept[i], kept[j]), f"models {j} and {i} share a mask"


class _DropoutNet(nn.Module):
    """A linear, then dropout of rate ``p`` (module or ``F.dropout``)."""

    def __init__(self, width: int, p: float, functional: bool):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(p)
        self.p, self.functional = p, functional

    def forward(self, x):
        h = self.fc(x)
        return F.dropout(h, self.p, self.training) if self.functional else self.drop(h)


def test_per_model_rates_follow_the_spec_helper():
    # The generator's per-model rates are distinct, so a fused module that reads model
    # 0's rate for every model fails the rate checks above.
    assert len({dropout_p(0.1, i, True) for i in range(8)}) == 8

