"""A fused state dict holds each model's extra state (``get_extra_state``), as torch
keys it, a list of the N models' own::

    model i:  {"_extra_state": s_i, "norm._extra_state": t_i, "fc.weight": W_i, ...}
    fused:    {"_extra_state": [s_0 .. s_N-1], "norm._extra_state": [t_0 ..], "fc.weight": [N, ...]}

``fused.load_state_dict`` gives each model its own back; where that changes Python state
the fused program was built from, the models are fused anew (same parameter objects),
so the program runs each model's loaded state, never the old one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hftc
from hftc.errors import FusionArgumentError


class Tagged(nn.Linear):
    """A submodule whose extra state the forward does not read."""

    def get_extra_state(self):
        return {"note": getattr(self, "note", "none")}

    def set_extra_state(self, state):
        self.note = state["note"]


class Scaled(nn.Module):
    """Extra state the forward reads: the scale."""

    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.head = Tagged(5, 3)
        self.scale = scale

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) * self.scale)

    def get_extra_state(self):
        return {"scale": self.scale}

    def set_extra_state(self, state):
        self.scale = state["scale"]


def _models(scales, dtype=torch.float64):
    torch.manual_seed(0)
    models = [Scaled(s).to(dtype) for s in scales]
    for i, m in enumerate(models):
        m.head.note = f"model {i}"
    return models


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_state_dict_holds_each_models_extra_state(n):
    models = _models([1.0 + i for i in range(n)])
    fused = hftc.fuse(models)
    sd = fused.state_dict()
    assert sd["_extra_state"] == [{"scale": 1.0 + i} for i in range(n)]
    assert sd["head._extra_state"] == [{"note": f"model {i}"} for i in range(n)]
    for i, m in enumerate(models):
        own = fused.model_state_dict(i)
        assert own["_extra_state"] == m.state_dict()["_extra_state"]
        assert own["head._extra_state"] == {"note": f"model {i}"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strategy", ["fused", "model_loop"])
def test_loading_extra_state_the_forward_reads_runs_each_models_loaded_state(dtype, strategy):
    saved_models = _models([0.5, 2.0, 3.0], dtype)
    saved = hftc.fuse(saved_models, strategy=strategy).state_dict()
    torch.manual_seed(1)
    fused = hftc.fuse([Scaled(1.0).to(dtype) for _ in range(3)], strategy=strategy)
    params = [id(p) for p in fused.parameters()]
    optimizer = hftc.optim.SGD(fused.parameters(), lr=0.1)
    fused.load_state_dict(saved)
    assert [id(p) for p in fused.parameters()] == params  # the optimizer's still
    x = torch.randn(4, 6, dtype=dtype)
    out = fused(x)
    tol = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for i, m in enumerate(saved_models):
        torch.testing.assert_close(out[i], m(x), **tol)
    assert [m.scale for m in fused.unfuse()] == [0.5, 2.0, 3.0]
    assert [m.head.note for m in fused.unfuse()] == ["model 0", "model 1", "model 2"]
    # backward and a step on the same parameters, each model its own gradient
    out.sum().backward()
    for i, m in enumerate(saved_models):
        m.zero_grad()
        m(x).sum().backward()
        torch.testing.assert_close(fused.fc.weight.grad[i], m.fc.weight.grad, **tol)
    optimizer.step()


@pytest.mark.parametrize("mode", ["train", "eval", "head eval"])
def test_a_round_trip_changes_nothing(mode, monkeypatch):
    models = _models([1.0, 2.0])
    fused = hftc.fuse(models)
    fused.train(mode == "train")
    if mode == "head eval":
        fused.train()
        fused.head.eval()
    x = torch.randn(3, 6, dtype=torch.float64)
    before = fused(x)
    anew = []
    monkeypatch.setattr(type(fused), "_fuse_own_models_anew", lambda self, why: anew.append(why))
    fused.load_state_dict(fused.state_dict())
    assert anew == []  # (the fused module's modes are no change of the models' programs)
    assert torch.equal(fused(x), before)


def test_a_fused_module_inside_a_users_module_saves_and_loads_under_its_prefix():
    class Holder(nn.Module):
        def __init__(self, fused):
            super().__init__()
            self.fused = fused

    holder = Holder(hftc.fuse(_models([1.0, 4.0])))
    sd = holder.state_dict()
    assert sd["fused._extra_state"] == [{"scale": 1.0}, {"scale": 4.0}]
    other = Holder(hftc.fuse(_models([1.0, 1.0])))
    other.load_state_dict(sd)
    assert [m.scale for m in other.fused.unfuse()] == [1.0, 4.0]


def test_a_missing_or_malformed_extra_state_is_refused():
    fused = hftc.fuse(_models([1.0, 2.0]))
    sd = fused.state_dict()
    missing = {k: v for k, v in sd.items() if k != "head._extra_state"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head._extra_state"'):
        fused.load_state_dict(missing)
    fused.load_state_dict(missing, strict=False)  # as torch: what is there is loaded
    with pytest.raises(FusionArgumentError, match=r"`_extra_state` must hold the 2 models' "
                                                  r"extra states, a list of 2"):
        fused.load_state_dict({**sd, "_extra_state": {"scale": 3.0}})


def test_one_models_state_dict_or_another_ns_is_refused_saying_what_to_do():
    fused = hftc.fuse(_models([1.0, 2.0, 3.0]))
    # one model's (its `_extra_state` a dict, read before its tensors): the tensors' advice
    with pytest.raises(FusionArgumentError, match=r"got one model's state dict .*"
                                                  r"hftc.replace_models\(fused, \{j: model\}\)"):
        fused.load_state_dict(fused.model_state_dict(1))
    with pytest.raises(FusionArgumentError, match="a fused module of 2 models saved it"):
        fused.load_state_dict(hftc.fuse(_models([1.0, 2.0])).state_dict())
    assert [m.scale for m in fused.unfuse()] == [1.0, 2.0, 3.0]


def test_replace_models_and_keep_models_keep_each_models_extra_state():
    models = _models([1.0, 2.0, 3.0])
    fused = hftc.fuse(models)
    optimizer = hftc.optim.SGD(fused.parameters(), lr=0.1)
    newcomer = _models([7.0])[0]
    hftc.replace_models(fused, {1: newcomer})
    assert fused.state_dict()["_extra_state"] == [{"scale": 1.0}, {"scale": 7.0},
                                                  {"scale": 3.0}]
    x = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(fused(x)[1], newcomer(x))
    hftc.keep_models(fused, [2, 1])
    assert fused.state_dict()["_extra_state"] == [{"scale": 3.0}, {"scale": 7.0}]
    out = fused(x)
    torch.testing.assert_close(out[0], models[2](x))
    torch.testing.assert_close(out[1], newcomer(x))
    out.sum().backward()
    optimizer.step()  # the optimizer follows the kept models (hftc.keep_models)
    assert optimizer.num_models == 2


class ScaledWidth(Scaled):
    def __init__(self, width: int, scale: float):
        super().__init__(scale)
        self.fc = nn.Linear(6, width)
        self.head = Tagged(width, 3)


def test_pad_widths_models_take_their_loaded_extra_state_at_their_own_widths():
    """A padded array keeps each model's own object twice (padded, and at its own widths
    for unfuse): a loaded extra state reaches both, and the program runs it."""
    torch.manual_seed(0)
    saved_models = [ScaledWidth(w, s).double() for w, s in ((8, 1.0), (12, 2.0), (16, 3.0))]
    saved = hftc.fuse(saved_models, pad_widths=True).state_dict()
    torch.manual_seed(1)
    fused = hftc.fuse([ScaledWidth(w, 1.0).double() for w in (8, 12, 16)], pad_widths=True)
    fused.load_state_dict(saved)
    x = torch.randn(4, 6, dtype=torch.float64)
    out = fused(x)
    for i, m in enumerate(saved_models):
        torch.testing.assert_close(out[i], m(x))
    assert [m.scale for m in fused.unfuse()] == [1.0, 2.0, 3.0]
    assert [m.fc.out_features for m in fused.unfuse()] == [8, 12, 16]


class Counted(nn.Module):
    """A step counter that forward advances and the extra state holds.

    The models then run one by one, each in a shell that keeps its own count."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return self.fc(x) * (1.0 + 0.0 * self.steps)

    def get_extra_state(self):
        return {"steps": self.steps}

    def set_extra_state(self, state):
        self.steps = state["steps"]


@pytest.mark.filterwarnings("ignore::hftc.errors.FusionWarning")  # (one by one, said below)
def test_extra_state_a_forward_changes_is_saved_and_loaded_as_the_forwards_left_it():
    torch.manual_seed(0)
    fused = hftc.fuse([Counted().double() for _ in range(3)])
    x = torch.randn(2, 4, dtype=torch.float64)
    with pytest.warns(hftc.FusionWarning, match="steps"):
        fused(x)
    fused(x)
    fused(x)
    # saved as the forwards left it (the template kept the count of fusing: 0)
    assert fused.state_dict()["_extra_state"] == [{"steps": 3}] * 3
    sd = {**fused.state_dict(), "_extra_state": [{"steps": s} for s in (10, 20, 30)]}
    fused.load_state_dict(sd)
    # loaded into what the models run in (the shells' old counts overrode it)
    assert [m.steps for m in fused.unfuse()] == [10, 20, 30]
    assert fused.state_dict()["_extra_state"] == [{"steps": s} for s in (10, 20, 30)]
    fused(x)
    assert [m.steps for m in fused.unfuse()] == [11, 21, 31]
    assert [fused.model_state_dict(i)["_extra_state"]["steps"] for i in range(3)] == [11, 21, 31]


class Branching(nn.Module):
    """Extra state a Python branch of forward reads: models that differ in it do not fuse
    (a module only some models run; an elementwise op only some run would fuse, each
    model's own: tests/test_hunt4_zoo.py)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.gate = nn.Linear(3, 3)
        self.head = Tagged(3, 2)
        self.gated = False

    def forward(self, x):
        h = self.fc(x)
        return self.head(self.gate(h) if self.gated else h)

    def get_extra_state(self):
        return {"gated": self.gated}

    def set_extra_state(self, state):
        self.gated = state["gated"]


def test_a_refused_load_leaves_each_model_the_state_its_program_was_built_from():
    torch.manual_seed(0)
    fused = hftc.fuse([Branching().double() for _ in range(3)])
    x = torch.randn(5, 4, dtype=torch.float64)
    fused(x)
    before = fused.state_dict()
    gated = {**before, "_extra_state": [{"gated": False}, {"gated": True}, {"gated": False}]}
    with pytest.raises(FusionArgumentError, match="do not fuse again"):
        fused.load_state_dict(gated)
    # a malformed later key (the root's is read first): the earlier ones are not kept
    with pytest.raises(FusionArgumentError, match="`head._extra_state` must hold"):
        fused.load_state_dict({**before, "_extra_state": [{"gated": True}] * 3,
                               "head._extra_state": [{"note": "loaded"}]})
    after = fused.state_dict()
    assert after["_extra_state"] == [{"gated": False}] * 3
    assert after["head._extra_state"] == before["head._extra_state"]
    out = fused(x)
    for i, model in enumerate(fused.unfuse()):
        assert model.gated is False
        torch.testing.assert_close(out[i], model(x))


class Quantized(nn.Module):
    """``set_extra_state`` writes the module's own tensor: a non-persistent scale buffer.

    TransformerEngine's way with its FP8 scales; torch's load runs it on the module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale

    def get_extra_state(self):
        return {"scale": self.scale.clone()}

    def set_extra_state(self, state):
        self.scale.copy_(state["scale"])


@pytest.mark.parametrize("strategy", ["fused", "model_loop"])
def test_a_set_extra_state_that_writes_the_modules_tensors_writes_each_models(strategy):
    torch.manual_seed(0)
    saved_models = [Quantized() for _ in range(3)]
    for i, m in enumerate(saved_models):
        m.scale.fill_(1.0 + i)
    saved = hftc.fuse(saved_models, strategy=strategy).state_dict()
    torch.manual_seed(1)
    fused = hftc.fuse([Quantized() for _ in range(3)], strategy=strategy)
    fused.load_state_dict(saved)
    # each model's scale, as loading model i's own state dict into model i gives it
    assert torch.equal(fused.scale, torch.tensor([[1.0] * 3, [2.0] * 3, [3.0] * 3]))
    x = torch.randn(2, 4)
    out = fused(x)
    for i, m in enumerate(saved_models):
        own = Quantized()
        own.load_state_dict(fused.model_state_dict(i))
        assert torch.equal(own.scale, m.scale)
        torch.testing.assert_close(out[i], m(x))
        torch.testing.assert_close(fused.unfuse_model(i)(x), m(x))


class Counting(nn.Module):
    """``get_extra_state`` reads tensor values into Python numbers.

    ``int(self.seen)``, ``.item()``: a template's meta tensors cannot give them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.fc(x)

    def get_extra_state(self):
        return {"seen": int(self.seen), "norm": self.fc.weight.norm().item()}

    def set_extra_state(self, state):
        self.seen_when_saved = state["seen"]


def test_an_extra_state_read_from_the_tensors_values_is_each_models():
    torch.manual_seed(0)
    models = [Counting() for _ in range(3)]
    fused = hftc.fuse(models)
    fused(torch.randn(2, 4))
    fused(torch.randn(5, 4))
    states = fused.state_dict()["_extra_state"]
    assert [s["seen"] for s in states] == [7, 7, 7]
    assert [s["norm"] for s in states] == [m.fc.weight.norm().item() for m in models]
    assert states == [fused.model_state_dict(i)["_extra_state"] for i in range(3)]


def test_after_a_load_that_fuses_anew_the_users_models_are_still_the_ones_fused():
    models = _models([1.0, 2.0, 3.0])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1 * (i + 1)) for i, m in enumerate(models)]
    fused = hftc.fuse(models)
    saved = fused.state_dict()
    fused.load_state_dict({**saved, "_extra_state": [{"scale": s} for s in (5.0, 6.0, 7.0)]})
    # (fused anew from copies: their parameters were the ones fuse_optimizers looked for)
    fused_optimizer = hftc.optim.fuse_optimizers(fused, optimizers)
    x = torch.randn(4, 6, dtype=torch.float64)
    fused(x).sum().backward()
    # a load between backward and step leaves the gradients, as torch's does
    fused.load_state_dict({**saved, "_extra_state": [{"scale": s} for s in (5.0, 6.0, 7.1)]})
    fused.load_state_dict({**saved, "_extra_state": [{"scale": s} for s in (5.0, 6.0, 7.0)]})
    fused_optimizer.step()
    for i, (m, scale) in enumerate(zip(models, (5.0, 6.0, 7.0))):
        m.scale = scale
        m(x).sum().backward()
        optimizers[i].step()
        torch.testing.assert_close(fused.fc.weight[i], m.fc.weight)


class Masked(nn.Module):
    """Of a width; extra state: a scale the forward reads and a mask buffer it writes."""

    def __init__(self, width: int, scale: float = 1.0):
        super().__init__()
        self.fc = nn.Linear(4, width)
        self.out = nn.Linear(width, 2)
        self.scale = scale
        self.register_buffer("mask", torch.ones(width), persistent=False)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)) * self.mask) * self.scale

    def get_extra_state(self):
        return {"scale": self.scale, "mask": self.mask.clone()}

    def set_extra_state(self, state):
        self.scale = state["scale"]
        self.mask.copy_(state["mask"])


def test_pad_widths_loads_each_models_extra_state_at_its_own_widths():
    torch.manual_seed(0)
    saved_models = [Masked(w, s) for w, s in [(3, 1.0), (5, 2.0), (4, 3.0)]]
    for m in saved_models:
        m.mask[0] = 0.0
    x = torch.randn(2, 4)
    saved_fused = hftc.fuse(saved_models, pad_widths=True)
    saved_fused(x)
    saved = saved_fused.state_dict()
    assert [s["mask"].shape[0] for s in saved["_extra_state"]] == [3, 5, 4]  # its own widths
    torch.manual_seed(1)
    fused = hftc.fuse([Masked(w) for w in (3, 5, 4)], pad_widths=True)
    fused(x)
    fused.load_state_dict(saved)  # (the originals kept the old scale: 1.0 for every model)
    out = fused(x)
    for i, m in enumerate(saved_models):
        torch.testing.assert_close(out[i], m(x))
        own = fused.unfuse_model(i)
        assert own.scale == m.scale and torch.equal(own.mask, m.mask)
    assert [s["scale"] for s in fused.state_dict()["_extra_state"]] == [1.0, 2.0, 3.0]


class Gate(nn.Module):
    """No tensors, but extra state.

    The fused tree copied model 0's, whose own saving and loading stood for every model's."""

    def __init__(self, on: float):
        super().__init__()
        self.on = on

    def forward(self, x):
        return x * self.on

    def get_extra_state(self):
        return {"on": self.on}

    def set_extra_state(self, state):
        self.on = state["on"]


class Gated(nn.Module):
    def __init__(self, on: float):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.gate = Gate(on)

    def forward(self, x):
        return self.gate(self.fc(x))


def test_a_module_without_tensors_saves_and_loads_each_models_extra_state():
    torch.manual_seed(0)
    saved_models = [Gated(on) for on in (1.0, 2.0, 3.0)]
    saved = hftc.fuse(saved_models).state_dict()
    assert saved["gate._extra_state"] == [{"on": 1.0}, {"on": 2.0}, {"on": 3.0}]  # not model 0's
    torch.manual_seed(1)
    fused = hftc.fuse([Gated(1.0) for _ in range(3)])
    assert fused.load_state_dict(saved) is not None  # strict: nothing missing, nothing left
    x = torch.randn(2, 4)
    out = fused(x)
    for i, m in enumerate(saved_models):
        torch.testing.assert_close(out[i], m(x))
        assert fused.unfuse_model(i).gate.on == m.gate.on



class Calibrated(nn.Module):
    """A ``set_extra_state`` that reads the loaded weight and writes a persistent buffer of
    its own module, as a quantization observer's does: torch calls it after the module's
    own tensors load (and before its submodules')."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, 4))
        self.register_buffer("scale", torch.ones(()))
        self.margin = 1.0

    def forward(self, x):
        return x @ self.weight.t() / self.scale

    def get_extra_state(self):
        return {"margin": self.margin}

    def set_extra_state(self, state):
        self.margin = state["margin"]
        with torch.no_grad():
            self.scale.copy_(self.weight.abs().max() * self.margin)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [2, 3])
def test_extra_state_is_set_after_the_tensors_load_as_torch_does(n, dtype):
    torch.manual_seed(0)
    models = [Calibrated(3).to(dtype) for _ in range(n)]
    saved = [Calibrated(3).to(dtype) for _ in range(n)]
    for i, m in enumerate(saved):
        m.margin = 1.0 + i
    states = [m.state_dict() for m in saved]
    fused = hftc.fuse([Calibrated(3).to(dtype) for _ in range(n)])
    stacked = {key: (torch.stack([s[key] for s in states]) if torch.is_tensor(states[0][key])
                     else [s[key] for s in states]) for key in states[0]}
    fused.load_state_dict(stacked)
    for m, s in zip(models, states):
        m.load_state_dict(s)
    assert [float(m.scale) for m in models] == [
        float(m.weight.detach().abs().max() * m.margin) for m in saved]  # (torch's order)
    x = torch.randn(5, 4, dtype=dtype)
    out = fused(x)
    for i, (m, back) in enumerate(zip(models, fused.unfuse())):
        torch.testing.assert_close(out[i], m(x), rtol=0, atol=0)
        assert torch.equal(back.scale, m.scale) and back.margin == m.margin


def test_a_hook_on_the_fused_module_survives_a_load_that_fuses_anew():
    models = _models([1.0, 2.0])
    fused = hftc.fuse(models)
    calls = []
    fused.register_forward_hook(lambda module, args, out: calls.append(module))
    state = fused.state_dict()
    state["_extra_state"] = [{"scale": 3.0}, {"scale": 4.0}]  # (the program reads it)
    fused.load_state_dict(state)
    x = torch.randn(2, 6, dtype=torch.float64)
    out = fused(x)
    assert calls == [fused]
    torch.testing.assert_close(out[1], fused.unfuse()[1](x))
    assert fused.unfuse()[1].scale == 4.0
