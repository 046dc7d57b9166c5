"""The ``pointwise_channels_last`` lowering of N 1x1 convs (hftc.lowering.runtime.conv): one GEMM
per model on its column slice of the folded channels-last map, in place.  Checked
against the models one by one (forward, input, weight and bias gradients; float64 and
float32; a grid of shapes and N), for the layouts it keeps, its double backward, and
the batched GEMM it falls back to where the map is not channels-last."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from equivalence import DEFAULT_TOL, check_equivalence
from torch import nn

import hftc
from hftc.lowering.runtime import conv as rt_conv
from hftc.lowering.runtime.layout import fold_channels, unfold_channels

LOWERING = "pointwise_channels_last"
# (N, batch, in channels, out channels, height, width, bias)
SHAPES = [(1, 2, 3, 5, 4, 4, True), (2, 3, 5, 7, 6, 5, True), (4, 2, 16, 64, 3, 3, False),
          (3, 5, 24, 6, 1, 1, True), (8, 1, 4, 4, 2, 7, False), (2, 4, 6, 3, 4, 4, True)]


def _channels_last_map(n, batch, channels, height, width, dtype):
    """``[N, B, C, H, W]`` viewing a folded ``[B, N*C, H, W]`` channels-last map."""
    folded = torch.randn(batch, n * channels, height, width, dtype=dtype)
    return unfold_channels(folded.contiguous(memory_format=torch.channels_last), n, True)


def _run(x, weight, bias, grad_out, lowering):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    bias = None if bias is None else bias.detach().requires_grad_()
    y = rt_conv.conv(x, weight, bias, spatial=2, x_batched=True, lowering=lowering)
    y.backward(grad_out)
    return y, x.grad, weight.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-B{}-{}to{}-{}x{}-bias{}".format(*s))
def test_pointwise_channels_last_matches_the_models_one_by_one(shape, dtype):
    n, batch, cin, cout, height, width, has_bias = shape
    torch.manual_seed(0)
    x = _channels_last_map(n, batch, cin, height, width, dtype)
    weight = torch.randn(n, cout, cin, 1, 1, dtype=dtype)
    bias = torch.randn(n, cout, dtype=dtype) if has_bias else None
    names = rt_conv.conv_lowerings(x, weight, bias, spatial=2, x_batched=True)
    # the cost model's choice from 64 rows (B*H*W) up; below, the batched GEMM's
    assert names.index(LOWERING) == (0 if batch * height * width >= 64 else 1)

    xs = x.detach().requires_grad_()
    ws = weight.detach().requires_grad_()
    bs = None if bias is None else bias.detach().requires_grad_()
    ref = torch.stack([F.conv2d(xs[i], ws[i], None if bs is None else bs[i]) for i in range(n)])
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)

    y, grad_x, grad_w, grad_b = _run(x, weight, bias, grad_out, LOWERING)
    tol = DEFAULT_TOL[dtype]
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(grad_x, xs.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(grad_w, ws.grad, rtol=tol, atol=tol)
    if has_bias:
        torch.testing.assert_close(grad_b, bs.grad, rtol=tol, atol=tol)
    # the output and the input's gradient keep the folded channels-last layout: no copies
    for t in (y, grad_x):
        assert fold_channels(t, True).is_contiguous(memory_format=torch.channels_last)


def test_pointwise_channels_last_has_a_double_backward():
    torch.manual_seed(0)
    x = _channels_last_map(2, 2, 3, 3, 3, torch.float64).requires_grad_()
    weight = torch.randn(2, 5, 3, 1, 1, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)

    def fn(x, weight, bias):
        return rt_conv.conv(x, weight, bias, spatial=2, x_batched=True, lowering=LOWERING)

    assert torch.autograd.gradcheck(fn, (x, weight, bias))
    assert torch.autograd.gradgradcheck(fn, (x, weight, bias))


def test_pointwise_channels_last_falls_back_to_the_batched_gemm():
    """An NCHW map, or a torch.func transform (vmap refuses strides): the batched GEMM,
    named second; the same values."""
    torch.manual_seed(0)
    weight = torch.randn(3, 4, 5, 1, 1, dtype=torch.float64)
    nchw = torch.randn(3, 2, 5, 4, 4, dtype=torch.float64)
    assert rt_conv.conv_lowerings(nchw, weight, None, spatial=2, x_batched=True)[:2] == [
        "pointwise_bmm", LOWERING]
    x = _channels_last_map(3, 2, 5, 4, 4, torch.float64)
    for inputs in (nchw, x):
        want = torch.stack([F.conv2d(inputs[i], weight[i]) for i in range(3)])
        got = rt_conv.conv(inputs, weight, None, spatial=2, x_batched=True, lowering=LOWERING)
        torch.testing.assert_close(got, want)

    def loss(w):
        return rt_conv.conv(x, w, None, spatial=2, x_batched=True, lowering=LOWERING).square().sum()

    torch.testing.assert_close(torch.func.grad(loss)(weight),
                               torch.autograd.functional.jacobian(loss, weight))
    # autocast: the GEMMs' out= would have to be bfloat16; the batched GEMM casts
    x32, w32 = x.float(), weight.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rt_conv.conv(x32, w32, None, spatial=2, x_batched=True, lowering=LOWERING)
        want = rt_conv.conv(x32, w32, None, spatial=2, x_batched=True, lowering="pointwise_bmm")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


class MBConvNet(nn.Module):
    """EfficientNet-like (torchvision's MBConv, small): a 3-channel stem, then 1x1 expand +
    BN + SiLU(inplace), depthwise 3x3 + BN + SiLU(inplace), squeeze-and-excitation,
    1x1 project + BN and a residual, then a head."""

    def __init__(self, width=8, expand=4):
        super().__init__()
        hidden = width * expand
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.SiLU(inplace=True))
        self.expand = nn.Sequential(nn.Conv2d(width, hidden, 1, bias=False),
                                    nn.BatchNorm2d(hidden), nn.SiLU(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden,
                                                 bias=False),
                                       nn.BatchNorm2d(hidden), nn.SiLU(inplace=True))
        self.squeeze = nn.Conv2d(hidden, 4, 1)
        self.excite = nn.Conv2d(4, hidden, 1)
        self.gate = nn.Hardsigmoid(inplace=True)
        self.project = nn.Sequential(nn.Conv2d(hidden, width, 1, bias=False),
                                     nn.BatchNorm2d(width))
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        h = self.stem(x)
        d = self.depthwise(self.expand(h))
        scale = self.gate(self.excite(F.silu(self.squeeze(F.adaptive_avg_pool2d(d, 1)))))
        h = h + self.project(d * scale)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("n", [1, 3])
def test_an_mbconv_net_matches_the_loop(n, dtype):
    """The stem's shared input makes the map channels-last (shared_im2col), so the 1x1
    convs run as pointwise_channels_last; training, two steps."""
    torch.manual_seed(0)
    check_equivalence([MBConvNet() for _ in range(n)], torch.randn(2, 3, 6, 6), train=True,
                      dtype=dtype, steps=2)


def test_inplace_gated_activations_run_out_of_place():
    """SiLU / Hardsigmoid(inplace=True) on a fused view made autograd rebuild the whole
    activation in the backward (clone, copy_, and an N-major gradient for silu_backward)."""
    torch.manual_seed(0)
    fused = hftc.fuse([MBConvNet() for _ in range(2)])
    fused(torch.randn(2, 3, 6, 6))
    source = fused.last_program().source
    assert source.count("torch.nn.functional.silu(") == 4  # the three modules and F.silu
    assert source.count("torch.nn.functional.hardsigmoid(") == 1
