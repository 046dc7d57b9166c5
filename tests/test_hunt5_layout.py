"""Layout and kernel-shape waste in fused CNN steps (hftc.lowering.runtime.layout, .conv,
.random), each checked against the models one by one:

* a flatten / reshape / ``contiguous`` that copies a channels-last map gives its gradient
  back channels-last (``layout.layout_copy``), so the elementwise backward before it
  (relu, batch norm) reads operands of one layout;
* the shared few-tap convolution (``shared_im2col``) takes its weight gradient as the
  wide ``rows^T @ dy`` product;
* per-model dropout masks: the same distribution per model, the same masks for the
  same seed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn

import hftc
from hftc.lowering.runtime import conv as rt_conv
from hftc.lowering.runtime import layout as rt_layout

DTYPES = [torch.float64, torch.float32]


class FlattenAfterRelu(nn.Module):
    """The sweep demo's CNN (``hftc.sweep.digits.DigitsCNN``) without its dropout."""

    def __init__(self, cin=1, width=4, size=8):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * (size // 2) ** 2, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return self.fc(torch.flatten(F.relu(self.conv2(x)), 1))


class FlattenAfterBatchNorm(nn.Module):
    def __init__(self, cin=1, width=4, size=8):
        super().__init__()
        self.conv = nn.Conv2d(cin, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width * size * size, 3)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).flatten(1))


class FlattenAfterMaxPool(nn.Module):
    def __init__(self, cin=1, width=4, size=8):
        super().__init__()
        self.conv = nn.Conv2d(cin, width, 3, padding=1)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(width * (size // 2) ** 2, 3)

    def forward(self, x):
        return self.fc(self.flat(F.max_pool2d(torch.tanh(self.conv(x)), 2)))


class ReshapeAfterRelu(nn.Module):
    def __init__(self, cin=1, width=4, size=8):
        super().__init__()
        self.conv = nn.Conv2d(cin, width, 3, padding=1)
        self.fc = nn.Linear(width * size * size, 3)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).reshape(x.size(0), -1))


class ContiguousViewAfterRelu(nn.Module):
    def __init__(self, cin=1, width=4, size=8):
        super().__init__()
        self.conv = nn.Conv2d(cin, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.fc = nn.Linear(width * size * size, 3)

    def forward(self, x):
        h = F.relu(self.conv2(F.relu(self.conv(x))))
        return self.fc(h.contiguous().view(x.size(0), -1))


MODELS = [FlattenAfterRelu, FlattenAfterBatchNorm, FlattenAfterMaxPool, ReshapeAfterRelu,
          ContiguousViewAfterRelu]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("n,batch,cin,size", [(3, 4, 1, 8), (2, 1, 3, 6), (4, 5, 2, 4)],
                         ids=lambda v: str(v))
def test_flattened_channels_last_maps_match_the_models(model, channels_last, dtype, n, batch,
                                                       cin, size):
    torch.manual_seed(0)
    models = [model(cin=cin, size=size) for _ in range(n)]
    x = torch.randn(batch, cin, size, size)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    # two rounds with an SGD step between: the step's gradients and the next forward
    check_equivalence(models, x, dtype=dtype, steps=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_inputs_flattened_after_relu_match_the_models(dtype):
    torch.manual_seed(0)
    models = [FlattenAfterRelu(cin=3, width=8) for _ in range(3)]
    x = torch.randn(3, 4, 3, 8, 8).contiguous()
    xs = x.movedim(2, -1).contiguous().movedim(-1, 2)  # each model's map channels-last
    for inputs in (x, xs):
        check_equivalence(models, inputs, in_dims=0, dtype=dtype, steps=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["flatten", "reshape", "contiguous"])
def test_a_layout_copy_gives_the_gradient_back_in_the_input_layout(op, dtype):
    """relu's backward reads its saved channels-last result and a channels-last gradient."""
    torch.manual_seed(0)
    folded = torch.randn(2, 3 * 4, 5, 5, dtype=dtype).contiguous(memory_format=torch.channels_last)
    leaf = folded.requires_grad_()
    x = rt_layout.unfold_channels(leaf, 3, True).relu()           # [3, 2, 4, 5, 5]
    copy = {"flatten": lambda t: t.flatten(2), "reshape": lambda t: t.reshape(3, 2, -1),
            "contiguous": lambda t: t.contiguous()}[op](x)
    y = rt_layout.layout_copy(x, copy)
    assert torch.equal(y, copy) and y.is_contiguous()
    seen = []  # tensor hooks run in registration order: this one sees layout_copy's result
    x.register_hook(lambda g: seen.append(g.stride()))
    grad = torch.randn(y.shape, dtype=dtype)
    y.backward(grad)
    assert seen == [x.stride()]
    expected = torch.where(x > 0, grad.view(x.shape), 0).detach()
    torch.testing.assert_close(rt_layout.unfold_channels(leaf.grad, 3, True), expected,
                               rtol=0, atol=0)


def test_a_view_or_a_leaf_gets_no_hook():
    folded = torch.randn(2, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    leaf = folded.requires_grad_()
    # a leaf: the user's tensor keeps the gradient autograd gives it
    y = rt_layout.layout_copy(leaf, leaf.contiguous())
    assert not leaf._backward_hooks and y.is_contiguous()
    # a view of a contiguous map copies nothing
    x = torch.randn(2, 8, 3, 3, requires_grad=True) * 1
    assert rt_layout.layout_copy(x, x.flatten(1))._is_view()
    assert not x._backward_hooks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,batch,cin,k,size,bias,input_grad", [
    (16, 32, 1, 3, 8, True, False), (3, 2, 3, 3, 7, False, True), (2, 5, 1, 5, 9, True, True),
    (4, 1, 2, 3, 4, True, False)])
def test_shared_im2col_matches_the_models(dtype, n, batch, cin, k, size, bias, input_grad):
    torch.manual_seed(0)
    x = torch.randn(batch, cin, size, size, dtype=dtype, requires_grad=input_grad)
    weight = torch.randn(n, 8, cin, k, k, dtype=dtype, requires_grad=True)
    b = torch.randn(n, 8, dtype=dtype, requires_grad=True) if bias else None
    assert rt_conv.conv_lowerings(x, weight, b, padding=1, spatial=2, x_batched=False)[0] == \
        "shared_im2col"
    y = rt_conv.conv(x, weight, b, 1, 1, spatial=2, x_batched=False)
    ref = torch.stack([F.conv2d(x, weight[i], None if b is None else b[i], 1, 1)
                       for i in range(n)])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    grad = torch.randn_like(ref)
    params = [weight] + ([b] if bias else []) + ([x] if input_grad else [])
    got = torch.autograd.grad(y, params, grad)
    want = torch.autograd.grad(ref, params, grad)
    for g, w in zip(got, want):  # sums of B*H*W products: rounding scales with the largest
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * max(1.0, w.abs().max().item()))


def test_shared_im2col_has_a_double_backward():
    torch.manual_seed(0)
    x = torch.randn(2, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 3, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def fn(x, weight, bias):
        return rt_conv.conv(x, weight, bias, 1, 1, spatial=2, x_batched=False,
                            lowering="shared_im2col")

    assert torch.autograd.gradcheck(fn, (x, weight, bias))
    assert torch.autograd.gradgradcheck(fn, (x, weight, bias))


def test_digits_cnn_step_matches_stock_sgd():
    """The demo's workload (dropout off): fused step with hftc.optim.SGD against the models
    one by one with torch.optim.SGD, three steps."""
    from hftc.sweep.digits import DigitsCNN
    torch.manual_seed(0)
    n = 4
    models = [DigitsCNN() for _ in range(n)]
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    fused = hftc.fuse(models)
    refs = [copy.deepcopy(m) for m in models]
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in refs]
    loss = hftc.per_model(F.cross_entropy)
    for _ in range(3):
        opt.zero_grad()
        loss(fused(x), y).sum().backward()
        opt.step()
        for m, o in zip(refs, opts):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    out = fused(x)
    for i, m in enumerate(refs):
        torch.testing.assert_close(out[i], m(x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ per-model dropout masks

def _sigmas(kept: float, keep: float, n: int) -> float:
    return abs(kept - keep) / max(keep * (1 - keep) / n, 1e-300) ** 0.5


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16], ids=str)
def test_per_model_masks_keep_each_models_rate_independently(dtype):
    from hftc.lowering.runtime import random as rt_random
    torch.manual_seed(0)
    p = [0.0, 0.05, 0.3, 0.5, 0.9, 1.0, 0.5]
    x = torch.ones(len(p), 64, 999, dtype=dtype)  # numel not a multiple of 8
    out = rt_random.per_model_dropout(x, p, True)
    for i, rate in enumerate(p):
        kept = out[i] != 0
        assert _sigmas(kept.double().mean().item(), 1 - rate, kept.numel()) < 5, i
        if 0 < rate < 1:  # kept elements scaled by exactly 1 / keep, in x's dtype
            scale = 1 / (1 - torch.tensor(rate, dtype=dtype))
            assert torch.equal(out[i][kept], torch.full_like(out[i][kept], scale.item()))
    # models 3 and 6 share a rate, not their masks; neighbours uncorrelated
    a, b = (out[3] != 0).double().flatten(), (out[6] != 0).double().flatten()
    assert not torch.equal(a, b)
    assert _sigmas((a * b).mean().item(), 0.25, a.numel()) < 5
    flat = (out[3] != 0).double().flatten()
    assert _sigmas((flat[1:] * flat[:-1]).mean().item(), 0.25, flat.numel() - 1) < 5


def test_masks_follow_the_seed_and_the_rest_draws_are_the_ties_only():
    from hftc.lowering.runtime import random as rt_random
    keep = torch.tensor([0.7, 0.2, 0.999]).reshape(3, 1, 1)
    torch.manual_seed(5)
    first = rt_random.bernoulli_mask((3, 17, 33), keep, torch.empty(0))
    torch.manual_seed(5)
    again = rt_random.bernoulli_mask((3, 17, 33), keep, torch.empty(0))
    assert torch.equal(first, again)
    assert not torch.equal(rt_random.bernoulli_mask((3, 17, 33), keep, torch.empty(0)), first)


def test_fused_dropout_cnn_runs_the_same_masks_for_the_same_seed_and_passes_the_check():
    """The demo's CNN with per-model dropout: the first-call check (ConstantRandomness:
    every element kept) finds the fused program equal to the models, so no warning and
    the fused strategy; the same seed gives the same step."""
    import warnings

    from hftc.sweep.digits import DigitsCNN
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))

    def run():
        torch.manual_seed(0)
        models = [DigitsCNN(dropout=0.1 * i) for i in range(4)]
        fused = hftc.fuse(models)
        loss = hftc.per_model(F.cross_entropy)
        with warnings.catch_warnings():
            warnings.simplefilter("error", hftc.errors.FusionWarning)
            out = fused(x)
        loss(out, y).sum().backward()
        return out.detach(), [p.grad.clone() for p in fused.parameters()]

    out, grads = run()
    out2, grads2 = run()
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    # model 0 (p = 0) is its own model's output
    torch.manual_seed(0)
    model0 = DigitsCNN(dropout=0.0)
    torch.testing.assert_close(out[0], model0(x), rtol=1e-5, atol=1e-6)
