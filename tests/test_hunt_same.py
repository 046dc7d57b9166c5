"""Each model only its own, after fusing too: a plain attribute the models' forward reads,
set on the fused module or on one of its submodules after fusing, is refused (the fused
program, the models one by one and ``unfuse()`` were all built from each model's own
value, and nothing read the fused module's), naming the attribute, model 0's value, the
user's line and the buffer that can change between calls.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import hftc


class Attention(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return self.q(x) * self.scale


class Tempered(nn.Module):  # a temperature the user's loop anneals
    def __init__(self, i: int):
        super().__init__()
        self.attn = Attention(1.0 + i)
        self.temperature = 1.0 + i

    def forward(self, x):
        return self.attn(x).tanh() / self.temperature


class Buffered(nn.Module):  # the way out the error names
    def __init__(self, t: float):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("temperature", torch.tensor(t, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) / self.temperature


def _x():
    return torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("strategy", ["auto", "model_loop"])
def test_a_models_attribute_set_on_the_fused_module_is_refused(strategy):
    torch.manual_seed(0)
    models = [Tempered(i).double() for i in range(3)]
    fused = hftc.fuse(copy.deepcopy(models), strategy=strategy)
    x = _x()
    fused(x)
    with pytest.raises(hftc.errors.FusionArgumentError) as info:
        fused.temperature = 0.5
    text = str(info.value)
    assert "fused.temperature = 0.5" in text and "model 0's is 1.0" in text
    assert "test_hunt_same.py" in text and "register_buffer('temperature'" in text
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"fused\.attn\.scale = 3\.0"):
        fused.attn.scale = 3.0
    assert "temperature" not in fused.__dict__ and "scale" not in fused.attn.__dict__
    out = fused(x)  # still each model's own
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
    # hftc's own options and names the models do not hold are set as on any module
    fused.check = False
    fused.note = "mine"
    fused.attn.note = 1
    assert fused.note == "mine" and fused.attn.note == 1


@pytest.mark.parametrize("strategy", ["auto", "fused", "model_loop"])
def test_a_buffer_changed_after_fusing_is_each_models_own(strategy):
    """What the error says to do: a buffer, set per model on the fused module."""
    torch.manual_seed(0)
    models = [Buffered(1.0 + i).double() for i in range(3)]
    fused = hftc.fuse(copy.deepcopy(models), strategy=strategy)
    x = _x()
    fused(x)
    fused.temperature.fill_(0.5)
    fused.temperature[2] = 4.0
    for m, t in zip(models, (0.5, 0.5, 4.0)):
        m.temperature.fill_(t)
    out = fused(x)
    for i, (m, own) in enumerate(zip(models, fused.unfuse())):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(own(x), m(x), rtol=1e-12, atol=1e-12)


class WithCopies(nn.Module):  # tensor-less modules: the fused tree holds model 0's copies
    def __init__(self, slope: float):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.LeakyReLU(slope)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.act(self.lin(x)))


@pytest.mark.parametrize("strategy", ["auto", "model_loop"])
@pytest.mark.parametrize("slopes", [(0.1, 0.1, 0.1), (0.1, 0.2, 0.3)], ids=["equal", "differ"])
def test_a_copied_modules_attribute_changed_after_fusing_is_refused(strategy, slopes):
    """``fused.act`` is model 0's LeakyReLU: where the N slopes were equal the fused
    program called it for every model (a new slope reached all N in the fused program and
    none in the models one by one or unfuse()), where they differ it read each model's
    own (the change reached none); ``m.p = 0.0`` over fused.modules() left dropout on."""
    torch.manual_seed(0)
    models = [WithCopies(s).double().eval() for s in slopes]
    fused = hftc.fuse(copy.deepcopy(models), strategy=strategy)
    x = _x()
    fused(x)
    fused.act.negative_slope = 0.9
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"fused\.act\.negative_slope was set to 0\.9 after fusing "
                             r"\(it was 0\.1\).*Set it back"):
        fused(x)
    fused.act.negative_slope = 0.1  # set back: runs, each model's own
    out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
    for module in fused.train().modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"fused\.eval\(\) turns dropout"):
        fused(x)


def test_a_models_module_replaced_on_the_fused_module_is_refused():
    torch.manual_seed(0)
    fused = hftc.fuse([WithCopies(0.1).double() for _ in range(3)])
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"fused\.act = Tanh\(\.\.\.\)"):
        fused.act = nn.Tanh()
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"fused\.lin = Linear"):
        fused.lin = nn.Linear(4, 4)
    assert isinstance(fused.act, nn.LeakyReLU)
    fused.extra = nn.ReLU()  # a module the models do not hold is added as usual
    assert fused.extra in list(fused.modules())


def test_a_models_attribute_changed_after_fusing_warns_naming_it():
    """``for m in models: m.temperature = t`` after fusing: the fused module copied the
    models and runs each one's fuse-time value; a UsageWarning says so (within 4N calls,
    one model compared every fourth call), once."""
    torch.manual_seed(0)
    models = [Tempered(i).double() for i in range(3)]
    fused = hftc.fuse(models)
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):  # unchanged: nothing to say
            fused(x)
    models[2].attn.scale = 9.0
    with pytest.warns(hftc.UsageWarning, match=r"model 2 given to hftc\.fuse has "
                      r"`attn\.scale` = 9\.0 now \(3\.0 when fused\)") as record:
        for _ in range(4 * 3):  # (one call in 4 compares one model)
            fused(x)
    assert len(record) == 1 and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per module
        for _ in range(3):
            fused(x)


class Counted(nn.Module):  # forward changes a plain attribute itself: no warning
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def test_an_attribute_the_models_forward_changes_is_not_a_users_change():
    torch.manual_seed(0)
    models = [Counted().double() for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hftc.FusionWarning)
        fused = hftc.fuse(models)
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hftc.FusionWarning)  # (run one by one: said so)
        warnings.simplefilter("error", hftc.UsageWarning)
        for _ in range(3):
            models[0](x)  # the user's own call of an original model
            models[1](x)
            fused(x)


def test_a_torch_modules_attribute_changed_on_a_model_after_fusing_warns():
    """torch.nn's modules are compared a few a call: ``models[1].drop.p = 0.0`` is seen
    within their count's calls."""
    torch.manual_seed(0)
    models = [WithCopies(0.1).double() for _ in range(3)]
    fused = hftc.fuse(models)
    x = _x()
    fused(x)
    models[1].drop.p = 0.0
    with pytest.warns(hftc.UsageWarning, match=r"model 1 given to hftc\.fuse has `drop\.p` "
                      r"= 0\.0 now \(0\.5 when fused\)"):
        for _ in range(len(list(fused.modules())) * 3 * 4):
            fused(x)


class Noisy(nn.Module):  # draws from a torch.Generator it holds
    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gen = gen

    def forward(self, x):
        h = self.lin(x)
        return h + torch.randn(h.shape, generator=self.gen, dtype=h.dtype)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("shared", [True, False], ids=["one generator", "one each"])
def test_a_draw_from_a_generator_the_model_holds_is_refused_by_name(frontend, shared):
    """fx kept the generator as a graph constant (``_opaque_obj0``), which model 0's
    copy lacked: a raw UnboundLocalError from hftc's shape propagation (or a
    MismatchError naming ``_opaque_obj0``), where one program would have drawn every
    model's numbers from model 0's generator."""
    one = torch.Generator().manual_seed(7)
    models = [Noisy(one if shared else torch.Generator().manual_seed(i)).double()
              for i in range(3)]
    x = _x()
    with pytest.raises(hftc.TraceError, match=r"model 0 \(Noisy\) at .*test_hunt_same\.py:\d+ "
                       r"in forward: .*random numbers from self\.gen \(a torch\.Generator"
                       r".*Draw from the default generator"):
        hftc.fuse(models, frontend=frontend, example_inputs=(x,))


class Picky(nn.Module):  # a module no rule fuses, whose call fails for one model's value
    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        if self.scale > 2:
            raise ValueError("scale too large")
        return x * self.scale


def test_the_fallback_puts_model_0s_value_back_when_a_models_call_raises():
    """The one-by-one fallback of a module sets model i's own hyper-parameters on model
    0's copy in turn; an error in model i's call left model i's there, so the next call
    (the user's retry) ran model 0 with model i's value."""
    from hftc.lowering.runtime.fallback import loop_module

    module = Picky()
    x = torch.ones(3, 2, 4)
    overrides = tuple((("scale", v),) for v in (1.0, 3.0, 1.5))
    with pytest.raises(ValueError, match="scale too large"):
        loop_module(module, 3, ((True,), {}), (x,), {}, overrides)
    assert module.scale == 1.0
    out = loop_module(module, 3, ((True,), {}), (x,), {}, ((("scale", 1.0),),) * 3)
    torch.testing.assert_close(out, x)


class Gained(nn.Module):
    GAIN = 1.0  # a knob of the class, read by every instance's forward

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.GAIN


@pytest.mark.parametrize("strategy", ["auto", "model_loop"])
def test_a_class_attribute_changed_after_fusing_warns(strategy, monkeypatch):
    """``Gained.GAIN = 2.0`` after fusing: the fused program kept 1.0 (traced), the models
    one by one and unfuse() read 2.0, so fused(x) depended on the strategy, silently."""
    monkeypatch.setattr(Gained, "GAIN", 1.0)
    torch.manual_seed(0)
    fused = hftc.fuse([Gained().double() for _ in range(3)], strategy=strategy)
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused(x)
    Gained.GAIN = 2.0
    with pytest.warns(hftc.UsageWarning, match=r"class attribute Gained\.GAIN was set to "
                      r"2\.0 after fusing \(it was 1\.0\)") as record:
        fused(x)
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per module
        fused(x)


_SCALES: dict[int, float] = {}


class Registered(nn.Module):  # per-model state outside the model, keyed by its identity
    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _SCALES[id(self)] = scale

    def forward(self, x):
        return self.lin(x) * _SCALES[id(self)]


@pytest.mark.parametrize("strategy", ["auto", "fused", "model_loop"])
def test_state_kept_outside_the_model_is_refused_by_name(strategy):
    """Models whose Python state is equal share model 0's trace; the first-call check,
    which would catch a value kept outside the model, runs copies, whose lookup raised,
    and a check that could not run a model passed (CheckResult.skipped): model 0's scale
    for every model, silently.  A copy that raises inside its own forward now fails the
    check, and the models cannot run one by one either: refused, naming the lookup."""
    torch.manual_seed(0)
    models = [Registered(1.0 + i).double() for i in range(3)]
    with pytest.raises(hftc.TraceError, match=r"model 0's own forward, run on its copy, "
                       r"raised KeyError: \d+ at .*test_hunt_same\.py:\d+ in forward: "
                       r".*_SCALES\[id\(self\)\].*keep each model's values on the model"):
        hftc.fuse(models, strategy=strategy)(_x())


TEMPERATURE = 1.0  # a module global the forward below reads


class GlobalTempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) / TEMPERATURE


@pytest.mark.parametrize("strategy", ["auto", "model_loop"])
def test_a_global_forward_reads_changed_after_fusing_warns(strategy, monkeypatch):
    """``TEMPERATURE = 2.0`` after fusing: traced, the fused program kept 1.0, while the
    models one by one and unfuse() read 2.0; pickled, the module compares what it loads."""
    monkeypatch.setitem(globals(), "TEMPERATURE", 1.0)
    torch.manual_seed(0)
    fused = hftc.fuse([GlobalTempered().double() for _ in range(3)], strategy=strategy)
    x = _x()
    fused(x)
    twin = pickle.loads(pickle.dumps(fused))
    twin(x)  # (its program compiled anew, at 1.0)
    globals()["TEMPERATURE"] = 2.0
    for module in (fused, twin):
        with pytest.warns(hftc.UsageWarning, match=r"the global .*test_hunt_same\.TEMPERATURE "
                          r"was set to 2\.0 after fusing \(it was 1\.0\)"):
            module(x)


class DirectLSTM(nn.Module):  # reads the LSTM's _flat_weights itself (torch.lstm by hand)
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 5)

    def forward(self, x):
        h0 = x.new_zeros(1, x.shape[1], 5)
        out, _, _ = torch.lstm(x, (h0, h0), self.lstm._flat_weights, True, 1, 0.0,
                               self.training, False, False)
        return out


def test_an_unfused_lstm_holds_its_own_flat_weights():
    """A model's copy (unfuse(), the first-call check's) registered its own parameters
    but kept the meta template's in nn.LSTM's _flat_weights: torch.lstm on them failed
    ('parameter tensor at meta'), which the check then took for a model it cannot call."""
    torch.manual_seed(0)
    models = [DirectLSTM().double() for _ in range(2)]
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    fused = hftc.fuse(models)
    out = fused(x)
    assert "checked against" in str(fused.fusion_report.check)
    for i, (own, m) in enumerate(zip(fused.unfuse(), models)):
        assert all(w.device.type == "cpu" for w in own.lstm._flat_weights)
        torch.testing.assert_close(own(x), m(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
