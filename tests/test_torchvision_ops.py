"""torchvision's fx-wrapped leaves fused: stochastic depth and Swin's window attention.

torchvision wraps ``stochastic_depth``, ``shifted_window_attention`` and
``_get_relative_position_bias`` with ``torch.fx.wrap``, so a traced model calls each as one
leaf node.  hftc knows them by name (it imports no torchvision); the stand-ins in
``hftc.bench.torchvision_ops`` follow torchvision's code, and a copy of them loaded under
torchvision's module names checks that the real names are matched.

Stochastic depth draws, so it is tested as dropout is (tests/test_dropout.py): each model
its own draw at its own rate, kept rows scaled by torchvision's own factor bit for bit,
the gradient through the same noise; and, with the draws made constants
(``ConstantRandomness``, as the first-call check does), the serial loop's values and
gradients.  Eval and ``p = 0`` are the identity, with no draw.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys

import pytest
import torch
from equivalence import check_equivalence
from torch import nn

import hftc
from hftc.bench import torchvision_ops
from hftc.bench.torchvision_ops import ShiftedWindowAttention, StochasticDepth, stochastic_depth
from hftc.lowering.check import ConstantRandomness
from hftc.lowering.runtime import random as rt_random


def _sigmas(kept: float, keep: float, n: int) -> float:
    return abs(kept - keep) / math.sqrt(keep * (1 - keep) / n)


class ResidualBlock(nn.Module):
    """A ConvNeXt-style block's ending: ``x + stochastic_depth(f(x))``."""

    def __init__(self, p: float, mode: str = "row", width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.stochastic_depth = StochasticDepth(p, mode)

    def forward(self, x):
        return x + self.stochastic_depth(self.fc(x))


class FunctionalDepth(nn.Module):
    """stochastic_depth's functional spelling, p as a keyword.

    Called through its module, whose globals ``torch.fx.wrap`` patches while tracing (a
    name imported elsewhere is traced through, as torchvision's own is)."""

    def __init__(self, p: float, mode: str):
        super().__init__()
        self.p, self.mode = p, mode
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torchvision_ops.stochastic_depth(self.fc(x), p=self.p, mode=self.mode,
                                                training=self.training)


def _torchvision_named_copy() -> object:
    """The stand-ins' module executed under torchvision's module names (the names hftc's
    rules match), as ``torchvision.ops.stochastic_depth`` would load."""
    source = inspect.getsource(torchvision_ops)
    modules = []
    for name in ("torchvision.ops.stochastic_depth", "torchvision.models.swin_transformer"):
        spec = importlib.util.spec_from_loader(name, loader=None)
        module = importlib.util.module_from_spec(spec)
        exec(compile(source, f"<{name}>", "exec"), module.__dict__)
        modules.append(module)
    return modules


# ------------------------------------------------------------------ stochastic depth


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_stochastic_depth_is_one_fused_draw_each_model_its_own_rate(mode):
    torch.manual_seed(0)
    rates = (0.2, 0.5, 0.0, 1.0)
    fused = hftc.fuse([FunctionalDepth(p, mode) for p in rates])
    x = torch.randn(4000, 8)
    rows = []
    for _ in range(1 if mode == "row" else 400):
        out = fused(x)
        rows.append(out.detach())
    source = fused.last_program().source
    assert source.count("hftc_lowering_runtime_random_stochastic_depth(") == 1, source
    assert fused.fusion_report.fallbacks == []
    out = torch.cat(rows, 1)  # [N, calls * B, 8]
    kept = (out != 0).all(-1).double()  # whole rows are kept or dropped
    assert ((out != 0).any(-1).double() == kept).all()
    for i, p in enumerate(rates):
        frac = kept[i].mean().item()
        if p in (0.0, 1.0):
            assert frac == 1 - p
        else:
            draws = kept.shape[1] if mode == "row" else len(rows)
            assert _sigmas(frac, 1 - p, draws) < 5
        if mode == "batch":  # one draw per model per call
            per_call = kept[i].view(len(rows), -1)
            assert (per_call == per_call[:, :1]).all()
    assert not torch.equal(kept[0], kept[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_stochastic_depth_kernel_scales_by_torchvisions_factor_and_grads_follow(mode, dtype):
    torch.manual_seed(0)
    rates = (0.3, 0.7, 0.0, 1.0)
    leaf = (torch.rand(4, 3000, 5, dtype=torch.float64) + 0.5).to(dtype).requires_grad_()
    out = rt_random.stochastic_depth(leaf, rates, mode)
    grad = torch.randn_like(out)
    out.backward(grad)
    x = leaf.detach()
    for i, p in enumerate(rates):
        reference = stochastic_depth(torch.ones(100000, 1, dtype=dtype), p, "row")
        scale = reference[reference != 0][0] if p < 1 else torch.zeros((), dtype=dtype)
        kept = out[i].detach() != 0
        assert torch.equal(out[i].detach()[kept], (x[i] * scale)[kept])  # bit for bit
        noise = kept.to(dtype) * scale
        assert torch.equal(leaf.grad[i], grad[i] * noise)
        rows = kept.all(-1)
        assert torch.equal(kept.any(-1), rows)  # a sample's whole branch, kept or dropped
        if mode == "batch":
            assert rows.all() or not rows.any()
        elif 0 < p < 1:
            assert _sigmas(rows.double().mean().item(), 1 - p, rows.numel()) < 5
    assert torch.equal(out[2].detach(), x[2]) and not out[3].detach().any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_stochastic_depth_with_constant_draws_is_the_serial_loop(mode, dtype):
    # The first-call check's protocol: every draw a constant (every row kept), so the
    # fused program and the N models compute the same values and gradients, each model
    # scaled by its own 1 / (1 - p) (p = 1: zeros).
    models = [ResidualBlock(p, mode) for p in (0.1, 0.25, 1.0)]
    x = torch.randn(6, 8, dtype=dtype)
    with ConstantRandomness():
        check_equivalence(models, x, dtype=dtype, train=True)
        check_equivalence(models, torch.randn(3, 6, 8), in_dims=0, dtype=dtype, train=True)


def test_stochastic_depth_in_eval_or_at_zero_is_the_input_with_no_draw():
    models = [ResidualBlock(p) for p in (0.1, 0.5)]
    x = torch.randn(5, 8)
    for dtype in (torch.float64, torch.float32):
        check_equivalence(models, x, train=False, dtype=dtype)
    fused = hftc.fuse([ResidualBlock(0.0) for _ in range(3)])
    state = torch.random.get_rng_state()
    fused(x)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert "stochastic_depth" not in fused.last_program().source
    fused = hftc.fuse(models).eval()
    fused(x)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert "stochastic_depth" not in fused.last_program().source
    assert fused.fusion_report.fallbacks == []


def test_stochastic_depth_out_of_range_raises_torchvisions_error_naming_the_model():
    fused = hftc.fuse([ResidualBlock(1.5) for _ in range(2)])
    with pytest.raises(hftc.errors.TraceError, match=r"model 0 .*node `stochastic_depth`.*"
                                                     r"drop probability has to be between 0"):
        fused(torch.randn(3, 8))
    # model 1's rate out of range: it runs alone, and raises as alone
    fused = hftc.fuse([ResidualBlock(0.5), ResidualBlock(-0.5)])
    with pytest.raises(ValueError, match="drop probability has to be between 0 and 1, but "
                                         "got -0.5"):
        fused(torch.randn(3, 8))


def test_torchvisions_names_are_fused_without_importing_torchvision():
    ops, swin = _torchvision_named_copy()
    assert ops.stochastic_depth.__module__ == "torchvision.ops.stochastic_depth"

    class Block(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.attn = swin.ShiftedWindowAttention(8, [2, 2], [1, 1], 2)
            self.sd = ops.StochasticDepth(p, "row")

        def forward(self, x):
            return x + self.sd(self.attn(x))

    models = [Block(p) for p in (0.0, 0.2)]
    x = torch.randn(2, 4, 4, 8)
    fused = hftc.fuse(models)
    fused(x)
    assert fused.fusion_report.fallbacks == []
    assert "torchvision" not in sys.modules or hasattr(sys.modules["torchvision"], "__file__")
    with ConstantRandomness():
        check_equivalence(models, x, dtype=torch.float64)


def test_real_torchvision_stochastic_depth_is_fused():
    ops = pytest.importorskip("torchvision.ops")
    fused = hftc.fuse([nn.Sequential(nn.Linear(4, 4), ops.StochasticDepth(p, "row"))
                       for p in (0.1, 0.3)])
    fused(torch.randn(5, 4))
    assert fused.fusion_report.fallbacks == []


# ------------------------------------------------------------------ Swin window attention


class SwinV2Attention(ShiftedWindowAttention):
    """V2's cosine attention: ``logit_scale`` and the middle third of the qkv bias zeroed
    (torchvision's ShiftedWindowAttentionV2, its bias table as a plain parameter)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(self.num_heads, 1, 1) + 1))

    def forward(self, x):
        return torchvision_ops.shifted_window_attention(
            x, self.qkv.weight, self.proj.weight, 16 * torch.sigmoid(
                self.get_relative_position_bias()), self.window_size, self.num_heads,
            shift_size=self.shift_size, attention_dropout=self.attention_dropout,
            dropout=self.dropout, qkv_bias=self.qkv.bias, proj_bias=self.proj.bias,
            logit_scale=self.logit_scale, training=self.training)


SWIN_SHAPES = [  # (window, shift, H, W): padded and shifted, whole windows, a window
    ([4, 4], [2, 2], 9, 10),  # larger than the map (no shift), uneven shifts
    ([4, 4], [0, 0], 8, 8),
    ([4, 3], [2, 1], 4, 6),
    ([7, 7], [3, 3], 5, 5),
]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(("window", "shift", "height", "width"), SWIN_SHAPES)
def test_shifted_window_attention_is_fused_and_equals_the_loop(window, shift, height, width,
                                                               version):
    cls = ShiftedWindowAttention if version == 1 else SwinV2Attention
    models = [cls(16, window, shift, 4) for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(2, height, width, 16)
    fused(x)
    source = fused.last_program().source
    assert fused.fusion_report.fallbacks == [], source
    assert "hftc_lowering_runtime_attention_shifted_window_attention(" in source
    assert "hftc_lowering_runtime_attention_relative_position_bias(" in source
    for dtype in (torch.float64, torch.float32):
        for train in (True, False):
            check_equivalence(models, x, dtype=dtype, train=train)
        check_equivalence(models, torch.randn(3, 2, height, width, 16), in_dims=0, dtype=dtype)


def test_swin_attention_dropout_draws_per_model_and_constant_draws_are_the_loop():
    torch.manual_seed(0)
    models = [ShiftedWindowAttention(8, [2, 2], [1, 1], 2, attention_dropout=0.3, dropout=0.2)
              for _ in range(2)]
    x = torch.randn(3, 4, 4, 8)
    with ConstantRandomness():
        for dtype in (torch.float64, torch.float32):
            check_equivalence(models, x, dtype=dtype, train=True)
    fused = hftc.fuse(models)
    out = fused(x)
    assert fused.fusion_report.fallbacks == []
    assert "dropout" not in fused.last_program().source  # inside the kernel
    # the output dropout zeroes each model's own elements
    zeros = out == 0
    assert zeros[0].any() and zeros[1].any() and not torch.equal(zeros[0], zeros[1])
    fused.eval()
    torch.testing.assert_close(fused(x), torch.stack([m.eval()(x) for m in models]))
