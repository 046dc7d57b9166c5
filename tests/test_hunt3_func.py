"""Hunt 3: ``torch.func`` / ``torch.autograd`` transforms through a fused module, and each
model's own Python state.

- Forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``, ``torch.autograd.forward_ad``
  dual numbers) through a fused module failed with torch's bare ``NotImplementedError``
  ("You must implement the jvp function for custom autograd.Function") wherever the fused
  program ran one of hftc's own autograd Functions (the batched linear, the linear chain,
  the 2-d max pool through channels-last, the contiguous gradient of a reduction, the
  short-row softmax and cross-entropy), though the models themselves differentiate
  fine: each result is now the models' own.
- Two models whose Python state differs only in a function's attributes
  (``f.gain = 0.5``) or in the attributes of a value of a builtin kind (an ``int``
  subclass carrying a ``.scale``) were proved to run one program
  (``same_program.program_difference``): one trace served both and the first-call check
  skipped the differing model, so a model in the middle silently ran model 0's value.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, hessian, jacfwd, jvp

import hftc
import hftc.errors
from hftc.lowering.runtime import linear as rt_linear
from hftc.lowering.runtime import losses as rt_losses
from hftc.lowering.runtime import reduction as rt_reduction
from hftc.lowering.runtime import spatial as rt_spatial

F64 = {"rtol": 1e-10, "atol": 1e-12}
F32 = {"rtol": 1e-4, "atol": 1e-5}


def plain_calls(monkeypatch, function) -> list[int]:
    """``[calls]`` of ``function.in_plain_ops`` from now on (a spy, the result unchanged)."""
    calls = [0]
    plain = function.in_plain_ops

    def spy(*args):
        calls[0] += 1
        return plain(*args)

    monkeypatch.setattr(function, "in_plain_ops", staticmethod(spy))
    return calls


def mlp(sizes=(6, 16, 16, 4)) -> nn.Sequential:
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.pool(F.relu(self.conv(x)).contiguous())
        return self.fc(x.amax(dim=(2, 3)))


def params_of(module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in module.named_parameters()}


def tangents_like(params: dict) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {k: torch.randn(v.shape, dtype=v.dtype, generator=generator) for k, v in params.items()}


def own_jvp(models, fused_tangents, x):
    """Each model's ``d out / d params . tangent`` by stock ``torch.func.jvp``, stacked."""
    outs = []
    for i, m in enumerate(models):
        own = params_of(m)
        outs.append(jvp(lambda p, m=m: functional_call(m, p, (x,)), (own,),
                        ({k: fused_tangents[k][i] for k in own},))[1])
    return torch.stack(outs)


@pytest.fixture
def pool_through_channels_last(monkeypatch):
    monkeypatch.setattr(rt_spatial, "_POOL_VIA_CHANNELS_LAST_MIN_NUMEL", 1)


@pytest.fixture
def short_rows(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")


@pytest.mark.parametrize("make", [mlp, CNN], ids=["mlp", "cnn"])
def test_forward_mode_ad_through_a_fused_module_is_each_models_own(
        monkeypatch, pool_through_channels_last, make):
    torch.manual_seed(0)
    models = [make().double() for _ in range(3)]
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(4, 6) if make is mlp else torch.randn(2, 3, 8, 8)
    x = x.double()
    functions = [rt_linear._LinearChain] if make is mlp else [
        rt_spatial._MaxPool2dThroughChannelsLast, rt_reduction._ContiguousGradient,
        rt_linear._BatchedLinear]
    calls = [plain_calls(monkeypatch, function) for function in functions]
    t = torch.randn_like(x)
    # d out / d x . t, the first call (which compiles and checks) inside jvp
    out, tangent = jvp(fused, (x,), (t,))
    torch.testing.assert_close(out, torch.stack([m(x) for m in models]), **F64)
    torch.testing.assert_close(tangent, torch.stack([jvp(m, (x,), (t,))[1] for m in models]),
                               **F64)
    # over the parameters, by torch.func and by forward_ad's dual numbers
    params = params_of(fused)
    tangents = tangents_like(params)
    want = own_jvp(models, tangents, x)
    got = jvp(lambda p: functional_call(fused, p, (x,)), (params,), (tangents,))[1]
    torch.testing.assert_close(got, want, **F64)
    with fwAD.dual_level():
        duals = {k: fwAD.make_dual(v, tangents[k]) for k, v in params.items()}
        got = fwAD.unpack_dual(functional_call(fused, duals, (x,))).tangent
    torch.testing.assert_close(got, want, **F64)
    # jacfwd, and hessian (jacfwd of jacrev) of a function calling the fused module
    torch.testing.assert_close(jacfwd(fused)(x), torch.stack([jacfwd(m)(x) for m in models]),
                               **F64)
    got = hessian(lambda v: fused(v).tanh().sum())(x)
    want = sum(hessian(lambda v, m=m: m(v).tanh().sum())(x) for m in models)
    torch.testing.assert_close(got, want, **F64)
    assert [c[0] >= 1 for c in calls] == [True] * len(calls), calls


def test_hessian_over_a_fused_modules_parameters_is_block_diagonal_per_model():
    torch.manual_seed(0)
    models = [mlp((3, 4, 2)).double() for _ in range(2)]
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(5, 3, dtype=torch.float64)
    params = params_of(fused)
    got = hessian(lambda p: functional_call(fused, p, (x,)).square().sum())(params)
    for i, m in enumerate(models):
        want = hessian(lambda p, m=m: functional_call(m, p, (x,)).square().sum())(params_of(m))
        for a in want:
            for b in want[a]:  # got[a][b]: [N, *shape_a, N, *shape_b]; model i's own block
                block = got[a][b][i][(slice(None),) * (params[a].dim() - 1) + (i,)]
                torch.testing.assert_close(block, want[a][b], **F64)


def test_forward_mode_through_the_short_row_softmax_and_cross_entropy(monkeypatch, short_rows):
    # float32 classifiers of 10 classes: hftc's _ShortRowSoftmax (the models' own
    # log_softmax) and _ShortRowCrossEntropy (the per-model loss) under jvp.
    class LogSoftmaxClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 10)

        def forward(self, x):
            return F.log_softmax(self.fc2(torch.tanh(self.fc1(x))), dim=-1)

    torch.manual_seed(0)
    models = [LogSoftmaxClassifier() for _ in range(4)]
    fused = hftc.fuse(copy.deepcopy(models))
    x, y = torch.randn(64, 12), torch.randint(0, 10, (64,))
    y[:3] = -100
    fused(x)
    softmax = plain_calls(monkeypatch, rt_reduction._ShortRowSoftmax)
    cross_entropy = plain_calls(monkeypatch, rt_losses._ShortRowCrossEntropy)
    params = params_of(fused)
    tangents = tangents_like(params)
    got = jvp(lambda p: functional_call(fused, p, (x,)), (params,), (tangents,))[1]
    torch.testing.assert_close(got, own_jvp(models, tangents, x), **F32)
    assert softmax[0] == 1
    for reduction in ("mean", "sum", "none"):
        def loss(p, reduction=reduction):
            logits = functional_call(fused, p, (x,)).exp()  # (cross-entropy over its exp)
            return hftc.per_model(F.cross_entropy)(logits, y, reduction=reduction)

        value, tangent = jvp(loss, (params,), (tangents,))
        want_values, want_tangents = [], []
        for i, m in enumerate(models):
            own = params_of(m)
            v, t = jvp(lambda p, m=m, r=reduction: F.cross_entropy(
                functional_call(m, p, (x,)).exp(), y, reduction=r),
                (own,), ({k: tangents[k][i] for k in own},))
            want_values.append(v)
            want_tangents.append(t)
        torch.testing.assert_close(value, torch.stack(want_values), **F32)
        torch.testing.assert_close(tangent, torch.stack(want_tangents), **F32)
    assert cross_entropy[0] == 3


# ------------------------------------------------------------------ each model's own state


def _function_with_gain(gain):
    def scale(t):
        return t * scale.gain

    scale.gain = gain  # (a function attribute: what functools.wraps and decorators set)
    return scale


class FunctionAttribute(nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.post = _function_with_gain(gain)

    def forward(self, x):
        return self.post(self.lin(x))


class Level(int):
    """An int that carries attributes (an IntEnum-like level with its own scale)."""


class IntWithAttributes(nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.level = Level(2)
        self.level.gain = gain

    def forward(self, x):
        return self.lin(x) * self.level.gain


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("cls", [FunctionAttribute, IntWithAttributes], ids=lambda c: c.__name__)
def test_state_in_a_functions_or_an_ints_attributes_is_each_models_own(cls, frontend):
    # The differing model at 1 of 6: not one of the check's own picks (0, N // 2, N - 1).
    torch.manual_seed(0)
    models = [cls(3.0 if i == 1 else 1.0).double() for i in range(6)]
    x = torch.randn(3, 4, dtype=torch.float64)
    options = {} if frontend == "symbolic" else {"example_inputs": (x,)}
    for strategy in ("auto", "fused"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hftc.FusionWarning)
            fused = hftc.fuse(copy.deepcopy(models), strategy=strategy, frontend=frontend,
                              **options)
            for _ in range(2):
                out = fused(x)
                for i, m in enumerate(models):
                    torch.testing.assert_close(out[i], m(x), msg=lambda s, i=i: f"{i}: {s}")
        for own, m in zip(fused.unfuse(), models):
            torch.testing.assert_close(own(x), m(x))


# ------------------------------------------------------------------ refusals name the attribute


class HFStyleConfig:
    """A transformers-style config object (``self.config.use_cache``)."""

    def __init__(self, use_cache=True, num_heads=2):
        self.use_cache, self.num_heads, self.layer_norm_eps = use_cache, num_heads, 1e-12


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return h.view(x.shape[0], self.config.num_heads, -1).softmax(-1).flatten(1)


class CachedModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.attn = Attention(config)
        self.opts = {"heads": [config.num_heads]}

    def forward(self, x):
        h = self.attn(x)
        if self.config.use_cache:
            return h
        return h * 2


@pytest.mark.parametrize("differing, said", [
    (dict(use_cache=False), ["`config.use_cache` (False vs True)",
                             "`attn.config.use_cache` (False vs True)"]),
    (dict(num_heads=4), ["`config.num_heads` (4 vs 2)", "`opts['heads'][0]` (4 vs 2)"]),
])
def test_a_refusal_names_the_attribute_path_whose_value_differs(differing, said):
    # The MismatchError named the op and the line that differ, but not the user's value
    # that made them differ (a config flag, a dict entry), nor where it sits.
    models = [CachedModel(HFStyleConfig(**(differing if i == 2 else {}))) for i in range(4)]
    with pytest.raises(hftc.MismatchError) as info:
        hftc.fuse(models)
    message = str(info.value)
    assert "model 2 of 4 cannot be fused" in message
    line = next(line for line in message.splitlines() if "Python state" in line)
    assert line.startswith("  model 2's Python state differs from model 0's at ")
    for path in said:
        assert path in line, (path, line)


# ------------------------------------------------------------------ functional_call's tensors


@pytest.mark.parametrize("first_call", [True, False])
@pytest.mark.parametrize("name, shape", [("0.weight", (8, 6)), ("0.weight", (3, 8, 6)),
                                         ("0.bias", (8,))])
def test_functional_call_with_unstacked_tensors_says_what_they_must_be(first_call, name, shape):
    # One model's [8, 6] weight (or a stack of another N) given to functional_call raised
    # a bare IndexError / RuntimeError from the batched linear's kernel.
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)) for _ in range(2)]
    fused = hftc.fuse(models)
    x = torch.randn(5, 6)
    if not first_call:
        fused(x)
    with pytest.raises(hftc.errors.FusionArgumentError) as info:
        functional_call(fused, {name: torch.randn(shape)}, (x,))
    message = str(info.value)
    own = list(dict(models[0].named_parameters())[name].shape)
    assert f"`{name}` is {list(shape)} on this call" in message
    assert f"built for {[2, *own]}" in message and "stack_module_state" in message
    assert "test_hunt3_func.py" in message  # the user's line
    stacked = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models])
               for k in [name]}
    torch.testing.assert_close(functional_call(fused, stacked, (x,)),
                               torch.stack([m(x) for m in models]))


# ------------------------------------------------------------------ a per-model number by keyword


class KeywordScalar(nn.Module):
    def __init__(self, form, value):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.form, self.value = form, value

    def forward(self, x):
        h = self.lin(x)
        if self.form == "torch.mul":
            return torch.mul(h, other=self.value)
        if self.form == "Tensor.div":
            return h.div(other=self.value)
        if self.form == "torch.add":
            return torch.add(h, other=self.value)
        if self.form == "torch.sub alpha":
            return torch.sub(h, other=h.tanh(), alpha=self.value)
        return torch.pow(h.abs() + 1, exponent=self.value)


@pytest.mark.parametrize("form", ["torch.mul", "Tensor.div", "torch.add", "torch.sub alpha",
                                  "torch.pow"])
def test_a_per_model_number_passed_by_keyword_fuses_as_by_position(form):
    # torch.mul(h, other=self.scale) was a MismatchError ("argument `other`: 2.0 vs 0.5")
    # where torch.mul(h, self.scale) and h * self.scale fuse, each model its own number.
    torch.manual_seed(0)
    models = [KeywordScalar(form, v).double() for v in (0.5, 0.5, 2.0, 0.5)]
    fused = hftc.fuse(copy.deepcopy(models), strategy="fused")
    x = torch.randn(3, 4, dtype=torch.float64)
    out = fused(x)
    assert fused.fusion_report.fallbacks == []
    out.square().sum().backward()
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), **F64)
        m(x).square().sum().backward()
        torch.testing.assert_close(fused.lin.weight.grad[i], m.lin.weight.grad, **F64)


# ------------------------------------------------------------------ batched gradients through convs


class ConvNet(nn.Module):
    """A 1x1 conv after a depthwise one (the pointwise kernels and their layout hook), a
    pool and a linear head; eval-mode batch norm."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 6, 1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.c1(x)))
        x = F.relu(self.pw(self.dw(x)))
        return self.fc(self.pool(x.contiguous()).amax((2, 3)))


def test_batched_gradients_through_fused_convs_are_each_models_own(pool_through_channels_last):
    # jacrev, per-sample gradients (vmap(grad)) and is_grads_batched=True failed in the
    # fused convs: the 1x1 conv's gradient-layout hook copied vmap's batched gradient into
    # a plain tensor ("vmap: inplace arithmetic ... not possible"), the pointwise kernel's
    # backward wrote with out= ("Batching rule not implemented for aten::mm.out"), and a
    # stacked input under vmap was made channels-last ("NYI: Tensor.clone(memory_format)").
    torch.manual_seed(0)
    models = [ConvNet().double().eval() for _ in range(3)]
    fused = hftc.fuse(copy.deepcopy(models)).eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 5, (2,))
    torch.testing.assert_close(torch.func.jacrev(fused)(x),
                               torch.stack([torch.func.jacrev(m)(x) for m in models]), **F64)
    xr = x.clone().requires_grad_()
    out = fused(xr)
    grads = torch.randn(4, *out.shape, dtype=torch.float64)
    got, = torch.autograd.grad(out, xr, grads, is_grads_batched=True)
    want = torch.stack([sum(torch.autograd.grad(m(xr), xr, grads[k, i])[0]
                            for i, m in enumerate(models)) for k in range(4)])
    torch.testing.assert_close(got, want, **F64)
    buffers = {k: v.detach() for k, v in fused.named_buffers()}
    for stacked_inputs in (False, True):
        module = hftc.fuse(copy.deepcopy(models), in_dims=0).eval() if stacked_inputs else fused
        inputs = torch.randn(3, *x.shape, dtype=torch.float64) if stacked_inputs else x

        def loss(p, xi, yi, module=module):
            out = functional_call(module, (p, buffers), (xi.unsqueeze(-4),))
            return hftc.per_model(F.cross_entropy)(out, yi[None]).sum()

        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, int(stacked_inputs), 0))(
            params_of(module), inputs, y)
        for s in range(2):
            for i, m in enumerate(models):
                m.zero_grad()
                own = inputs[i] if stacked_inputs else inputs
                F.cross_entropy(m(own[s:s + 1]), y[s:s + 1]).backward()
                for name, p in m.named_parameters():
                    torch.testing.assert_close(per_sample[name][s, i], p.grad, **F64)


def test_is_grads_batched_through_a_fused_log_softmax_head(monkeypatch):
    # The per-model log-softmax head (large logits: one model at a time) wrote its
    # backward's GEMMs with out=, which torch.autograd.grad(..., is_grads_batched=True)
    # and autograd.functional.jacobian(vectorize=True) cannot batch.
    monkeypatch.setattr(rt_linear, "_PER_MODEL_BLOCK_BYTES", 0)
    monkeypatch.setattr(rt_linear, "_PER_MODEL_TOTAL_BYTES", 0)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 7)

        def forward(self, x):
            return F.log_softmax(self.fc2(torch.tanh(self.fc1(x))), dim=-1)

    torch.manual_seed(0)
    models = [Head().double() for _ in range(3)]
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    calls = [0]
    backward = rt_linear._PerModelLinearLogSoftmax.backward
    monkeypatch.setattr(rt_linear._PerModelLinearLogSoftmax, "backward", staticmethod(
        lambda *a: calls.__setitem__(0, calls[0] + 1) or backward(*a)))
    out = fused(x)
    grads = torch.randn(3, *out.shape, dtype=torch.float64)
    got, = torch.autograd.grad(out, x, grads, is_grads_batched=True)
    assert calls[0] == 1
    want = torch.stack([sum(torch.autograd.grad(m(x), x, grads[k, i])[0]
                            for i, m in enumerate(models)) for k in range(3)])
    torch.testing.assert_close(got, want, **F64)
    jacobian = torch.autograd.functional.jacobian(fused, x.detach(), vectorize=True)
    torch.testing.assert_close(jacobian, torch.stack(
        [torch.autograd.functional.jacobian(m, x.detach()) for m in models]), **F64)
