"""The performance lowerings the benchmark work added to hftc/lowering/runtime/, against loops.

Each lowering changes how N models' convolutions run (and the memory layout of the
result), never what they compute: forward, input and weight gradients equal a loop
over the models, in float64, including batch size 1, where size-1 dims carry odd
strides (an ATen batch-norm backward returned wrong gradients for a channels-last
input laid out so; ``layout._canonical_strides`` restrides it).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.lowering.runtime import layout as rt_layout

DT = torch.float64


def _grads_match(models, fused, x, atol=1e-10):
    out = fused(x)
    ref = torch.stack([m(x) for m in models])
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=atol)
    g = torch.randn_like(out)
    out.backward(g)
    for i, m in enumerate(models):
        m(x).backward(g[i])
    fused_params = dict(fused.named_parameters())
    for name, p0 in models[0].named_parameters():
        if p0.grad is None:  # a layer this configuration does not use
            continue
        want = torch.stack([dict(m.named_parameters())[name].grad for m in models])
        torch.testing.assert_close(fused_params[name].grad, want, rtol=1e-9, atol=atol,
                                   msg=lambda s, name=name: f"{name}: {s}")


class Stem(nn.Module):
    """A shared-input few-tap conv (im2col lowering), then the layers that met the bug."""

    def __init__(self, cin, k, stride, padding, dilation, residual):
        super().__init__()
        self.conv = nn.Conv2d(cin, 3, k, stride=stride, padding=padding, dilation=dilation)
        self.residual = residual
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        y = F.relu(self.conv(x))
        if self.residual:
            y = y + F.relu(self.conv2(y))
        return self.bn(y).flatten(1)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("cfg", [
    (1, 5, 1, 2, 1), (3, 3, 1, 1, 1), (3, 3, 2, 1, 1), (2, (3, 2), (2, 1), (1, 0), (2, 1)),
])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_shared_input_im2col_conv_equals_the_loop(batch, cfg, residual, train):
    torch.manual_seed(0)
    models = [Stem(*cfg, residual=residual).to(DT).train(train) for _ in range(3)]
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(batch, cfg[0], 9, 8, dtype=DT)
    _grads_match(models, fused, x)


class LeNetLike(nn.Module):
    """Grouped 5x5 convs with few channels (the channels-last lowering), pooling, BN, 1x1."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 5, padding=2)
        self.conv2 = nn.Conv2d(4, 6, 5)
        self.bn = nn.BatchNorm2d(6)
        self.pw = nn.Conv2d(6, 5, 1)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = self.bn(F.relu(self.conv2(x)))
        return self.pw(x).flatten(1)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("train", [False, True])
def test_channels_last_and_pointwise_lowerings_equal_the_loop(batch, train):
    torch.manual_seed(0)
    models = [LeNetLike().to(DT).train(train) for _ in range(2)]
    fused = hftc.fuse(copy.deepcopy(models))
    _grads_match(models, fused, torch.randn(batch, 1, 16, 16, dtype=DT))


@pytest.mark.parametrize("shape", [(1, 4, 3, 5), (2, 4, 1, 5), (1, 4, 2, 3, 5)],
                         ids=["image_one_sample", "image_one_row", "volume_one_sample"])
def test_gradients_reach_a_folded_op_with_canonical_strides(shape):
    # A gradient in channels-last memory with an odd stride on a size-1 dim (batch stride
    # C for one sample, or on H = 1), as the fold / unfold views can hand one back:
    # ATen's CPU batch-norm backward gets it wrong.  unfold_channels restrides it first.
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = torch.randn(shape, dtype=DT).requires_grad_()
    stats = torch.zeros(4, dtype=DT), torch.ones(4, dtype=DT)
    g = torch.randn(shape, dtype=DT).contiguous(memory_format=fmt)
    odd = list(g.stride())
    odd[shape.index(1)] = 4  # any stride will do for a dim of one element
    g_odd = g.as_strided(shape, odd)
    want, = torch.autograd.grad(F.batch_norm(x, *stats, None, None, True), x, g)
    y = F.batch_norm(x, *stats, None, None, True)
    rt_layout.unfold_channels(y, 2, True)  # hooks y
    seen = []
    y.register_hook(lambda grad: seen.append(grad.stride()))
    got, = torch.autograd.grad(y, x, g_odd)
    assert seen == [g.stride()]
    torch.testing.assert_close(got, want)


def test_fold_channels_restrides_channels_last_size_one_dims():
    # [N=2, B=1, C=1, H, W] in channels-last memory: folding gives [1, 2, H, W] with a
    # batch stride of 2; ATen's CPU batch-norm backward got such a tensor wrong.
    y = torch.randn(1, 4, 4, 2, dtype=DT).permute(0, 3, 1, 2)
    folded = rt_layout.fold_channels(rt_layout.unfold_channels(y, 2, True), True)
    assert folded.is_contiguous(memory_format=torch.channels_last)
    assert folded.stride() == (32, 1, 8, 2)
    x = folded.detach().requires_grad_()
    g = torch.randn(1, 2, 4, 4, dtype=DT)
    out = F.batch_norm(x, torch.zeros(2, dtype=DT), torch.ones(2, dtype=DT), None, None,
                       False, 0.1, 1e-5)
    got, = torch.autograd.grad(out, x, g)
    ref = x.detach().contiguous().requires_grad_()
    want, = torch.autograd.grad(F.batch_norm(ref, torch.zeros(2, dtype=DT),
                                             torch.ones(2, dtype=DT), None, None, False,
                                             0.1, 1e-5), ref, g)
    torch.testing.assert_close(got, want)
