"""Fused convolutions: N models' ``Conv1d/2d/3d`` (and transposed) as one call.

::

    before:  y_n = conv2d(x_n, W_n, b_n)                       for n in 0..N-1
    after:   y = conv(x, W, b, ...)   W: [N, Cout, Cin/g, k, k] -> [N*Cout, Cin/g, k, k],
             one conv2d with N*g groups on [B, N*Cin, H, W] (or another lowering)

``conv_lowerings`` lists the ways to run one (the cost model's choice first); autotune
times them (:mod:`hftc.lowering.autotune`).  ``x_batched=False``: one input shared by
all models (a sweep's first layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import layout
from .function_apply import apply_function_fast
from .layout import expand_models, fold_channels, unfold_channels
from .tuning import check_lowering, tunable


def _conv_fn(spatial: int, transposed: bool) -> Callable[..., Tensor]:
    if transposed:
        return (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1]
    return (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]


#: The channel block of oneDNN's NCHW grouped convolution kernels on the CPU (AVX-512):
#: a group of N*C channels whose per-model C is not a multiple of it runs slowly
#: (:func:`conv_lowerings`).
_ONEDNN_BLOCK = 16


def conv_lowerings(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
    *,
    spatial: int,
    x_batched: bool,
    padding_mode: str = "zeros",
    explicit_padding: Sequence[int] | None = None,
) -> list[str]:
    """The lowerings :func:`conv` can run for these arguments, the cost model's choice first.

    ============================  ====================================================
    ``grouped``                   one conv with ``N*g`` groups, NCHW (always applies)
    ``grouped_channels_last``     the same in channels-last memory (2-d, with a batch)
    ``pointwise_bmm``             1x1 conv of batched inputs as one ``baddbmm`` (2-d;
                                  1-d: autotune's candidate)
    ``pointwise_channels_last``   1x1 conv of a batched channels-last 2-d map: one GEMM
                                  per model on its channel slice, in place (no copies);
                                  other maps: ``pointwise_bmm``
    ``pointwise_per_sample``      1x1 conv of a batched 1-d / 2-d map: one GEMM per sample
                                  and model on the map's own memory, the weights copied
                                  per sample (autotune's candidate)
    ``shared_conv``               shared input, ``g == 1``: one conv, ``N*Cout`` outputs
    ``shared_im2col``             shared input, 2-d: ``unfold`` once, one GEMM
    ``im2col_bmm``                batched input, 2-d, ``g == 1``: ``unfold`` + a batched GEMM
    ``depthwise_wgrad_conv``      depthwise 2-d, dilation 1 (CPU): one grouped conv whose
                                  weight gradient is a depthwise conv over ``B*N*C`` maps
    ``loop``                      N separate convs (what the serial loop runs)
    ============================  ====================================================

    The cost model (measured on CPUs with oneDNN, see each lowering's docstring):
    1x1 convs of channels-last maps of 64 rows (``B*H*W``) and more (CPU) as per-model
    GEMMs on the map's own memory, other 1x1 convs as batched GEMMs; few-tap shared
    convs (``Cin*kh*kw <= 32``) as im2col; depthwise convs with kernels of 5x5 and up
    as ``depthwise_wgrad_conv``; grouped convs with few input channels per group and
    large kernels, and those whose map arrives channels-last and outsizes their weight,
    in channels-last memory, as are (CPU) the N copies of a conv whose input or output
    channels are not a multiple of 16; every other conv as one grouped (or shared) conv.
    ``hftc.fuse(..., autotune=True)`` times the rest (:mod:`hftc.lowering.autotune`).
    """
    two_d = spatial == 2 and padding_mode == "zeros"
    has_batch = x.dim() == spatial + 2 + x_batched
    if not x_batched and groups == 1:
        im2col = two_d and not isinstance(padding, str) and x.dim() == 4
        names = ["shared_conv", "loop"]
        if im2col:
            few_taps = weight[0, 0].numel() <= 32
            names.insert(0 if few_taps else 1, "shared_im2col")
        return names
    names = ["grouped"]
    # (torch.func.vmap refuses the memory-format queries a channels-last conv makes)
    vmapped = layout.vmap_batched(x) or layout.vmap_batched(weight)
    if spatial == 2 and has_batch and not vmapped and not _onednn_unsafe(x, weight, stride):
        few_channels = weight.shape[2] <= 8 and weight.shape[3] * weight.shape[4] >= 25
        # oneDNN's NCHW grouped kernels block a group's channels by 16: another channel
        # count takes a slow path (docs/DESIGN_NOTES.md, "oneDNN and channels-last").
        ragged = x.device.type == "cpu" and groups == 1 and (
            weight.shape[1] % _ONEDNN_BLOCK != 0 or weight.shape[2] % _ONEDNN_BLOCK != 0)
        # A map that arrives channels-last (after a shared_im2col stem, a channels-last
        # conv or pool) stays so while its weight is the smaller tensor: oneDNN reorders
        # the weight to the map's layout on every call, forward and backward, and below
        # that size the reorder costs less than converting the map (docs/DESIGN_NOTES.md).
        folded = fold_channels(x, True) if x_batched else x
        map_numel = folded.numel() * (1 if x_batched else weight.shape[0])
        stays_channels_last = layout.is_channels_last(folded) and weight.numel() <= map_numel
        names.insert(0 if few_channels or ragged or stays_channels_last else 1,
                     "grouped_channels_last")
    if x_batched and groups == 1 and spatial in (1, 2) and _is_pointwise(
            weight, stride, padding, dilation, padding_mode, spatial):
        names.insert(0 if spatial == 2 else 1, "pointwise_bmm")
        if spatial == 2 and has_batch:
            # the batched GEMM copies a channels-last map in and out of its [N, C, B*H*W]
            # layout, and its gradient back (docs/BENCHMARKS.md, efficientnet)
            rows = _channels_last_rows(x) if x.device.type == "cpu" else None
            in_place = rows is not None and rows.shape[0] >= _POINTWISE_IN_PLACE_MIN_ROWS
            names.insert(0 if in_place else 1, "pointwise_channels_last")
    if x_batched and groups == 1 and two_d and not isinstance(padding, str):
        names.append("im2col_bmm")  # never the cost model's choice: autotune's to find
    if x_batched and has_batch and groups == 1 and spatial in (1, 2) and not vmapped and \
            _is_pointwise(weight, stride, padding, dilation, padding_mode, spatial):
        names.append("pointwise_per_sample")  # autotune's to find (a GPU's PointNet)
    if two_d and has_batch and _is_plain_depthwise(x, weight, stride, padding, dilation, groups):
        # oneDNN's depthwise weight gradient is several times slower than this
        # lowering's for kernels of 5x5 and up, not for 3x3 (docs/DESIGN_NOTES.md).
        big_kernel = weight.shape[3] * weight.shape[4] >= 25
        names.insert(0 if big_kernel else len(names), "depthwise_wgrad_conv")
    return names + ["loop"]


@tunable(conv_lowerings)
def conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
    *,
    spatial: int,
    x_batched: bool,
    padding_mode: str = "zeros",
    explicit_padding: Sequence[int] | None = None,
    lowering: str | None = None,
) -> Tensor:
    """N convolutions as one.

    ``weight``: ``[N, Cout, Cin/g, *k]``.  Batched ``x`` ``[N, B, Cin, *S]`` becomes
    ``[B, N*Cin, *S]`` and one conv with ``N*g`` groups; a shared ``x``
    ``[B, Cin, *S]`` needs no groups at all: one conv with ``N*Cout`` output
    channels.  ``padding_mode`` other than zeros pads first, as ``nn.ConvNd`` does,
    with ``explicit_padding`` (the module's ``_reversed_padding_repeated_twice``).
    ``lowering`` names one of :func:`conv_lowerings` (default: the cost model's).
    Every lowering returns ``[N, B, Cout, *S']`` viewing ``[B, N*Cout, *S']`` memory.
    """
    names = conv_lowerings(x, weight, bias, stride, padding, dilation, groups, spatial=spatial,
                           x_batched=x_batched, padding_mode=padding_mode)
    lowering = check_lowering("conv", lowering, names)
    n = weight.shape[0]
    if lowering == "pointwise_bmm":
        return _pointwise_conv(x, weight, bias, spatial)
    if lowering == "pointwise_channels_last":
        return _pointwise_channels_last(x, weight, bias)
    if lowering == "pointwise_per_sample":
        return _pointwise_per_sample(x, weight, bias)
    w = weight.flatten(0, 1)
    b = bias.flatten() if bias is not None else None
    if lowering == "shared_im2col":
        return _shared_unfold_conv(x, w, b, stride, padding, dilation, n)
    if lowering == "im2col_bmm":
        return _batched_unfold_conv(x, weight, bias, stride, padding, dilation)
    if lowering == "depthwise_wgrad_conv":
        if not x_batched:
            x = expand_models(x, n)
        xf = fold_channels(x, True)
        xf = xf if layout.is_channels_last(xf) else xf.contiguous()
        y = apply_function_fast(_DepthwiseConv2d, xf, w, b, tuple(_ntuple(stride, 2)),
                                tuple(_ntuple(padding, 2)))
        return unfold_channels(y, n, True)
    if padding_mode != "zeros":
        pad = tuple(explicit_padding)
        if x_batched:  # padded in the folded layout, which the grouped conv reads for free
            has_batch = x.dim() == spatial + 3
            x = unfold_channels(F.pad(fold_channels(x, has_batch), pad, mode=padding_mode), n,
                                has_batch)
        else:
            x = F.pad(x, pad, mode=padding_mode)
        padding = 0
    fn = _conv_fn(spatial, transposed=False)
    if lowering == "loop":
        return _loop_over_channels(
            [fn(_onednn_safe(x[i] if x_batched else x, weight, stride), weight[i],
                None if bias is None else bias[i], stride, padding, dilation, groups)
             for i in range(n)], n, spatial)
    if not x_batched and groups != 1:
        x, x_batched = expand_models(x, n), True
    if x_batched:
        has_batch = x.dim() == spatial + 3
        xf = fold_channels(x, has_batch)
        groups = groups * n
    else:
        has_batch = x.dim() == spatial + 2
        xf = x
    if lowering == "grouped_channels_last" and not torch._C._are_functorch_transforms_active():
        # oneDNN's NCHW kernel for grouped convolutions with few input channels per
        # group and large kernels (LeNet's 6 -> 16, 5x5) is slower than its channels-last
        # one; not so for 3x3 kernels or wider layers (docs/DESIGN_NOTES.md).  (Not under
        # torch.func transforms: vmap's batched maps take no memory format.)
        xf = xf.contiguous(memory_format=torch.channels_last)
    elif lowering == "grouped":
        # NCHW as named: a channels-last map would make oneDNN reorder the weight on
        # every call (see conv_lowerings), the slow part for wide layers.
        xf = xf.contiguous()
    y = fn(_onednn_safe(xf, weight, stride), w, b, stride, padding, dilation, groups)
    return unfold_channels(y, n, has_batch)


def _onednn_safe(x: Tensor, weight: Tensor, stride: Any) -> Tensor:
    """``x``, contiguous where oneDNN's CPU convolution would get the weight gradient wrong
    (and write past its workspace) on it channels-last: a 1x1 kernel with a stride, over
    fewer than 16 input channels per group (:func:`.layout.unsafe_strided_pointwise_conv`;
    ``weight`` is ``[N, Cout, Cin/g, *k]``).  Such a map reaches a conv channels-last from
    the caller, the channels-last program, or :func:`_shared_unfold_conv`'s output."""
    return x.contiguous() if layout.is_channels_last(x) and _onednn_unsafe(x, weight, stride) \
        else x


def _onednn_unsafe(x: Tensor, weight: Tensor, stride: Any) -> bool:
    """Is this a conv that oneDNN must not run channels-last (:func:`_onednn_safe`)?"""
    return x.device.type == "cpu" and x.dtype != torch.float64 and \
        layout.unsafe_strided_pointwise_conv(weight.shape[2], weight.shape[3:], stride)


def _loop_over_channels(outs: list[Tensor], n: int, spatial: int) -> Tensor:
    """N per-model outputs ``[B, C, *S]`` -> ``[N, B, C, *S]`` viewing ``[B, N*C, *S]`` memory.

    The layout every grouped lowering returns, so the op after a loop folds the
    channels back for free, as it would after a grouped conv.
    """
    has_batch = outs[0].dim() == spatial + 2
    return unfold_channels(torch.cat(outs, dim=1 if has_batch else 0), n, has_batch)


def _shared_unfold_conv(x: Tensor, w: Tensor, b: Tensor | None, stride: Any, padding: Any,
                        dilation: Any, n: int) -> Tensor:
    """N convolutions of one shared input with few taps (``Cin*kh*kw <= 32``) as one GEMM.

    ::

        cols = unfold(x)  [B, Cin*kh*kw, L]     (once, for all N models)
        rows = cols^T as [B*L, taps]            (taps = Cin*kh*kw)
        y    = rows @ W^T + b  [B*L, N*Cout]    = [B, N*Cout, H', W'] in channels-last memory
        grad W^T = rows^T @ dy  [taps, N*Cout]  (W^T is stored so, for MKL's fast GEMM shape)

    The first layer of a sweep's CNNs (LeNet-5's 1 -> 6 5x5, the 3-channel stems
    of ResNet and MobileNet): oneDNN is slower on these few-tap convolutions
    (docs/DESIGN_NOTES.md), and the channels-last result suits the pooling and the
    grouped convolutions that follow (see :func:`conv`).  (That output once met an
    ATen batch-norm backward bug with odd size-1 strides,
    tests/test_fuzz_regressions.py; :func:`fold_channels` restrides those.)
    """
    batch, _, height, width = x.shape
    k = w.shape[2:]
    stride, padding, dilation = (_ntuple(v, 2) for v in (stride, padding, dilation))
    out_h = (height + 2 * padding[0] - dilation[0] * (k[0] - 1) - 1) // stride[0] + 1
    out_w = (width + 2 * padding[1] - dilation[1] * (k[1] - 1) - 1) // stride[1] + 1
    cols = F.unfold(x, tuple(k), dilation=dilation, padding=padding, stride=stride)
    rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])                 # [B*L, taps]
    # W^T stored [taps, N*Cout]: autograd then takes the weight gradient as rows^T @ dy, a
    # wide [taps, N*Cout] product; for a transposed W^T it takes (dy^T @ rows)^T, whose
    # [N*Cout, taps] shape (taps <= 32, K = B*L) MKL runs ~6x slower (docs/DESIGN_NOTES.md).
    wt = w.reshape(w.shape[0], -1).t().contiguous()
    y = torch.mm(rows, wt) if b is None else torch.addmm(b, rows, wt)       # [B*L, N*Cout]
    y = y.view(batch, out_h, out_w, -1).permute(0, 3, 1, 2)                # channels-last
    return unfold_channels(y, n, True)


def _batched_unfold_conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any,
                         padding: Any, dilation: Any) -> Tensor:
    """N 2-d convolutions of N inputs (``groups == 1``) as ``unfold`` + one batched GEMM.

    ::

        cols = unfold(x folded [B, N*Cin, H, W])  [B, N*Cin*kh*kw, L] = [B, N, Cin*kh*kw, L]
        y    = W [1, N, Cout, Cin*kh*kw] @ cols   [B, N, Cout, L] = [B, N*Cout, H', W']

    The product is ``torch.matmul`` broadcasting each model's weight over the batch,
    and the result is already the grouped conv's folded layout.  ``unfold`` writes
    ``kh*kw`` copies of the input, so on a CPU it rarely beats oneDNN's direct grouped
    convolution; autotune found it faster for 1x1 stride-2 convolutions (ResNet-18's
    shortcuts, N = 1-4, one core), where ``unfold`` is a strided subsample and the
    product one batched GEMM.
    """
    has_batch = x.dim() == 5
    if not has_batch:
        x = x.unsqueeze(1)
    n, batch, _, height, width = x.shape
    cout, k = weight.shape[1], weight.shape[3:]
    stride, padding, dilation = (_ntuple(v, 2) for v in (stride, padding, dilation))
    out_h = (height + 2 * padding[0] - dilation[0] * (k[0] - 1) - 1) // stride[0] + 1
    out_w = (width + 2 * padding[1] - dilation[1] * (k[1] - 1) - 1) // stride[1] + 1
    cols = F.unfold(fold_channels(x, True), tuple(k), dilation=dilation, padding=padding,
                    stride=stride)
    y = torch.matmul(weight.reshape(1, n, cout, -1), cols.view(batch, n, -1, out_h * out_w))
    if bias is not None:
        y = y + bias.view(1, n, cout, 1)
    y = unfold_channels(y.view(batch, n * cout, out_h, out_w), n, True)
    return y if has_batch else y.squeeze(1)


def _is_plain_depthwise(x: Tensor, weight: Tensor, stride: Any, padding: Any, dilation: Any,
                        groups: int) -> bool:
    """A CPU depthwise 2-d conv (one input and one output channel per group) with dilation 1
    and numeric padding of at most ``k - 1``: :class:`_DepthwiseConv2d`'s case.
    ``weight`` is ``[N, Cout, Cin/g, kh, kw]``."""
    if x.device.type != "cpu" or not x.is_floating_point() or torch.is_autocast_enabled("cpu"):
        return False
    if weight.shape[2] != 1 or weight.shape[1] != groups or isinstance(padding, str):
        return False
    kernel = weight.shape[3:]
    return all(v >= 1 for v in _ntuple(stride, 2)) and all(v == 1 for v in _ntuple(dilation, 2)) \
        and all(0 <= p < k for p, k in zip(_ntuple(padding, 2), kernel))


class _DepthwiseConv2d(torch.autograd.Function):
    """A depthwise conv whose backward runs as depthwise convs.

    ::

        y      = conv2d(x [B, C, H, W], W [C, 1, k, k], b, stride=s, padding=p, groups=C)
        grad_x = conv2d(dy, flip(W), padding=k-1-p, groups=C)         (s = 1)
                 conv_transpose2d(dy, W, stride=s, padding=p, groups=C) (s > 1)
        grad_W = conv2d(x as [1, B*C, H, W], dy as [B*C, 1, H', W'], padding=p,
                        dilation=s, groups=B*C)[..., :k, :k] -> summed over B
        grad_b = dy.sum((0, 2, 3))

    grad_W[c] is the correlation of each map x[b, c] with its output gradient dy[b, c]
    (spread s apart), summed over the batch: one depthwise conv whose kernels are the
    ``dy`` maps; its outputs past ``k`` (the rows a stride left unread) are cropped.  oneDNN's
    direct depthwise weight gradient is the slow part of the stock backward on the CPU
    (docs/DESIGN_NOTES.md).  The backward is made of differentiable ops with vmap rules
    (double backward, ``torch.func``); called through :func:`apply_function_fast`.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple,
                padding: tuple) -> Tensor:
        return F.conv2d(x, weight, bias, stride, padding, 1, weight.shape[0])

    #: Under forward-mode AD (:func:`apply_function_fast`): the forward is stock ops.
    in_plain_ops = forward

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, weight, bias, stride, padding = inputs
        ctx.save_for_backward(x, weight)
        ctx.stride, ctx.padding = stride, padding
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        channels, kernel = weight.shape[0], weight.shape[2:]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        stride, padding = ctx.stride, ctx.padding
        if need_x and stride == (1, 1):
            flipped_padding = tuple(k - 1 - p for k, p in zip(kernel, padding))
            grad_x = F.conv2d(grad, weight.flip(-2, -1), None, 1, flipped_padding, 1, channels)
        elif need_x:  # the rows past the last window's reach: output_padding
            unread = tuple(size + 2 * p - k - (out - 1) * s for size, p, k, out, s in zip(
                x.shape[2:], padding, kernel, grad.shape[2:], stride))
            grad_x = F.conv_transpose2d(grad, weight, None, stride, padding, unread, channels)
        if need_w:
            batch = x.shape[0]
            maps = x.reshape(1, batch * channels, *x.shape[2:])
            kernels = grad.reshape(batch * channels, 1, *grad.shape[2:])
            per_sample = F.conv2d(maps, kernels, None, 1, padding, stride, batch * channels)
            per_sample = per_sample[..., :kernel[0], :kernel[1]]
            grad_w = per_sample.reshape(batch, channels, *kernel).sum(0).unsqueeze(1)
        if need_b and ctx.has_bias:
            grad_b = grad.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None, None


def _ntuple(v: Any, spatial: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * spatial


def _is_pointwise(weight: Tensor, stride: Any, padding: Any, dilation: Any, padding_mode: str,
                  spatial: int) -> bool:
    """A 1x1 convolution with stride 1 and no padding: a matrix product per model."""
    if any(k != 1 for k in weight.shape[3:]) or padding_mode != "zeros":
        return False
    if any(v != 1 for v in _ntuple(stride, spatial)):
        return False
    if isinstance(padding, str):
        return padding in ("valid", "same")
    return all(v == 0 for v in _ntuple(padding, spatial))


def _pointwise_conv(x: Tensor, weight: Tensor, bias: Tensor | None, spatial: int) -> Tensor:
    """N 1x1 convolutions of N inputs as one ``baddbmm`` over each model's positions.

    ::

        x [N, B, Cin, H, W] -> [N, Cin, B*H*W];  y = baddbmm(b, W [N, Cout, Cin], x)
        y [N, Cout, B*H*W]  -> [B, N*Cout, H, W] (the grouped conv's layout)

    oneDNN's grouped 1x1 convolution (groups = N) is slower than N separate ones on the
    CPU (docs/DESIGN_NOTES.md); the batched GEMM is as fast as they are, and its
    weight gradient comes out in the weight's layout.  The two layout copies are
    elementwise passes over the activation.  Conv1d's grouped 1x1 conv on one thread
    with a batch under 16 is not oneDNN's but ATen's own, one convolution per group
    on a copy of its input slice, then a ``cat``, faster or slower than this by the
    shape, so for Conv1d it is autotune's candidate, not the cost model's choice.
    """
    n, cout, cin = weight.shape[:3]
    has_batch = x.dim() == spatial + 3
    if not has_batch:
        x = x.unsqueeze(1)
    lead = x.shape[1]
    sizes = x.shape[3:]
    xs = x.movedim(2, 1).reshape(n, cin, -1)            # a view if already channel-major
    if x.requires_grad:
        layout.gradient_in_layout_of(x)
    w = weight.reshape(n, cout, cin)
    y = torch.bmm(w, xs) if bias is None else torch.baddbmm(bias.reshape(n, cout, 1), w, xs)
    y = y.view(n, cout, lead, *sizes).movedim(2, 0).contiguous().movedim(0, 1)
    return y if has_batch else y.squeeze(1)


def _pointwise_per_sample(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """N 1x1 convolutions of N batched maps as one batched GEMM over (sample, model) pairs,
    on the folded map's own memory::

        x [N, B, Cin, *S] -> folded [B, N*Cin, *S] -> [B*N, Cin, prod(S)]   (a view)
        W [N, Cout, Cin]  -> [B*N, Cout, Cin]                  (copied once per sample)
        y = baddbmm(b, W, x) [B*N, Cout, prod(S)] = [B, N*Cout, *S]         (no copy)

    ``pointwise_bmm`` copies the map into ``[N, Cin, B*prod(S)]`` and the output back;
    this copies the weights B times instead, which is less memory where ``Cout`` is
    under ``prod(S)`` (PointNet's 1024 points), and its backward sums the B weight
    gradients.  A folded map that is not contiguous NCHW is made so first.
    """
    n, cout, cin = weight.shape[:3]
    xf = fold_channels(x, True).contiguous()
    b, sizes = xf.shape[0], xf.shape[2:]
    xs = xf.view(b * n, cin, -1)
    w = weight.reshape(1, n, cout, cin).expand(b, n, cout, cin).reshape(b * n, cout, cin)
    if bias is None:
        y = torch.bmm(w, xs)
    else:
        bias = bias.reshape(1, n, cout, 1).expand(b, n, cout, 1).reshape(b * n, cout, 1)
        y = torch.baddbmm(bias, w, xs)
    return unfold_channels(y.view(b, n * cout, *sizes), n, True)


#: Below this many rows (``B*H*W``: SE's 1x1 maps, 2x2 maps) the N GEMM calls cost more than
#: the batched GEMM's copies of so small a map (docs/DESIGN_NOTES.md).
_POINTWISE_IN_PLACE_MIN_ROWS = 64


def _channels_last_rows(x: Tensor) -> Tensor | None:
    """A batched ``[N, B, C, H, W]`` map as the ``[B*H*W, N*C]`` matrix of its memory (a
    view), where the folded map is channels-last (1x1 maps are both layouts); else ``None``.
    Not under ``torch.func`` transforms (vmap refuses strides), autocast (the GEMMs
    write into an output of their own dtype), forward-mode AD (no ``jvp`` rule) or
    ``torch.compile`` (whose kernels fuse the batched GEMM's copies anyway)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() \
            or torch.is_autocast_enabled(x.device.type) \
            or torch.autograd.forward_ad._current_level >= 0:
        return None
    if not x.is_floating_point():
        return None
    folded = fold_channels(x, True)
    if not folded.is_contiguous(memory_format=torch.channels_last):
        return None
    return folded.permute(0, 2, 3, 1).reshape(-1, folded.shape[1])


def _pointwise_channels_last(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """N 1x1 convolutions of a batched channels-last map, each a GEMM on its own columns.

    ::

        x folded [B, N*Cin, H, W] channels-last = rows [B*H*W, N*Cin]   (a view)
        y rows[:, n*Cout:(n+1)*Cout] = rows[:, n*Cin:(n+1)*Cin] @ W_n^T + b_n   (n = 0..N-1)
        y rows [B*H*W, N*Cout] = [B, N*Cout, H, W] channels-last   -> [N, B, Cout, H, W]

    Each GEMM reads and writes a column slice of the map in place (BLAS takes the
    row stride), so nothing is copied in the forward or the backward, and the output
    and the input's gradient keep the channels-last layout of the ops around them;
    :func:`_pointwise_conv`'s batched GEMM needs ``[N, C, B*H*W]`` and copies a
    channels-last map in and out of it, its gradient included.
    """
    n, cout, cin = weight.shape[:3]
    rows = _channels_last_rows(x)
    if rows is None:  # an NCHW map, or a torch.func transform: the batched GEMM
        return _pointwise_conv(x, weight, bias, 2)
    batch, height, width = x.shape[1], x.shape[3], x.shape[4]
    b = None if bias is None else bias.reshape(n, cout)
    y = apply_function_fast(_PointwiseRows, rows, weight.reshape(n, cout, cin), b)
    y = y.view(batch, height, width, n * cout).permute(0, 3, 1, 2)
    return unfold_channels(y, n, True)


class _PointwiseRows(torch.autograd.Function):
    """``rows [P, N*Cin] -> [P, N*Cout]``: model n's columns times ``W_n^T`` plus ``b_n``.

    ::

        y[:, n]   = x[:, n] @ W_n^T + b_n
        grad x[:, n] = dy[:, n] @ W_n;   grad W_n = dy[:, n]^T @ x[:, n];   grad b_n = sum dy[:, n]

    (``[:, n]``: model n's column slice.)  Every GEMM writes its slice of the result with
    ``out=``; a double backward (``create_graph``) takes the same products as
    differentiable ops instead.
    """

    @staticmethod
    def forward(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        n, cout, cin = weight.shape
        out = rows.new_empty(rows.shape[0], n * cout)
        for i in range(n):
            x_i, y_i = rows[:, i * cin:(i + 1) * cin], out[:, i * cout:(i + 1) * cout]
            if bias is None:
                torch.mm(x_i, weight[i].t(), out=y_i)
            else:
                torch.addmm(bias[i], x_i, weight[i].t(), out=y_i)
        return out

    @staticmethod
    def in_plain_ops(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The forward in differentiable ops, for forward-mode AD (:func:`apply_function_fast`)."""
        n, _, cin = weight.shape
        return torch.cat([F.linear(rows[:, i * cin:(i + 1) * cin], weight[i],
                                   None if bias is None else bias[i]) for i in range(n)], dim=1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        rows, weight, bias = inputs
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        n, cout, cin = weight.shape
        need_rows, need_w, need_b = ctx.needs_input_grad
        grads = [grad[:, i * cout:(i + 1) * cout] for i in range(n)]
        inputs = [rows[:, i * cin:(i + 1) * cin] for i in range(n)]
        grad_rows = grad_w = grad_b = None
        # create_graph, or gradients vmap batches: products autograd can differentiate
        if torch.is_grad_enabled() or layout.batched_gradient(grad):
            if need_rows:
                grad_rows = torch.cat([g @ weight[i] for i, g in enumerate(grads)], dim=1)
            if need_w:
                grad_w = torch.stack([g.t() @ x_i for g, x_i in zip(grads, inputs)])
        else:
            if need_rows:
                grad_rows = rows.new_empty(rows.shape)
                for i, g in enumerate(grads):
                    torch.mm(g, weight[i], out=grad_rows[:, i * cin:(i + 1) * cin])
            if need_w:
                grad_w = weight.new_empty(weight.shape)
                for i, (g, x_i) in enumerate(zip(grads, inputs)):
                    torch.mm(g.t(), x_i, out=grad_w[i])
        if need_b and ctx.has_bias:
            grad_b = grad.sum(0).view(n, cout)
        return grad_rows, grad_w, grad_b


def conv_transpose_lowerings(*args: Any, **kwargs: Any) -> list[str]:
    """:func:`conv_transpose`'s lowerings, the cost model's first: one grouped
    transposed conv, or N separate ones."""
    return ["grouped", "loop"]


@tunable(conv_transpose_lowerings)
def conv_transpose(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: Any = 1,
    padding: Any = 0,
    output_padding: Any = 0,
    groups: int = 1,
    dilation: Any = 1,
    *,
    spatial: int,
    x_batched: bool,
    lowering: str | None = None,
) -> Tensor:
    """N transposed convolutions as one grouped transposed conv.

    ``weight``: ``[N, Cin, Cout/g, *k]`` -> ``[N*Cin, Cout/g, *k]`` with ``N*g`` groups.
    """
    lowering = check_lowering("transposed conv", lowering, conv_transpose_lowerings())
    n = weight.shape[0]
    fn = _conv_fn(spatial, transposed=True)
    if lowering == "loop" or _grouped_transposed_3d_untrusted(x, spatial):
        return _loop_over_channels(
            [fn(x[i] if x_batched else x, weight[i], None if bias is None else bias[i], stride,
                padding, output_padding, groups, dilation) for i in range(n)], n, spatial)
    if not x_batched:
        x = expand_models(x, n)
    has_batch = x.dim() == spatial + 3
    y = fn(
        fold_channels(x, has_batch),
        weight.flatten(0, 1),
        bias.flatten() if bias is not None else None,
        stride,
        padding,
        output_padding,
        groups * n,
        dilation,
    )
    return unfold_channels(y, n, has_batch)


def _grouped_transposed_3d_untrusted(x: Tensor, spatial: int) -> bool:
    """ATen's CPU bf16/fp16 grouped ``conv_transpose3d`` returns a wrong input gradient
    for some shapes (torch 2.13: 2 input channels per group, kernel 2, padding 1, a
    1x1x1 output: garbage up to 1e33, where each group's own conv is right;
    docs/DESIGN_NOTES.md).  Those transposed convs run one per model."""
    if spatial != 3 or x.device.type != "cpu":
        return False
    low = (torch.bfloat16, torch.float16)
    return x.dtype in low or (torch.is_autocast_enabled("cpu")
                              and torch.get_autocast_dtype("cpu") in low)


def conv_transpose_output_padding(
    x: Tensor, output_size: Sequence[int], stride, padding, kernel_size, dilation, *, spatial: int
) -> list[int]:
    """``nn.ConvTransposeNd(x, output_size=...)``'s output padding, for one model's input."""
    # _output_padding reads nothing from self; it is a plain function of its arguments.
    return torch.nn.modules.conv._ConvTransposeNd._output_padding(
        None, x[0], list(output_size), list(stride), list(padding), list(kernel_size),
        spatial, list(dilation),
    )
