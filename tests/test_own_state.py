"""Each model is only ever its own (issue 44 item 1): Python state a model keeps outside
its parameters, buffers and plain attributes (a config dict, a dataclass, an options
object, a dict inside a submodule, a closure) is model i's own in everything hftc builds
from model i: the fused program, the first-call check's references, the models one by
one, ``unfuse()``, ``model_state_dict``, a pickled or deep-copied fused module,
``keep_models`` and a method fused anew.

Every pattern at N = 3, 5 and 8, with the one model that differs in every position, each
strategy, forward and backward, against the models run one by one by stock PyTorch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import types
import typing
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc


@dataclasses.dataclass
class Config:
    scale: float
    act: str = "relu"


class Options:  # a plain options object (argparse-like)
    def __init__(self, scale):
        self.scale = scale


class DictConfig(nn.Module):  # kuangliu's EfficientNet keeps self.cfg
    def __init__(self, s):
        super().__init__()
        self.cfg = {"scale": s, "name": "b0"}
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.cfg["scale"]


class DataclassConfig(nn.Module):  # nanoGPT's self.config
    def __init__(self, s):
        super().__init__()
        self.config = Config(s)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.config.scale


class Namespace(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.hp = types.SimpleNamespace(scale=s)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.hp.scale


class OptionsObject(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.opts = Options(s)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + self.opts.scale


class Scale(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.table = {"s": [s, 1.0]}

    def forward(self, x):
        return x * self.table["s"][0]


class NestedDict(nn.Module):  # a dict inside a submodule, in a list inside the dict
    def __init__(self, s):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.post = Scale(s)

    def forward(self, x):
        return self.post(torch.tanh(self.lin(x)))


class Closure(nn.Module):  # a function closing over the model's value
    def __init__(self, s):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.shift = lambda t: t - s

    def forward(self, x):
        return self.shift(self.lin(x))


class BranchOnConfig(nn.Module):  # the config picks the code path (tanh or relu)
    def __init__(self, s):
        super().__init__()
        self.config = Config(1.0, act="tanh" if s != 1.0 else "relu")
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return torch.tanh(y) if self.config.act == "tanh" else F.relu(y)


@dataclasses.dataclass(frozen=True)
class FrozenConfig:
    scale: float
    shift: float = 0.5


class Frozen(nn.Module):  # a frozen dataclass config (timm's / HF's style)
    def __init__(self, s):
        super().__init__()
        self.cfg = FrozenConfig(s, shift=s / 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.cfg.scale - self.cfg.shift


class Hyper(typing.NamedTuple):
    scale: float
    layers: tuple


class NamedTupleConfig(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.hp = Hyper(s, ({"gain": s}, {"gain": 1.0}))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.hp.scale) * self.hp.layers[0]["gain"]


class Head(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, x):
        return x * self.cfg.scale


class SharedConfig(nn.Module):  # one config object held by the model and a submodule
    def __init__(self, s):
        super().__init__()
        self.config = Config(s)
        self.lin = nn.Linear(4, 4)
        self.head = Head(self.config)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x))) + self.config.scale


class LeakyAct:  # a callable options object, not a module
    def __init__(self, slope):
        self.slope = slope

    def __call__(self, x):
        return F.leaky_relu(x, self.slope)


class CallableConfig(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = LeakyAct(s / 10)

    def forward(self, x):
        return self.act(self.lin(x) - 0.5)


PATTERNS = [DictConfig, DataclassConfig, Namespace, OptionsObject, NestedDict, Closure,
            BranchOnConfig, Frozen, NamedTupleConfig, SharedConfig, CallableConfig]
CASES = [(n, pos) for n in (3, 5, 8) for pos in range(n)]


def _models(cls, n, pos, value=3.0):
    torch.manual_seed(0)
    return [cls(value if i == pos else 1.0).double() for i in range(n)]


def _fused(models, strategy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hftc.FusionWarning)  # (fallbacks are fine here)
        return hftc.fuse(copy.deepcopy(models), strategy=strategy)


def _assert_each_own(fused, models, x):
    """Forward (twice: the first call checks), backward, unfuse and model_state_dict."""
    for _ in range(2):
        out = fused(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12,
                                       msg=lambda s, i=i: f"model {i}: {s}")
    out.square().sum().backward()
    for i, m in enumerate(models):
        m.zero_grad()
        m(x).square().sum().backward()
        torch.testing.assert_close(fused.lin.weight.grad[i], m.lin.weight.grad,
                                   rtol=1e-12, atol=1e-12)
    for i, (own, m) in enumerate(zip(fused.unfuse(), models)):
        assert type(own) is type(m)
        torch.testing.assert_close(own(x), m(x), rtol=1e-12, atol=1e-12)
        for key, value in fused.model_state_dict(i).items():
            torch.testing.assert_close(value, m.state_dict()[key])


@pytest.mark.parametrize("strategy", ["auto", "fused", "model_loop"])
@pytest.mark.parametrize("cls", PATTERNS, ids=lambda c: c.__name__)
def test_every_model_runs_and_returns_its_own_python_state(cls, strategy):
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for n, pos in CASES:
        models = _models(cls, n, pos)
        try:
            fused = _fused(models, strategy)
            _assert_each_own(fused, models, x)
        except hftc.MismatchError:
            assert cls is BranchOnConfig  # other code per model: refused by name
            continue
        except AssertionError as exc:
            raise AssertionError(f"N = {n}, the differing model at {pos}: {exc}") from exc


def test_unfused_copies_hold_each_models_own_objects():
    models = _models(DataclassConfig, 5, 3)
    fused = _fused(models, "auto")
    fused(torch.randn(2, 4, dtype=torch.float64))
    configs = [m.config for m in fused.unfuse()]
    assert [c.scale for c in configs] == [1.0, 1.0, 1.0, 3.0, 1.0]
    assert all(type(c) is Config for c in configs)
    assert len({id(c) for c in configs}) == 5  # copies, not the user's nor shared


def test_a_dict_config_dropout_rate_is_each_models_own():
    """EfficientNet's ``self.cfg['dropout_rate']`` read in forward: rates 0 and 1 give
    the input or zeros, so the rate each model ran at shows exactly, in every strategy."""

    class Dropping(nn.Module):
        def __init__(self, rate):
            super().__init__()
            self.cfg = {"dropout_rate": rate}
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return F.dropout(self.lin(x), self.cfg["dropout_rate"], self.training)

    x = torch.randn(3, 4)
    for strategy in ("auto", "fused", "model_loop"):
        for pos in range(4):
            models = [Dropping(1.0 if i == pos else 0.0) for i in range(4)]
            fused = _fused(models, strategy)
            for _ in range(2):
                out = fused(x)
                for i, m in enumerate(models):
                    want = torch.zeros(3, 4) if i == pos else m.lin(x)
                    torch.testing.assert_close(out[i], want, msg=f"{strategy} {pos} {i}")
            assert [m.cfg["dropout_rate"] for m in fused.unfuse()] == [
                1.0 if i == pos else 0.0 for i in range(4)]


def test_the_check_compares_every_model_whose_python_state_differs(monkeypatch):
    import hftc.lowering.check as check

    compared = []
    real = check.call_model
    monkeypatch.setattr(check, "call_model", lambda m, *a: compared.append(m) or real(m, *a))
    models = _models(DictConfig, 8, 5)
    fused = hftc.fuse(copy.deepcopy(models), strategy="fused")
    fused(torch.randn(2, 4, dtype=torch.float64))
    assert fused.fusion_report.check.models == (0, 4, 5, 7)
    assert len(compared) == 4


def test_pickled_copied_and_shrunk_fused_modules_keep_each_models_own():
    models = _models(NestedDict, 5, 2)
    x = torch.randn(3, 4, dtype=torch.float64)
    for strategy in ("fused", "model_loop"):
        fused = _fused(models, strategy)
        fused(x)
        buffer = io.BytesIO()
        torch.save(fused, buffer)
        buffer.seek(0)
        for twin in (copy.deepcopy(fused), torch.load(buffer, weights_only=False)):
            out = twin(x)
            for i, m in enumerate(models):
                torch.testing.assert_close(out[i], m(x))
                assert twin.unfuse()[i].post.table == m.post.table
        hftc.keep_models(fused, [2, 4])
        out = fused(x)
        torch.testing.assert_close(out[0], models[2](x))
        torch.testing.assert_close(out[1], models[4](x))
        assert [m.post.table["s"][0] for m in fused.unfuse()] == [3.0, 1.0]


def test_a_method_fused_anew_runs_each_models_own_state():
    class WithMethod(DictConfig):
        def score(self, x):
            return self.lin(x).sum(-1) * self.cfg["scale"]

    torch.manual_seed(0)
    models = [WithMethod(s).double() for s in (1.0, 1.0, 1.0, 2.0)]
    fused = _fused(models, "fused")
    x = torch.randn(3, 4, dtype=torch.float64)
    out = fused.score(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m.score(x))


def test_models_of_other_classes_come_back_as_their_own_class():
    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.tag = "a"

        def forward(self, x):
            return self.fc(x).relu()

    class B(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.tag = "b"

        def forward(self, x):
            return self.lin(x).relu()

    models = [A(), B(), A()]
    x = torch.randn(2, 4)
    for strategy in ("fused", "model_loop"):
        fused = _fused(models, strategy)
        out = fused(x)
        out.sum().backward()
        own = fused.unfuse()
        assert [type(m) for m in own] == [A, B, A] and own[1].tag == "b"
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x))
            torch.testing.assert_close(own[i](x), m(x))
        fused.eval()
        assert not any(m.training for m in fused.unfuse()[1].modules())


def test_a_partial_is_refused_or_each_models_own():
    class Partial(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.act = functools.partial(F.leaky_relu, negative_slope=s)

        def forward(self, x):
            return self.act(self.lin(x))

    torch.manual_seed(0)
    models = [Partial(s) for s in (0.1, 0.1, 0.3)]
    x = torch.randn(3, 4)
    try:
        fused = _fused(models, "auto")
    except hftc.FusionError as exc:
        assert "act" in str(exc)
        return
    out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))


def test_a_copy_shares_no_hook_or_ordered_dict_with_its_model():
    """deepcopy_module (every per-model copy: templates, the check's references,
    unfuse): the copy's hook dicts and an empty OrderedDict the model keeps are its own
    objects (a hook registered on the copy never reaches the model), and a hook the
    model has is copied with it."""
    from collections import OrderedDict

    from hftc.frontends.symbolic import deepcopy_module

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    model.cache = OrderedDict()
    calls = []
    model[1].register_forward_hook(lambda *a: calls.append("model's"))
    copied = deepcopy_module(model)
    for original, twin in zip(model.modules(), copied.modules()):
        for name, value in vars(original).items():
            if isinstance(value, dict):
                assert getattr(twin, name) is not value, name
    assert copied.cache == OrderedDict() and copied.cache is not model.cache
    copied[0].register_forward_hook(lambda *a: calls.append("copy's"))
    copied.cache["k"] = 1
    model(torch.randn(2, 3))
    assert calls == ["model's"] and model.cache == OrderedDict()
    assert not model[0]._forward_hooks
    copied(torch.randn(2, 3))
    assert calls == ["model's", "copy's", "model's"]


class _Warmup(nn.Module):
    """A warm-up schedule kept in a config dict and advanced by forward."""

    def __init__(self, warmup):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sched = {"step": 0, "warmup": warmup}

    def forward(self, x):
        self.sched["step"] += 1
        return self.lin(x) * min(1.0, self.sched["step"] / self.sched["warmup"])


class _Counted(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.scale = s

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.scale + self.calls


def _state(model):
    return model.sched if isinstance(model, _Warmup) else model.calls


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("strategy", ["auto", "fused", "model_loop"])
def test_state_forward_changes_in_place_is_each_models_own(strategy, frontend):
    """Tracing ran forward on the user's models: a dict it changed in place stayed
    changed (models 0 and 2 began at step 2), unseen, so their copies ran other warm-up
    factors than the models alone; under torch.export a plain counter went unseen and
    the fused program kept the value of its trace (right at the first call only)."""
    x = torch.randn(3, 4, dtype=torch.float64)
    for cls, values in ((_Warmup, (4.0, 4.0, 8.0)), (_Counted, (1.0, 1.0, 3.0))):
        torch.manual_seed(0)
        models = [cls(v).double() for v in values]
        torch.manual_seed(0)
        alone = [cls(v).double() for v in values]
        options = {} if frontend == "symbolic" else {"example_inputs": (x,)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hftc.FusionWarning)
            fused = hftc.fuse(models, strategy=strategy, frontend=frontend, **options)
        assert [_state(m) for m in models] == [_state(m) for m in alone]  # as they were
        for call in range(3):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", hftc.FusionWarning)
                out = fused(x)
            for i, m in enumerate(alone):
                torch.testing.assert_close(out[i], m(x), msg=f"{cls.__name__} call {call} "
                                                             f"model {i}")
        assert [_state(own) for own in fused.unfuse()] == [_state(m) for m in alone]
        assert _state(alone[0]) in (3, {"step": 3, "warmup": 4.0})


def test_fusing_leaves_no_traced_value_in_a_models_list_or_copy():
    """A forward that keeps its activations for inspection (``self.maps.append(h)``):
    tracing appended fx Proxies to model 0's own list, which unfuse() gave back."""

    class Recording(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.maps = []
            self.seen = types.SimpleNamespace(first=True)

        def forward(self, x):
            h = self.lin(x).softmax(-1)
            self.maps.append(h.detach())
            return h

    models = [Recording() for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = hftc.fuse(models)
        out = fused(torch.randn(2, 4))
    assert [m.maps for m in models] == [[], [], []]
    for i, own in enumerate(fused.unfuse()):
        assert not any(isinstance(v, torch.fx.Proxy) for v in own.maps), i
        torch.testing.assert_close(own(torch.ones(1, 4)), models[i](torch.ones(1, 4)))
    assert out.shape == (3, 2, 4)


def test_model_state_dict_is_each_models_own_keys_and_extra_state():
    """fused.model_state_dict(i) gave model 0's keys for a model of another class (which
    its own class then refused to load) and dropped each model's get_extra_state."""

    class A(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = s

        def forward(self, x):
            return self.fc(x).relu() * self.scale

        def get_extra_state(self):
            return {"scale": self.scale}

        def set_extra_state(self, state):
            self.scale = state["scale"]

    class B(A):
        def __init__(self, s):
            nn.Module.__init__(self)
            self.lin = nn.Linear(4, 4)
            self.scale = s

        def forward(self, x):
            return self.lin(x).relu() * self.scale

    torch.manual_seed(0)
    models = [A(1.0), B(2.0), A(3.0)]
    x = torch.randn(2, 4)
    for strategy in ("fused", "model_loop"):
        fused = _fused(models, strategy)
        fused(x).sum().backward()
        for i, m in enumerate(models):
            own = fused.model_state_dict(i)
            assert list(own) == list(m.state_dict()), i
            assert own["_extra_state"] == {"scale": m.scale}
            fresh = type(m)(0.0)
            fresh.load_state_dict(own)  # strict: every key its own
            assert fresh.scale == m.scale
            torch.testing.assert_close(fresh(x), m(x))
