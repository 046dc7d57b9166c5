"""The first-call check (hftc/lowering/check.py): a program whose outputs are not the models' own
is never run; the models then run one by one, with a FusionWarning that says why."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from fuzz_families import build
from torch import nn
from zoo import WritesItsInput

import hftc
from hftc.errors import FusionWarning, TraceError
from hftc.lowering.check import ConstantRandomness, output_difference
from hftc.lowering.runtime import norms as rt_norms
from hftc.lowering.runtime import random as rt_random


class MaskIfTensor(nn.Module):
    """Masks only when the mask is a tensor: while traced it is a Proxy, so never."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, mask=None):
        y = self.fc(x)
        if isinstance(mask, torch.Tensor):
            y = y * mask
        return y


class ExactTypeCheck(nn.Module):
    """Inspects the type of an intermediate value: a Proxy while traced."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x):
        y = self.norm(self.fc(x))
        if type(y) is torch.Tensor:
            return y.relu()
        return y


def models_of(cls, n=3, seed=0):
    torch.manual_seed(seed)
    return [cls() for _ in range(n)]


def test_isinstance_on_an_input_runs_the_models_one_by_one_and_warns():
    models = models_of(MaskIfTensor)
    x, mask = torch.randn(5, 4), (torch.rand(5, 1) > 0.5).float()
    fused = hftc.fuse(models)
    with pytest.warns(FusionWarning, match=r"model 0's output differs from the model's own "
                                           r"forward by [0-9.]+ .*isinstance.*frontend='export'"):
        out = fused(x, mask)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x, mask))
    report = fused.fusion_report
    assert not report.check.passed and "FAILED" in str(report)
    assert fused.last_program().one_by_one is not None
    # The same program on the next call: no second warning, still right.
    x2 = torch.randn(5, 4)
    out = fused(x2, mask)
    torch.testing.assert_close(out[2], models[2](x2, mask))


def test_a_failed_check_trains_as_the_models_alone():
    """The fallback trains: forward, backward and hftc's Adam equal a loop over the models
    (float64 and float32, 2 steps, batch norm statistics compared too)."""
    for dtype in (torch.float64, torch.float32):
        with pytest.warns(FusionWarning, match="one by one"):
            check_equivalence(models_of(ExactTypeCheck, n=4), torch.randn(6, 4), dtype=dtype,
                              steps=2)


def test_export_traces_the_branch_and_fuses():
    """The warning's advice works: torch.export runs forward's Python on real tensors."""
    models = models_of(MaskIfTensor)
    x, mask = torch.randn(5, 4), (torch.rand(5, 1) > 0.5).float()
    fused = hftc.fuse(models, example_inputs=(x, mask), frontend="export")
    out = fused(x, mask)  # a FusionWarning would fail this test (pyproject filterwarnings)
    assert fused.last_program().one_by_one is None and fused.fusion_report.check.passed
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x, mask))


def test_check_false_skips_the_check():
    models = models_of(ExactTypeCheck)
    fused = hftc.fuse(models, check=False)
    fused(torch.randn(6, 4))
    assert fused.fusion_report.check is None and fused.last_program().one_by_one is None
    with pytest.raises(hftc.errors.FusionArgumentError, match="check must be True or False"):
        hftc.fuse(models, check="yes")


def test_a_passed_check_is_in_the_report_and_changes_nothing():
    """The check's own runs leave no trace: running statistics, the input written in
    place, the RNG (the next dropout draws are the ones without the check)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.norm = nn.BatchNorm1d(4)

        def forward(self, x):
            x.mul_(2)
            return F.dropout(self.norm(self.fc(x)), 0.3, self.training)

    outs = {}
    for check in (True, False):
        models = models_of(Model)
        fused = hftc.fuse(models, check=check)
        torch.manual_seed(7)
        x = torch.randn(6, 4)
        outs[check] = (fused(x), x, fused.norm.running_mean.clone(), torch.rand(3))
        if check:
            assert fused.fusion_report.check.passed
            assert not fused.fusion_report.check.shapes_only  # dropout made constant
            assert "checked against models 0, 1 and 2's own forward: values agree" in \
                str(fused.fusion_report)
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)


def test_a_random_op_without_a_constant_is_compared_by_shape():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.rrelu(self.fc(x), training=True)

    fused = hftc.fuse(models_of(Noisy))
    fused(torch.randn(5, 4))
    assert fused.fusion_report.check.passed and fused.fusion_report.check.shapes_only


def test_in_place_writes_into_the_input_happen_once_with_autotune(tmp_path, monkeypatch):
    """Tuning runs the program many times: on copies of the inputs, never on the caller's
    (it used to double the input once per tuning run: outputs off by 10x)."""
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))

    models = models_of(WritesItsInput)
    x = torch.randn(2, 4)
    given = x.clone()
    out = hftc.fuse(models, autotune=True)(given)
    assert torch.equal(given, (2 * x).relu())
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x.clone()))


def test_a_fallback_that_cannot_run_is_a_trace_error():
    """Divergent and not runnable one by one (the loop cannot stack a dataclass output):
    an error, never the wrong program."""
    @dataclasses.dataclass
    class Out:
        y: torch.Tensor

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            y = self.fc(x)
            return Out(y if isinstance(y, torch.Tensor) else -y)

    with pytest.raises(TraceError, match=r"output.y differs.*cannot run one by one either"):
        hftc.fuse(models_of(Model))(torch.randn(5, 4))


def test_a_model_that_cannot_be_called_is_not_checked():
    class KeywordOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, *, scale=2.0):
            return self.fc(x) * scale

    fused = hftc.fuse(models_of(KeywordOnly))
    fused(torch.randn(5, 4))
    check = fused.fusion_report.check
    assert check.passed and check.skipped and "not checked" in str(check)


@pytest.mark.parametrize("draw", ["F.dropout", "random.dropout", "bernoulli_", "rand",
                                  "randn", "normal_", "uniform_", "randint", "randperm"])
def test_constant_randomness_is_one_value_per_op_whatever_the_shape(draw):
    x = torch.randn(3, 5, dtype=torch.float64)
    fns = {
        "F.dropout": lambda t: F.dropout(t, 0.25),
        "random.dropout": lambda t: rt_random.dropout(t, 0.25),
        "bernoulli_": lambda t: torch.empty_like(t).bernoulli_(0.25),
        "rand": lambda t: torch.rand(t.shape, dtype=t.dtype),
        "randn": lambda t: torch.randn_like(t),
        "normal_": lambda t: torch.empty_like(t).normal_(1.5, 2.0),
        "uniform_": lambda t: torch.empty_like(t).uniform_(-1.0, 1.0),
        "randint": lambda t: torch.randint(3, 9, t.shape),
        "randperm": lambda t: torch.randperm(t.numel()),
    }
    expected = {
        "F.dropout": x / 0.75, "random.dropout": x / 0.75,
        "bernoulli_": torch.ones_like(x), "rand": torch.zeros_like(x),
        "randn": torch.zeros_like(x), "normal_": torch.full_like(x, 1.5),
        "uniform_": torch.full_like(x, -1.0), "randint": torch.full(x.shape, 3),
        "randperm": torch.arange(x.numel()),
    }
    state = torch.random.get_rng_state()
    with ConstantRandomness():
        got = fns[draw](x)
        stacked = fns[draw](x.repeat(2, 1))  # N models' draw at once: the same values
    assert torch.equal(torch.random.get_rng_state(), state)  # the generator did not move
    torch.testing.assert_close(got, expected[draw], rtol=1e-15, atol=0)  # dropout: x * (1/0.75)
    if draw != "randperm":
        assert torch.equal(stacked[:3], got)


def test_output_difference_names_what_differs():
    y = torch.ones(2, 3)
    assert output_difference((y, {"a": y}), (y.clone(), {"a": y + 1e-9})) is None
    assert "output[1]['a'] differs" in output_difference((y, {"a": y}), (y, {"a": 2 * y}))
    assert "keys ['a'] where the model's has ['b']" in output_difference({"a": y}, {"b": y})
    assert "shape [2, 3]" in output_difference(y, y[0])
    # which side has the NaNs: the fused output is finite where the model's is not
    assert "is finite where the model's own forward has NaN" in output_difference(
        y, torch.full_like(y, float("nan")))
    assert "has NaN or infinite elements where the model's own forward does not" in \
        output_difference(torch.full_like(y, float("inf")), y)
    assert "other NaN or infinite values" in output_difference(
        torch.full_like(y, float("inf")), torch.full_like(y, float("-inf")))
    nan = torch.tensor([float("nan"), 1.0])
    assert output_difference(nan, nan.clone()) is None
    labels = torch.arange(200)
    flipped = labels.clone()
    flipped[0] = 7
    assert output_difference(flipped, labels) is None  # a near tie may flip one in 100
    assert "differs in 200 of its 200" in output_difference(labels + 1, labels)
    assert "output[1] is 'b'" in output_difference((y, "b"), (y, "a"))
    # Zero but for rounding on either side: not a difference; a small real one is.
    noise = torch.full((4, 4), 3e-8)
    assert output_difference(noise, torch.zeros(4, 4)) is None
    assert "differs" in output_difference(noise * 1e3, torch.zeros(4, 4))


class WarmUp(nn.Module):
    """A Python counter that changes what forward computes from call to call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * min(1.0, self.calls / 3)


def test_python_state_changed_by_forward_runs_the_models_one_by_one():
    """Traced, ``self.calls`` would keep its value from tracing (a warm-up stuck at its
    first step; the first call agreed, so the check alone cannot see it).  Fusing leaves
    the originals' attributes as they were; the models then run their own forwards."""
    torch.manual_seed(0)
    models = [nn.Sequential(WarmUp(), nn.ReLU()) for _ in range(3)]
    fused = hftc.fuse(models)
    assert [m[0].calls for m in models] == [0, 0, 0]  # tracing ran forward twice
    alone = copy.deepcopy(models)
    x = torch.randn(5, 4)
    with pytest.warns(FusionWarning, match=r"changes the Python attribute\(s\) `0.calls`.*"
                                           r"register_buffer"):
        outs = [fused(x) for _ in range(4)]
    for step, out in enumerate(outs):
        for i, m in enumerate(alone):
            torch.testing.assert_close(out[i], m(x), msg=f"call {step}, model {i}")
    assert "FAILED: model 0's forward changes" in str(fused.fusion_report)


class WarmUpNorm(nn.Module):
    """Python state (one-by-one models) and a batch norm a user may freeze."""

    def __init__(self):
        super().__init__()
        self.warm = WarmUp()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.warm(x))


def test_models_one_by_one_keep_their_attributes_and_submodule_modes():
    # Each program (per mode and input signature) had its own loop of models, so the
    # counters of a train -> eval -> train sequence started over per program and unfuse()
    # gave the counters of fusing time; and a submodule's eval() set on the fused module
    # after its program was built did not reach the models.
    torch.manual_seed(0)
    models = [WarmUpNorm() for _ in range(3)]
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(6, 4)
    steps = [("train", None), ("eval", None), ("train", None), ("train", "norm"),
             ("train", None)]
    with pytest.warns(FusionWarning, match="one by one"):
        for mode, frozen in steps:
            for m in (fused, *models):
                m.train(mode == "train")
                if frozen:
                    m.get_submodule(frozen).eval()
            out = fused(x)
            for i, m in enumerate(models):
                torch.testing.assert_close(out[i], m(x), msg=f"{mode} {frozen}, model {i}")
    for back, m in zip(fused.unfuse(), models):
        assert back.warm.calls == m.warm.calls == len(steps)
        torch.testing.assert_close(back.norm.running_mean, m.norm.running_mean)


def test_traced_values_kept_in_attributes_are_not_python_state():
    class Inspectable(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            self.last_hidden = h  # for inspection: a traced value, not state
            return h.relu()

    models = models_of(Inspectable)
    fused = hftc.fuse(models)
    assert not any(hasattr(m, "last_hidden") for m in models)  # no Proxy left behind
    fused(torch.randn(5, 4))
    assert fused.fusion_report.check.passed and fused.last_program().one_by_one is None


def test_a_wrong_fused_op_is_named_by_module(monkeypatch):
    """A fusion rule that computes something else (here a layer norm kernel off by a
    factor, as a bug would be) is caught by the check, which names the first module whose
    output differs; the models then run one by one, correctly."""
    real = rt_norms.layer_norm

    def off_by_ten_percent(*args, **kwargs):
        return real(*args, **kwargs) * 1.1

    monkeypatch.setattr(rt_norms, "layer_norm", off_by_ten_percent)
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.ReLU(), nn.Linear(4, 2))
              for _ in range(3)]
    x = torch.randn(5, 4)
    fused = hftc.fuse(models)
    with pytest.warns(FusionWarning, match=r"the first module whose output differs is "
                                           r"module `1` \(LayerNorm\): its output \(call 1\)"):
        out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))


def test_a_branch_between_modules_is_said_so():
    with pytest.warns(FusionWarning, match=r"every module's output agrees with model 0's own "
                                           r"forward: the difference arises in forward's own "
                                           r"code between modules"):
        hftc.fuse(models_of(ExactTypeCheck))(torch.randn(6, 4))


@pytest.mark.parametrize("layer", [nn.Dropout, nn.Dropout2d, nn.AlphaDropout,
                                   nn.FeatureAlphaDropout])
def test_dropout_under_inference_mode_is_compared_by_value(layer):
    """Under inference_mode ATen's dropout reaches the mode whole (``aten.dropout``), not
    as ``bernoulli_`` and a product: the model's own forward kept its random mask and the
    check failed a right program."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(2, 4, 1), layer(0.3)) for _ in range(3)]
    fused = hftc.fuse(models)
    with torch.inference_mode():
        fused(torch.randn(2, 2, 3, 3))
    check = fused.fusion_report.check
    assert check.passed and not check.shapes_only


@pytest.mark.parametrize("fn", [F.dropout, F.alpha_dropout, F.dropout2d,
                                F.feature_alpha_dropout])
def test_constant_dropout_is_the_same_whole_or_decomposed(fn):
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    with ConstantRandomness():
        decomposed = fn(x, 0.3, True)
        with torch.inference_mode():
            whole = fn(x, 0.3, True)
    torch.testing.assert_close(whole, decomposed, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n, picks", [(1, (0,)), (2, (0, 1)), (3, (0, 1, 2)), (5, (0, 2, 4))])
def test_the_check_compares_a_middle_model_too(n, picks):
    """Models 0 and N-1 only: a per-model value that the first and the last model share
    (a sweep grid [1, 7, 1]) hid a wrong middle model from the check."""
    fused = hftc.fuse([nn.Linear(4, 2) for _ in range(n)])
    fused(torch.randn(3, 4))
    assert fused.fusion_report.check.models == picks
    assert fused.fusion_report.check.passed


class RenormedLookup(nn.Module):
    """nn.Embedding(max_norm=...) renormalizes its weight's rows in place in forward; the
    weight is read before the lookup too (a tied output layer)."""

    def __init__(self, counter: bool = False):
        super().__init__()
        self.counter = counter
        self.calls = 0
        self.e = nn.Embedding(10, 8, max_norm=1.0)
        with torch.no_grad():
            self.e.weight.mul_(2)

    def forward(self, ids):
        if self.counter:
            self.calls += 1
        w = self.e.weight * 1.0
        return F.linear(self.e(ids), w)


def test_the_check_puts_back_the_weights_forward_writes_into():
    # The check built the models' copies after the fused run had renormalized the rows:
    # a false difference, then the one-by-one fallback, which crashed in a bare
    # RuntimeError (autograd forbids writing into unbind's views).  The check's run puts
    # the weights it wrote back, so the first call reads what the models' first call does.
    torch.manual_seed(0)
    models = [RenormedLookup() for _ in range(3)]
    ids = torch.tensor([[1, 2, 3, 1], [4, 0, 2, 9]])
    fused = hftc.fuse(copy.deepcopy(models))
    out = fused(ids)  # a FusionWarning would fail this test
    assert fused.fusion_report.check.passed
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(ids))
    # Run one by one (Python state), such a model is refused clearly.
    fused = hftc.fuse([RenormedLookup(counter=True) for _ in range(2)])
    with pytest.warns(FusionWarning, match="one by one"), \
            pytest.raises(hftc.errors.TraceError, match="writes into one of its parameters"):
        fused(ids)


class KeepsPositiveRows(nn.Module):
    """x[mask] with a per-model mask: each model keeps another number of rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h[h[:, 0] > 0].sum(0)


def test_results_of_different_shapes_run_the_models_one_by_one():
    # The one-by-one fallback's stack of ragged results crashed in a bare torch.stack error.
    torch.manual_seed(0)
    models = [KeepsPositiveRows().double() for _ in range(3)]
    x = torch.randn(8, 4, dtype=torch.float64)
    assert len({int((m.fc(x)[:, 0] > 0).sum()) for m in models}) > 1
    fused = hftc.fuse(copy.deepcopy(models))
    with pytest.warns(FusionWarning, match=r"because `\S+` gave the models results of "
                                           r"different shapes") as caught:
        out = fused(x)
    assert caught[0].filename == __file__  # the user's call, not hftc's internals
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
    with pytest.raises(hftc.errors.RaggedResultError, match=r"different shapes \(\[\d+, 4\]"):
        hftc.fuse(copy.deepcopy(models), check=False)(x)


class ScaledByItsLargestWeight(nn.Module):
    """A Python number read from a per-model tensor (.item()) used in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) / self.fc.weight.abs().max().item()


def test_per_model_python_values_run_the_models_one_by_one():
    # It failed with a FusionError that named no fix and did not fall back.
    torch.manual_seed(0)
    models = [ScaledByItsLargestWeight().double() for _ in range(3)]
    x = torch.randn(5, 4, dtype=torch.float64)
    fused = hftc.fuse(copy.deepcopy(models))
    with pytest.warns(FusionWarning, match=r"because `Tensor\.item\(\)` returned different "
                                           r"Python values") as caught:
        line = inspect.currentframe().f_lineno + 1
        out = fused(x)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)  # the user's line
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))



# The 5,000-example fuzz profile's bf16 case: per-model batch norm and leaky slopes, a
# head that sums 50 features into one small value (-0.007 from terms near 1).
_CANCELLING = {"family": "image", "input": (1, 2, 5, 5),
               "layers": [("batch", 2, True), ("act", "leaky_relu", 2)], "per_model": True,
               "head": ("view", 50, 3, 1, "leaky_relu")}


def test_bf16_rounding_of_a_cancelling_output_is_not_a_difference():
    # Under bf16 autocast model 1's own forward is 4.4% from float64 on this input, the
    # fused program 2.1%: 6.2% apart, beyond the 5% tolerance, and the check ran the
    # models one by one (no speed-up, a warning blaming the user's code).  A difference
    # no larger than the model's own rounding (against a float64 run) is now rounding.
    torch.manual_seed(2892)
    models = [build(_CANCELLING, i) for i in range(2)]
    x = torch.randn(2, 1, 2, 5, 5, generator=torch.Generator().manual_seed(2892))
    fused = hftc.fuse(copy.deepcopy(models), in_dims=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused(x)
    assert fused.last_program().one_by_one is None
    for i, m in enumerate(models):
        exact = copy.deepcopy(m).double()(x[i].double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            own = m(x[i])
        assert (out[i].double() - exact).norm() <= max(
            2 * (own.double() - exact).norm(), 5e-2 * exact.norm())


def test_a_wrong_fused_op_is_caught_under_bf16_autocast(monkeypatch):
    # The float64 run that tells bf16 rounding from a difference must not excuse a
    # kernel that is off by 10%.
    real = rt_norms.layer_norm
    monkeypatch.setattr(rt_norms, "layer_norm", lambda *a, **k: real(*a, **k) * 1.1)
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.ReLU(), nn.Linear(4, 2))
              for _ in range(3)]
    x = torch.randn(5, 4)
    fused = hftc.fuse(models)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(FusionWarning, match=r"module `1` \(LayerNorm\)"):
            out = fused(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x))


class CountsIfTensor(nn.Module):
    """Counts its calls only when its input is a tensor: while traced it is a Proxy, so the
    fused program never counts, though its outputs are the models' own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            self.calls.add_(1)
        return self.fc(x)


def test_buffers_forward_writes_are_checked_too():
    # The outputs agreed and the check passed; the fused program then ran and the models'
    # counts stayed 0 (each stock model counts its calls).
    models = models_of(CountsIfTensor)
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(5, 4)
    with pytest.warns(FusionWarning, match=r"model 0's buffers after forward\['calls'\] "):
        out = fused(x)
    fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
        m(x)
        assert fused.state_dict()["calls"][i] == m.calls == 2
    assert not fused.fusion_report.check.passed
