"""The fused operators: what a fused graph calls at run time.

Every fused activation is *logically* ``[N, *per_model_shape]`` (the model dim
first, as under ``vmap``).  Physically the kernels keep whatever layout is
cheapest: a grouped conv returns ``[B, N*C, H, W]`` memory viewed as
``[N, B, C, H, W]`` (a ``movedim``, no copy), so the next conv folds it back with
a free ``reshape``.  Elementwise ops preserve strides, so a chain of
conv -> batch norm -> relu -> conv never copies between the layers.

Parameters arrive stacked, ``[N, *shape]``; each kernel takes free views of them
(``[N, Cout, Cin/g, k, k]`` -> ``[N*Cout, Cin/g, k, k]``).

A kernel is the exact equivalent of the per-model op applied to each slice:
``kernel(x)[i] == op(x[i])``.  ``x_batched=False`` means ``x`` is shared by all
models (no model dim): the fast path of a hyper-parameter sweep, where the first
layer of N models reads one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from ..errors import FusionError, RaggedResultError
from . import layout

# --------------------------------------------------------------------------- layouts


def fold_channels(x: Tensor, has_batch_dim: bool) -> Tensor:
    """``[N, B, C, *S] -> [B, N*C, *S]`` (or ``[N, C, *S] -> [N*C, *S]`` without a batch dim).

    Model n's channels land at ``[n*C, (n+1)*C)``, so a grouped op with ``N*g``
    groups sees each model's channels as its own groups.
    """
    if has_batch_dim:
        return _canonical_strides(x.movedim(0, 1).flatten(1, 2))
    return _canonical_strides(x.flatten(0, 1))


def _canonical_strides(x: Tensor) -> Tensor:
    """A contiguous (or channels-last) tensor whose size-1 dims carry odd strides, restrided.

    Such a tensor (``[1, 4, 1]`` with strides ``(4, 1, 2)``, from a transpose) also
    looks channels-last to ATen, whose CPU convolution then picks a channels-last
    gradient buffer and fails ("slow_conv2d: grad_weight must be contiguous").
    The memory is the same; only the strides of size-1 dims change.
    """
    if layout.vmap_batched(x):  # its layout is vmap's to keep (it refuses the questions below)
        return x
    if x.is_contiguous():
        order = list(range(x.dim()))
    elif x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        # The same for channels-last memory: [1, C, H, W] with batch stride 2 instead
        # of C*H*W (B = 1 after a movedim) made ATen's CPU batch-norm backward return
        # wrong gradients (torch 2.13, float32 and float64; an odd stride on H = 1 too).
        order = [0, 2, 3, 1]
    elif x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        order = [0, 2, 3, 4, 1]  # volumes alike: [1, C, D, H, W], batch stride C
    else:
        return x
    canonical, step = [0] * x.dim(), 1
    for d in reversed(order):
        canonical[d] = step
        # int(): under torch.jit.trace a size is a 0-dim tensor, and ``*=`` wrote into
        # the one already kept in ``canonical``
        step = step * int(x.shape[d])
    if list(x.stride()) == canonical:
        return x
    return x.as_strided(x.shape, canonical)


def unfold_channels(y: Tensor, n: int, has_batch_dim: bool) -> Tensor:
    """Inverse of :func:`fold_channels`: ``[B, N*C, *S] -> [N, B, C, *S]`` as a view.

    The gradient that comes back to ``y`` through these views reaches the op that
    made ``y`` with canonical strides (:func:`_canonical_grad`).
    """
    _canonical_grad(y)
    if has_batch_dim:
        return y.unflatten(1, (n, -1)).movedim(1, 0)
    return y.unflatten(0, (n, -1))


def _canonical_grad(y: Tensor) -> None:
    """Restride the gradient that reaches ``y`` (:func:`_canonical_strides`) before the
    backward of the op that made ``y`` reads it.

    Where a dim of ``y`` has size 1, the gradient coming back through the fold / unfold
    views can carry odd strides there: ``[1, C, H, W]`` in channels-last memory with a
    batch stride of ``C`` instead of ``C*H*W``.  ATen's CPU batch-norm backward returns
    wrong input gradients for such a ``grad_output`` (torch 2.13, float32 and float64,
    training and eval; exact for the same values with canonical strides), and so does
    the batch_norm :func:`instance_norm` calls for one sample.  A hook only where a
    size-1 dim makes odd strides possible; the memory is not touched.
    """
    if y.requires_grad and 1 in y.shape:
        y.register_hook(_canonical_strides)


def expand_models(x: Any, n: int) -> Any:
    """A shared value seen by all N models: every tensor leaf gains a model dim (a view)."""
    return pytree.tree_map(
        lambda t: t.unsqueeze(0).expand(n, *t.shape) if isinstance(t, Tensor) else t, x
    )


def pad_model_dims(x: Tensor, per_model_ndim: int) -> Tensor:
    """``[N, *s] -> [N, 1, ..., 1, *s]`` with ``per_model_ndim`` dims after the model dim.

    Broadcasting aligns trailing dims; a batched operand with fewer per-model dims
    than the result must get its missing dims *after* the model dim, not before it.
    """
    missing = per_model_ndim - (x.dim() - 1)
    if missing <= 0:
        return x
    return x.reshape(x.shape[0], *([1] * missing), *x.shape[1:])


def broadcast_per_model(tensors: Sequence[Tensor], batched: Sequence[bool]) -> tuple:
    """``torch.broadcast_tensors`` of each model's operands: every result ``[N, *S]``."""
    n = next(t.shape[0] for t, b in zip(tensors, batched) if b)
    rank = max(t.dim() - b for t, b in zip(tensors, batched))
    parts = [pad_model_dims(t if b else expand_models(t, n), rank)
             for t, b in zip(tensors, batched)]
    return torch.broadcast_tensors(*parts)


# --------------------------------------------------------------------------- convolutions


def _conv_fn(spatial: int, transposed: bool) -> Callable[..., Tensor]:
    if transposed:
        return (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1]
    return (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]


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
    ``shared_conv``               shared input, ``g == 1``: one conv, ``N*Cout`` outputs
    ``shared_im2col``             shared input, 2-d: ``unfold`` once, one GEMM
    ``im2col_bmm``                batched input, 2-d, ``g == 1``: ``unfold`` + a batched GEMM
    ``loop``                      N separate convs (what the serial loop runs)
    ============================  ====================================================

    The cost model (measured on CPUs with oneDNN, see each lowering's docstring):
    1x1 convs as batched GEMMs; few-tap shared convs (``Cin*kh*kw <= 32``) as
    im2col; grouped convs with few input channels per group and large kernels, and
    those whose map arrives channels-last and outsizes their weight, in channels-last
    memory; every other conv as one grouped (or shared) conv.
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
    if spatial == 2 and has_batch and not _onednn_unsafe(x, weight, stride):
        few_channels = weight.shape[2] <= 8 and weight.shape[3] * weight.shape[4] >= 25
        # A map that arrives channels-last (after a shared_im2col stem, a channels-last
        # conv or pool) stays so while its weight is the smaller tensor: oneDNN reorders
        # the weight to the map's layout on every call, forward and backward, and below
        # that size the reorder costs less than converting the map.  Measured on ResNet's
        # 3x3 layers at N = 2, batch 8, forward + backward, channels-last vs NCHW (map
        # converted): 64 ch 32x32 42 vs 61 ms, 128 ch 16x16 34 vs 41, 256 ch 8x8 49 vs 41,
        # 512 ch 4x4 111 vs 56; depthwise convs (tiny weights) 1.5-3.5x faster channels-last.
        folded = fold_channels(x, True) if x_batched else x
        map_numel = folded.numel() * (1 if x_batched else weight.shape[0])
        stays_channels_last = layout.is_channels_last(folded) and weight.numel() <= map_numel
        names.insert(0 if few_channels or stays_channels_last else 1, "grouped_channels_last")
    if x_batched and groups == 1 and spatial in (1, 2) and _is_pointwise(
            weight, stride, padding, dilation, padding_mode, spatial):
        names.insert(0 if spatial == 2 else 1, "pointwise_bmm")
    if x_batched and groups == 1 and two_d and not isinstance(padding, str):
        names.append("im2col_bmm")  # never the cost model's choice: autotune's to find
    return names + ["loop"]


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
    lowering = _check_lowering("conv", lowering, names)
    n = weight.shape[0]
    if lowering == "pointwise_bmm":
        return _pointwise_conv(x, weight, bias, spatial)
    w = weight.flatten(0, 1)
    b = bias.flatten() if bias is not None else None
    if lowering == "shared_im2col":
        return _shared_unfold_conv(x, w, b, stride, padding, dilation, n)
    if lowering == "im2col_bmm":
        return _batched_unfold_conv(x, weight, bias, stride, padding, dilation)
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
    if lowering == "grouped_channels_last":
        # oneDNN's NCHW kernel for grouped convolutions with few input channels per
        # group and large kernels (LeNet's 6 -> 16, 5x5) measured 2x slower than its
        # channels-last one and than N separate convolutions; for 3x3 kernels and for
        # wider layers (ResNet's) channels-last measured equal or slower.
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


def _check_lowering(op: str, lowering: str | None, names: list[str]) -> str:
    if lowering is None:
        return names[0]
    if lowering not in names:
        raise FusionError(
            f"lowering {lowering!r} does not apply to this {op}; it can run as {names} "
            f"(an autotune cache written for other shapes? delete it, see hftc.lowering.autotune)"
        )
    return lowering


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
        y    = cols^T @ W^T + b  [B, L, N*Cout]  = [B, N*Cout, H', W'] in channels-last memory

    The first layer of a sweep's CNNs (LeNet-5's 1 -> 6 5x5, the 3-channel stems
    of ResNet and MobileNet): oneDNN measured 1.5-2x slower on these few-tap
    convolutions, and the channels-last result suits the pooling and the
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
    y = F.linear(cols.transpose(1, 2), w.reshape(w.shape[0], -1), b)       # [B, L, N*Cout]
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

    oneDNN's grouped 1x1 convolution (groups = N) measured 1.5-2.5x slower than N
    separate ones on the CPU; the batched GEMM is as fast as they are, and its
    weight gradient comes out in the weight's layout.  The two layout copies are
    elementwise passes over the activation.  Conv1d's grouped 1x1 conv on one thread
    with a batch under 16 is not oneDNN's but ATen's own, one convolution per group
    on a copy of its input slice, then a ``cat``: this measured 0-20% faster than that
    forward + backward (PointNet's layers, N = 2-8) and up to 45% slower at N = 8, so
    for Conv1d it is autotune's candidate, not the cost model's choice.
    """
    n, cout, cin = weight.shape[:3]
    has_batch = x.dim() == spatial + 3
    if not has_batch:
        x = x.unsqueeze(1)
    lead = x.shape[1]
    sizes = x.shape[3:]
    xs = x.movedim(2, 1).reshape(n, cin, -1)            # a view if already channel-major
    w = weight.reshape(n, cout, cin)
    y = torch.bmm(w, xs) if bias is None else torch.baddbmm(bias.reshape(n, cout, 1), w, xs)
    y = y.view(n, cout, lead, *sizes).movedim(2, 0).contiguous().movedim(0, 1)
    return y if has_batch else y.squeeze(1)


def conv_transpose_lowerings(*args: Any, **kwargs: Any) -> list[str]:
    """:func:`conv_transpose`'s lowerings, the cost model's first: one grouped
    transposed conv, or N separate ones."""
    return ["grouped", "loop"]


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
    lowering = _check_lowering("transposed conv", lowering, conv_transpose_lowerings())
    n = weight.shape[0]
    fn = _conv_fn(spatial, transposed=True)
    if lowering == "loop":
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


def conv_transpose_output_padding(
    x: Tensor, output_size: Sequence[int], stride, padding, kernel_size, dilation, *, spatial: int
) -> list[int]:
    """``nn.ConvTransposeNd(x, output_size=...)``'s output padding, for one model's input."""
    # _output_padding reads nothing from self; it is a plain function of its arguments.
    return torch.nn.modules.conv._ConvTransposeNd._output_padding(
        None, x[0], list(output_size), list(stride), list(padding), list(kernel_size),
        spatial, list(dilation),
    )


# --------------------------------------------------------------------------- linear algebra


def linear_lowerings(x: Tensor, weight: Tensor, bias: Tensor | None, *,
                     x_batched: bool) -> list[str]:
    """:func:`linear`'s lowerings, the cost model's choice first.

    Batched input: ``baddbmm`` (one batched GEMM whose weight gradient comes out
    in the weight's layout, :class:`_BatchedLinear`), ``baddbmm_t`` (the same, with
    the forward product computed transposed, ``(W @ x^T)^T``), ``baddbmm_autograd``
    (the product with autograd's own backward), ``einsum`` (``torch.einsum`` picks the
    product's layout and backward), ``loop`` (N ``F.linear``).
    Shared input: ``baddbmm`` (the input broadcast to ``[N, M, in]`` without a copy,
    then as batched), ``gemm`` (one ``F.linear`` with ``N*out`` outputs, viewed as
    ``[N, *lead, out]``) or ``loop``.  The cost model puts ``baddbmm`` first: the
    products cost the same, but ``gemm``'s output is a permuted view of
    ``[M, N*out]`` memory that every following op reads strided, and its gradient
    must be copied back into that layout; with ``baddbmm`` the layer's output is a
    contiguous ``[N, M, out]`` (MLP training step, one core, cost model otherwise:
    N = 32 5.93 vs 6.11 ms, N = 8 2.12 vs 2.19, N = 2 1.10 vs 1.16).  Not where the
    shared input needs a gradient of its own: ``gemm``'s is one product, where the
    broadcast's is N products ``[N, M, in]`` summed over the models.

    The cost model puts ``baddbmm_t`` first for narrow outputs (a classifier head):
    CPU BLAS kernels run ``[M, in] @ [in, out]`` with ``out`` of 10 at a third of the
    speed of the transposed product ``[out, in] @ [in, M]`` (measured on one core,
    N=32, M=64, in=128: 362 vs 156 us; 203 us with the copy back to ``[N, M, out]``),
    while wide outputs run alike either way.
    """
    if x.is_complex() or weight.is_complex():
        # _BatchedLinear's backward is written for real tensors (no conjugates): a complex
        # layer's weight gradient came out wrong.  Autograd's own backward for complex.
        return ["gemm", "loop"] if not x_batched else ["baddbmm_autograd", "einsum", "loop"]
    if not x_batched:
        return ["gemm", "baddbmm", "loop"] if x.requires_grad else ["baddbmm", "gemm", "loop"]
    if weight.shape[1] < _NARROW_OUTPUT:
        return ["baddbmm_t", "baddbmm", "baddbmm_autograd", "einsum", "loop"]
    return ["baddbmm", "baddbmm_t", "baddbmm_autograd", "einsum", "loop"]


#: Output widths below this take the transposed forward product by default.
_NARROW_OUTPUT = 32


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, *, x_batched: bool,
           lowering: str | None = None) -> Tensor:
    """N linears as one batched product (``baddbmm``), or one wide GEMM of a shared input.

    ``weight``: ``[N, out, in]``.  Shared ``x`` ``[*lead, in]``:
    ``F.linear(x, W.view(N*out, in))`` -> ``[*lead, N*out]`` viewed as ``[N, *lead, out]``
    (``gemm``), or ``x`` broadcast to ``[N, M, in]`` (stride 0 over the models) and the
    batched products below.  Batched ``x`` ``[N, *lead, in]`` -> ``[N, M, in]`` and
    ``baddbmm(bias[:, None], x, W^T)``.
    """
    lowering = _check_lowering("linear", lowering,
                               linear_lowerings(x, weight, bias, x_batched=x_batched))
    n, out_features, in_features = weight.shape
    if lowering == "loop":
        return torch.stack([F.linear(x[i] if x_batched else x, weight[i],
                                     None if bias is None else bias[i]) for i in range(n)])
    if lowering == "gemm":
        y = F.linear(x, weight.reshape(n * out_features, in_features),
                     bias.flatten() if bias is not None else None)
        return y.unflatten(-1, (n, out_features)).movedim(-2, 0)
    x3, lead = rows_per_model(x, n, x_batched)
    if lowering == "baddbmm_autograd":
        wt = weight.transpose(1, 2)
        y = torch.bmm(x3, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), x3, wt)
    elif lowering == "einsum":
        y = torch.einsum("nmi,noi->nmo", x3, weight)
        if bias is not None:
            y = y + bias.unsqueeze(1)
    else:
        y = apply_function_fast(_BatchedLinear, x3, weight, bias, lowering == "baddbmm_t")
    return y if len(lead) == 1 else y.reshape(n, *lead, out_features)


def rows_per_model(x: Tensor, n: int, x_batched: bool) -> tuple[Tensor, torch.Size]:
    """A linear's input as ``[N, M, in]`` rows per model, and its lead dims (the ``M``
    before flattening, to restore on the output).

    Batched ``x`` ``[N, *lead, in]`` is reshaped; a shared ``x`` ``[*lead, in]`` is
    broadcast over the models (stride 0: every model reads the same rows, no copy).
    Reshapes only where the rank differs: a no-op reshape is still a view, and one
    more node for autograd to run on every backward.
    """
    if x_batched:
        return (x if x.dim() == 3 else x.reshape(n, -1, x.shape[-1])), x.shape[1:-1]
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows.expand(n, -1, -1), x.shape[:-1]


#: The C++ ``apply`` that ``torch.autograd.Function.apply`` ends in (:func:`apply_function_fast`).
_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]
_unwrap_dead_wrappers = torch._functorch.utils.unwrap_dead_wrappers


def apply_function_fast(function: type, *args: Any) -> Any:
    """``function.apply(*args)`` for hftc's own autograd Functions (positional arguments).

    They define ``setup_context`` (``forward`` without ``ctx``), the form ``torch.func``
    transforms need: ``torch.func.grad`` / ``vmap`` / ``jacrev`` through a fused module.
    For such a Function ``Function.apply`` binds the arguments with ``inspect.signature``
    on every call, to fill in defaults: ~20 us a call (one core), as much as a sweep's
    small layer costs.  Their forwards have no defaults and every call passes all its
    arguments positionally, so where no ``torch.func`` transform is active, and outside
    ``torch.compile`` (which traces ``apply`` itself), this calls the C++ ``apply``
    directly, as ``Function.apply`` then does (dead ``torch.func`` wrappers unwrapped, too).
    Forward mode (``torch.func.jvp`` / ``jacfwd`` / ``hessian``) they do not define: a
    ``jvp`` staticmethod would make ``torch.compile`` break the graph at every call.
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return _FUNCTION_APPLY.__get__(None, function)(*_unwrap_dead_wrappers(args))


class _BatchedLinear(torch.autograd.Function):
    """``baddbmm(b[:, None], x, W^T)`` whose backward gives ``W`` its gradient in ``W``'s layout.

    ::

        autograd's bmm:  dW^T = x^T @ dy   [N, in, out]  -> W.grad = a transposed view
                         -> AccumulateGrad copies it into W's [N, out, in] strides
        here:            dW   = dy^T @ x   [N, out, in]  (the transpose is a GEMM flag)

    The strided copy it saves costs about as much as the product itself for the
    small layers of a sweep (as ``torch.mm``'s backward already avoids for
    ``nn.Linear``).  With ``transposed``, the forward computes
    ``baddbmm(b[:, :, None], W, x^T)`` ``[N, out, M]`` and returns it transposed
    into ``[N, M, out]`` (the backward is the same).  Under autocast the products
    run in the output's dtype and each gradient is cast back to its input's dtype,
    as the recorded casts would do.
    The backward is made of differentiable ops, so double backward works; and of ops
    with vmap rules, so ``torch.func.vmap`` vmaps the forward and backward as they are.
    Called through :func:`apply_function_fast`.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x3: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
        return batched_product(x3, weight, bias, transposed)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x3, weight, bias, _ = inputs
        ctx.save_for_backward(x3, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x3, weight = ctx.saved_tensors
        dtype = grad.dtype
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if dtype == x3.dtype == weight.dtype:  # no autocast: no casts (each a call per step)
            if need_x:
                grad_x = torch.bmm(grad, weight)
            if need_w:
                grad_w = torch.bmm(grad.transpose(1, 2), x3)
        else:
            if need_x:
                grad_x = torch.bmm(grad, weight.to(dtype)).to(x3.dtype)
            if need_w:
                grad_w = torch.bmm(grad.transpose(1, 2), x3.to(dtype)).to(weight.dtype)
        if ctx.bias_dtype is not None and need_b:
            grad_b = grad.sum(1)
            if grad_b.dtype != ctx.bias_dtype:
                grad_b = grad_b.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


def batched_product(x3: Tensor, weight: Tensor, bias: Tensor | None,
                    transposed: bool = False) -> Tensor:
    """``x3 @ W^T + b`` per model (``[N, M, in]``, ``[N, out, in]`` -> ``[N, M, out]``), or
    with ``transposed`` as ``(W @ x3^T + b)^T``, made contiguous."""
    if transposed:
        xt = x3.transpose(1, 2)
        yt = torch.bmm(weight, xt) if bias is None else torch.baddbmm(
            bias.unsqueeze(2), weight, xt)
        # Contiguous, as nn.Linear's output is: model code may .view() it.  A copy also
        # where the transpose is contiguous already (one row or one output feature): a view
        # returned by _BatchedLinear could not be modified in place (`h.relu_()`).
        return yt.transpose(1, 2).clone(memory_format=torch.contiguous_format)
    wt = weight.transpose(1, 2)
    return torch.bmm(x3, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), x3, wt)


def matmul(a: Tensor, b: Tensor, *, a_batched: bool, b_batched: bool) -> Tensor:
    """Per-model ``torch.matmul(a, b)`` (also ``bmm`` and ``@``) with either operand shared.

    1-D operands become matrices (and the added dim is dropped after); batched
    operands get their per-model batch dims padded after the model dim so that
    ``torch.matmul``'s broadcasting lines up per model, not across models.
    """
    a_nd = a.dim() - a_batched
    b_nd = b.dim() - b_batched
    if a_nd == 1:
        a = a.unsqueeze(-2)
    if b_nd == 1:
        b = b.unsqueeze(-1)
    rank = max(a.dim() - a_batched, b.dim() - b_batched)
    if a_batched:
        a = pad_model_dims(a, rank)
    if b_batched:
        b = pad_model_dims(b, rank)
    if a_batched and not b_batched:
        b = b.unsqueeze(0) if b.dim() == rank else b
    if b_batched and not a_batched:
        a = a.unsqueeze(0) if a.dim() == rank else a
    y = torch.matmul(a, b)
    if b_nd == 1:
        y = y.squeeze(-1)
    if a_nd == 1:
        y = y.squeeze(-2 if b_nd != 1 else -1)
    return y


# --------------------------------------------------------------------------- normalization


def _channel_view(t: Tensor | None) -> Tensor | None:
    return t.flatten() if t is not None else None


def batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    num_batches_tracked: Tensor | None,
    training: bool,
    *,
    momentum: float | None,
    eps: float,
    track_running_stats: bool,
) -> Tensor:
    """N batch norms as one batch norm over ``N*C`` channels, each model its own stats.

    Mirrors ``nn.modules.batchnorm._BatchNorm.forward``.  The running stats are
    views of the stacked ``[N, C]`` buffers, so ATen's in-place update writes each
    model's own slice.  ``momentum=None`` (cumulative average) uses each model's
    ``num_batches_tracked``; when those differ across models (models loaded from
    different checkpoints) each model's factor differs, which one ATen call cannot
    take: :func:`hftc.runtime.per_model.batch_norm` does it.
    """
    n = x.shape[0]
    eaf = 0.0 if momentum is None else momentum
    if training and track_running_stats and num_batches_tracked is not None:
        if momentum is None:
            counts = num_batches_tracked
            if not bool((counts == counts[0]).all()):
                from ..runtime import per_model  # per_model builds on this module

                return per_model.batch_norm(
                    x, running_mean, running_var, weight, bias, num_batches_tracked, training,
                    momentum=[None] * n, eps=[eps] * n, track_running_stats=True,
                )
            eaf = 1.0 / float(counts[0] + 1)
        num_batches_tracked.add_(1)
    bn_training = training or (running_mean is None and running_var is None)
    use_stats = not training or track_running_stats
    y = F.batch_norm(
        fold_channels(x, has_batch_dim=True),
        _channel_view(running_mean) if use_stats else None,
        _channel_view(running_var) if use_stats else None,
        _channel_view(weight), _channel_view(bias), bn_training, eaf, eps,
    )
    return unfold_channels(y, n, has_batch_dim=True)


def instance_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    *,
    momentum: float | None,
    eps: float,
    track_running_stats: bool,
    spatial: int,
) -> Tensor:
    """N instance norms as one over ``N*C`` channels (``_InstanceNorm._apply_instance_norm``)."""
    n = x.shape[0]
    has_batch = x.dim() == spatial + 3
    xf = fold_channels(x, has_batch)
    if not has_batch:
        xf = xf.unsqueeze(0)
    args = (_channel_view(running_mean), _channel_view(running_var), _channel_view(weight),
            _channel_view(bias), training or not track_running_stats,
            momentum if momentum is not None else 0.0, eps)
    if xf.shape[0] == 1 and xf[0, 0].numel() > 1:
        # One sample: ATen's instance_norm is batch_norm on the contiguous input viewed
        # as [1, C, *S], and the backward of that view hands batch_norm a channels-last
        # gradient an odd batch stride, for which it returns wrong input gradients
        # (torch 2.13; _canonical_grad).  The same batch_norm called here, whose output
        # unfold_channels hooks, reads the gradient restrided (values unchanged).
        y = F.batch_norm(xf.contiguous(), *args)
        _canonical_grad(y)  # here: the squeeze below would hide it from unfold_channels'
    else:
        y = F.instance_norm(xf, *args)
    if not has_batch:
        y = y.squeeze(0)
    return unfold_channels(y, n, has_batch)


def group_norm(
    x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    """N group norms as one with ``N*G`` groups over ``N*C`` channels."""
    n = x.shape[0]
    y = F.group_norm(
        fold_channels(x, True), n * num_groups, _channel_view(weight), _channel_view(bias), eps
    )
    return unfold_channels(y, n, True)


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int) -> Tensor:
    """``y * weight + bias`` with ``[N, *D]`` parameters broadcast over ``[N, *lead, *D]``."""
    if weight is None and bias is None:
        return y
    rank = y.dim() - 1
    w = pad_model_dims(weight, rank) if weight is not None else None
    b = pad_model_dims(bias, rank) if bias is not None else None
    if w is not None and b is not None:
        return torch.addcmul(b, y, w)
    return y * w if w is not None else y + b


def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    *,
    x_batched: bool,
) -> Tensor:
    """Per-model ``F.layer_norm``: normalize the last dims once, then each model's affine.

    Normalizing needs no parameters, so a shared ``x`` is normalized once for all N.
    """
    y = F.layer_norm(x, tuple(normalized_shape), None, None, eps)
    if not x_batched:
        y = y.unsqueeze(0)
    return _affine(y, weight, bias, len(normalized_shape))


def rms_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None,
    *, x_batched: bool,
) -> Tensor:
    """Per-model ``F.rms_norm``: normalize once, then scale by each model's weight."""
    y = F.rms_norm(x, tuple(normalized_shape), None, eps)
    if not x_batched:
        y = y.unsqueeze(0)
    return _affine(y, weight, None, len(normalized_shape))


# --------------------------------------------------------------------------- embedding, prelu


def embedding(
    indices: Tensor,
    weight: Tensor,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
    *,
    indices_batched: bool,
) -> Tensor:
    """N embedding tables as one ``[N*V, D]`` table, model n's indices offset by ``n*V``.

    ``padding_idx`` is per model (HFTA honoured model 0's only): the lookup is
    exact, and the gradient at positions holding a model's padding index is cut,
    which is what ``F.embedding(padding_idx=...)`` does to that row's gradient.
    """
    n, vocab, dim = weight.shape
    _check_indices(indices, vocab)
    if not indices_batched:
        indices = indices.unsqueeze(0).expand(n, *indices.shape)
    offsets = torch.arange(n, device=indices.device, dtype=indices.dtype) * vocab
    shifted = indices + offsets.view(n, *([1] * (indices.dim() - 1)))
    out = F.embedding(
        shifted, weight.reshape(n * vocab, dim), None, max_norm, norm_type,
        scale_grad_by_freq, sparse,
    )
    if padding_idx is not None:
        pad = padding_idx if padding_idx >= 0 else padding_idx + vocab
        out = torch.where((indices == pad).unsqueeze(-1), out.detach(), out)
    return out


def _check_indices(indices: Tensor, vocab: int) -> None:
    """Each model's indices must lie in its own table, as ``F.embedding`` demands: offset
    by ``n*V``, model n's index ``V + k`` would silently read model n+1's row k."""
    if indices.numel() == 0:
        return
    low, high = torch.aminmax(indices)
    in_range = (low >= 0) & (high < vocab)
    if indices.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(in_range, "index out of range in self")  # no host sync
    elif not in_range:
        raise IndexError("index out of range in self")


def prelu(x: Tensor, weight: Tensor, *, x_batched: bool) -> Tensor:
    """Per-model ``F.prelu`` with each model's own slopes (HFTA shared one across models)."""
    n = weight.shape[0]
    per_model_ndim = x.dim() - x_batched
    channel_dim = 1 if per_model_ndim >= 2 else 0
    shape = [n] + [1] * per_model_ndim
    if weight.shape[1] != 1:
        shape[1 + channel_dim] = weight.shape[1]
    w = weight.reshape(shape)
    if x_batched:
        return torch.where(x > 0, x, w * x)
    x = x.unsqueeze(0)
    return torch.where(x > 0, x, w * x)


# --------------------------------------------------------------------------- dropout


def dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """``F.dropout`` on N models' stacked activations: every element its own draw, so each
    model its own mask; the same values, scale and gradient as ``F.dropout``.

    On the CPU the keep mask is drawn by :func:`bernoulli_mask` instead of ATen's
    sampler; elsewhere (CUDA's fused dropout kernel is fast) it is ``F.dropout``::

        ATen:  noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p); x * noise
        here:  noise = bernoulli_mask(x.shape, 1 - p, x);  noise.div_(1 - p); x * noise

    The whole dropout of 2M float32 elements took 7.3 ms against ``F.dropout``'s 14.2 ms
    (one core of the Xeon, freed memory kept, 25 interleaved rounds); a ``torch.where``
    of the bool mask and the scale instead of the ``{0, 1}`` float mask's ``div_`` took
    9.6 ms.  The masks are random either way: the fused models' masks never were the
    loop's draws.
    """
    if not training or p == 0 or x.numel() == 0:
        if not 0 <= p <= 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        return x
    if x.device.type != "cpu" or not x.is_floating_point() or not 0 < p <= 1:
        return F.dropout(x, p, training, inplace)
    if p == 1:  # ATen: x times a zero (NaN stays NaN)
        zero = x.new_zeros(())
        return x.mul_(zero) if inplace else x * zero
    noise = bernoulli_mask(x.shape, 1 - p, x).div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


#: :func:`bernoulli_mask` draws 31-bit integers: ``Tensor.random_`` on int32 is uniform on
#: [0, 2**31).
_MASK_BITS = 31


def bernoulli_mask(shape: Sequence[int], keep: float | Tensor, like: Tensor) -> Tensor:
    """A ``{0, 1}`` tensor of ``like``'s dtype and device, each element 1 with probability
    ``keep`` (a float, or a tensor that broadcasts to ``shape``: one per model).

    On the CPU: uniform 31-bit integers (``Tensor.random_``, the default generator, so
    ``torch.manual_seed`` reproduces them) compared with ``round(keep * 2**31)``: ``keep``
    exact to 2**-31, the resolution of ATen's own MKL sampler (MCG31).  ATen's
    ``bernoulli_`` costs ~7 ns an element on one core of the Xeon, ``random_`` ~2.5 ns:
    a Transformer's dropout masks were a quarter of its training step.
    Elsewhere: ``torch.bernoulli``.
    """
    if like.device.type != "cpu":
        if isinstance(keep, Tensor):
            return torch.bernoulli(keep.to(like.dtype).expand(shape))
        return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(keep)
    if isinstance(keep, Tensor):  # int64 thresholds: keep = 1 is 2**31, past int32
        threshold = (keep.double() * 2**_MASK_BITS).round().to(torch.int64)
        bits = torch.empty(shape, dtype=torch.int32, device=like.device).random_()
        return torch.lt(bits, threshold).to(like.dtype)
    threshold = round(keep * 2**_MASK_BITS)
    if threshold >= 2**_MASK_BITS:
        return torch.ones(shape, dtype=like.dtype, device=like.device)
    bits = torch.empty(shape, dtype=torch.int32, device=like.device).random_()
    return bits.lt_(threshold).to(like.dtype)


# --------------------------------------------------------------------------- channel-wise ops


def channelwise(fn: Callable[..., Any], x: Tensor, *args: Any, spatial: int, **kwargs: Any) -> Any:
    """Apply a per-channel op (pooling, channel dropout) to N models' channels at once.

    ``[N, B, C, *S] -> [B, N*C, *S]``, ``fn``, and back; tuple results (max pooling
    with ``return_indices``) are unfolded leaf by leaf.  Indices stay per-channel
    plane offsets, so they equal each model's own.
    """
    n = x.shape[0]
    has_batch = x.dim() == spatial + 3
    folded = fold_channels(x, has_batch)
    pool = _max_pool2d_arguments(fn, folded, args, kwargs)
    if pool is not None:
        values, indices = apply_function_fast(_MaxPool2dThroughChannelsLast, folded, *pool[:-1])
        y = (values, indices) if pool[-1] else values
    else:
        y = fn(folded, *args, **kwargs)
    return pytree.tree_map(lambda t: unfold_channels(t, n, has_batch), y)


def samplewise(fn: Callable[..., Any], x: Tensor, *args: Any, **kwargs: Any) -> Any:
    """Apply an op that mixes a sample's channels (local response norm, channel shuffle)
    to N models' samples at once, each model's samples as more of the batch::

        [N, B, C, *S] -> [N*B, C, *S], fn, -> [N, B, C', *S']

    Folding the models into the channels, as :func:`channelwise` does, would let the op
    mix one model's channels with the next model's.  The op treats its first dim as
    independent samples, so an unbatched ``[N, C, *S]`` (whose ``C`` the op takes as its
    batch) folds alike.
    """
    return fn(x.flatten(0, 1), *args, **kwargs).unflatten(0, (x.shape[0], -1))


def per_model_loss(fn: Callable[..., Tensor], output: Tensor, target: Any, *,
                   target_batched: bool, **kwargs: Any) -> Tensor:
    """``fn(output_i, target_i, **kwargs)`` for every model i, stacked: ``[N]`` for a
    reduced loss, what ``hftc.per_model(fn)`` computes (:mod:`hftc.passes.loss`)."""
    from ..utils import per_model  # (hftc.utils imports this module)

    return per_model(fn, in_dims=(0, 0 if target_batched else None))(output, target, **kwargs)


def grid_sample(x: Tensor, grid: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``F.grid_sample`` of N models' ``[N, B, C, *S]`` maps at their ``[N, B, *S', D]``
    grids, as one batch of N*B."""
    return F.grid_sample(x.flatten(0, 1), grid.flatten(0, 1), *args, **kwargs).unflatten(
        0, (x.shape[0], -1))


def affine_grid(theta: Tensor, size: Sequence[int], *args: Any, **kwargs: Any) -> Tensor:
    """``F.affine_grid`` of N models' ``[N, B, 2, 3]`` (or 3-d ``[N, B, 3, 4]``) thetas for
    one model's output ``size`` ``(B, C, *S)``, as one batch of N*B."""
    n = theta.shape[0]
    folded = (n * size[0], *size[1:])
    return F.affine_grid(theta.flatten(0, 1), folded, *args, **kwargs).unflatten(0, (n, -1))


#: Below this many input elements ATen's NCHW max pool is as fast as the detour.
_POOL_VIA_CHANNELS_LAST_MIN_NUMEL = 1 << 16
_MAX_POOL2D_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")


def _max_pool2d_arguments(fn: Any, x: Tensor, args: tuple, kwargs: dict) -> tuple | None:
    """``(kernel_size, stride, padding, dilation, ceil_mode, return_indices)`` where a 2-d
    max pool of ``x`` should take :class:`_MaxPool2dThroughChannelsLast`, else ``None``."""
    # Only torch's own pool: a subclass of nn.MaxPool2d may have a forward of its own.
    if type(fn) is torch.nn.MaxPool2d and not args and not kwargs:
        bound = {name: getattr(fn, name) for name in _MAX_POOL2D_ARGS}
    elif fn in (F.max_pool2d, F.max_pool2d_with_indices):
        if len(args) > len(_MAX_POOL2D_ARGS) or set(kwargs) - set(_MAX_POOL2D_ARGS):
            return None
        bound = dict(zip(_MAX_POOL2D_ARGS, args)) | kwargs
        # max_pool2d_with_indices returns both whatever its return_indices says.
        if fn is F.max_pool2d_with_indices or "return_indices" not in bound:
            bound["return_indices"] = fn is F.max_pool2d_with_indices or False
    else:
        return None
    if not (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and x.dim() == 4 and x.is_contiguous()
            and not _is_channels_last(x)
            and x.numel() >= _POOL_VIA_CHANNELS_LAST_MIN_NUMEL):
        return None
    stride = bound.get("stride")
    return (bound["kernel_size"], bound["kernel_size"] if stride in (None, []) else stride,
            bound.get("padding", 0), bound.get("dilation", 1), bool(bound.get("ceil_mode")),
            bool(bound["return_indices"]))


class _MaxPool2dThroughChannelsLast(torch.autograd.Function):
    """A CPU 2-d max pool of an NCHW map, computed on a channels-last copy.

    ATen's NCHW max-pool forward on the CPU takes ~6 ns per input element whatever the
    window, its channels-last one ~0.3 ns (one core, torch 2.13, AVX512 and AVX2 alike:
    LeNet-5's first pool at N = 16, [64, 96, 28, 28], 27.8 ms against 1.6 ms plus 3.0 ms
    for the copy)::

        y, idx = max_pool2d_with_indices(x.contiguous(channels_last))   -> NCHW copies
        backward: max_pool2d_with_indices_backward(grad, x, ..., idx)   (NCHW, ATen's)

    A max picks an element, so values and indices (offsets within each channel's plane,
    ties to the first in the window, as NCHW) are the plain call's; the backward is
    ATen's own NCHW backward with the same indices, hence the same gradient.

    Under ``torch.func.vmap`` the vmapped dim joins the batch (``[V, B, C, H, W]`` ->
    ``[V*B, C, H, W]``, a pool of each plane alike) and the pool runs on that, once.
    Called through :func:`apply_function_fast`.
    """

    @staticmethod
    def forward(x: Tensor, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
                ceil_mode: bool) -> tuple[Tensor, Tensor]:
        values, indices = F.max_pool2d_with_indices(
            x.contiguous(memory_format=torch.channels_last), kernel_size, stride, padding,
            dilation, ceil_mode)
        return values.contiguous(), indices.contiguous()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
        x, *args = inputs
        indices = output[1]
        ctx.args = tuple(args)
        ctx.save_for_backward(x, indices)
        ctx.mark_non_differentiable(indices)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, *args: Any) -> tuple:
        x = x.movedim(in_dims[0], 0)
        values, indices = apply_function_fast(
            _MaxPool2dThroughChannelsLast, x.flatten(0, 1), *args)
        lead = x.shape[:2]
        return (values.unflatten(0, lead), indices.unflatten(0, lead)), (0, 0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Any) -> tuple:
        x, indices = ctx.saved_tensors
        kernel_size, stride, padding, dilation, ceil_mode = (
            _pair(v) if i < 4 else v for i, v in enumerate(ctx.args))
        grad_x = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices)
        return grad_x, None, None, None, None, None


def _pair(v: Any) -> list[int]:
    return list(v) if isinstance(v, (tuple, list)) else [v, v]


def _is_channels_last(x: Tensor) -> bool:
    """``x.is_contiguous(memory_format=torch.channels_last)``; ``False`` for a tensor
    ``torch.func.vmap`` batches, whose layout vmap cannot tell (it raises): its
    per-sample map, contiguous as :func:`_max_pool2d_arguments` asks first, is NCHW."""
    if layout.vmap_batched(x):
        return False
    return x.is_contiguous(memory_format=torch.channels_last)



# --------------------------------------------------------------------------- shapes


def shift_dim(dim: int) -> int:
    """A per-model dim as a fused dim: non-negative dims move past the model dim.

    Rules call it on the constant dims of the graph; a dim that forward computes
    (``x.dim() - 1``, ``x.ndim - 2``) or takes as an input (``forward(x, dim)``) is a graph
    node when fusing, which the rules shift in the fused graph
    (:func:`hftc.passes.shape.shift_dim_arg`: this function, on the value, at run time)."""
    if isinstance(dim, torch.fx.Node):
        raise TypeError(f"shift_dim got the graph node `{dim.name}`, whose value is known only "
                        f"at run time: shift it with hftc.passes.shape.shift_dim_arg")
    return dim + 1 if dim >= 0 else dim


def shift_dims(dims: Any) -> Any:
    """:func:`shift_dim` of a dim or of each dim of a tuple/list of dims."""
    if isinstance(dims, (tuple, list)):
        return type(dims)(shift_dim(d) for d in dims)
    return shift_dim(dims)


def _shape_arg(shape: Sequence[Any]) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return tuple(shape[0])
    return tuple(shape)


def reshape(x: Tensor, *shape: Any) -> Tensor:
    """``x.view(*shape)`` / ``x.reshape(*shape)`` per model: prepend the model dim."""
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        return x.view(shape[0])
    return x.reshape(x.shape[0], *_shape_arg(shape))


def permute(x: Tensor, *dims: Any) -> Tensor:
    dims = _shape_arg(dims)
    rank = x.dim() - 1
    return x.permute(0, *(d % rank + 1 for d in dims))


def expand(x: Tensor, *sizes: Any) -> Tensor:
    """``x.expand(*sizes)`` per model; new leading per-model dims go after the model dim."""
    sizes = _shape_arg(sizes)
    x = pad_model_dims(x, len(sizes))
    return x.expand(x.shape[0], *sizes)


def repeat(x: Tensor, *sizes: Any) -> Tensor:
    sizes = _shape_arg(sizes)
    x = pad_model_dims(x, len(sizes))
    return x.repeat(1, *sizes)


def squeeze_all(x: Tensor) -> Tensor:
    """``x.squeeze()`` per model: never squeeze the model dim, even when N == 1."""
    dims = tuple(d for d in range(1, x.dim()) if x.shape[d] == 1)
    return x.squeeze(dims) if dims else x


def getitem(x: Tensor, index: Any) -> Tensor:
    """``x[index]`` per model: the model dim is kept whole (``x[:, *index]``)."""
    if not isinstance(index, tuple):
        index = (index,)
    return x[(slice(None), *index)]


def reduce_all(fn_name: str, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """A full reduction (``x.sum()``, ``x.max()``, ``x.argmax()``) per model: over all but dim 0."""
    flat = x.reshape(x.shape[0], -1)
    result = getattr(flat, fn_name)(1, *args, **kwargs)
    if fn_name in ("max", "min", "median", "nanmedian") and isinstance(result, tuple):
        result = result[0]
    return result


#: Reductions whose gradient ATen builds as a fresh tensor in the input's *logical*
#: order (``zeros(sizes).scatter_`` for max/min/median/mode with a dim; the count mask
#: for amax/amin), whatever the input's memory layout.
SELECTING_REDUCTIONS = ("max", "min", "amax", "amin", "median", "nanmedian", "mode")


def reduce_in_memory_order(fn_name: str, x: Tensor, dim: Any, *args: Any,
                           **kwargs: Any) -> Any:
    """``torch.<fn_name>(x, dim, ...)`` on ``x``'s dims in memory order, permuted back.

    A fused activation is often a permuted view: a grouped conv's output ``[N, B, C, L]``
    views ``[B, N*C, L]`` memory.  ``torch.max(x, 3)`` returns the same values either way,
    but its backward scatters the gradient into a new ``[N, B, C, L]``-contiguous tensor,
    so every op behind it in the backward (the ReLU's, the batch norm's, which folds it
    back to ``[B, N*C, L]``) then reads a layout that is not its input's: ATen copies it
    or takes a strided loop.  Reduced in memory order::

        xm = x.permute(order)              (contiguous: a view)
        y  = torch.max(xm, order.index(dim), ...)
        y.permute(back)                    (its gradient comes back in x's layout)

    Selections are exact, so the values and indices are the plain call's.
    """
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    if order == list(range(x.dim())) or not x.permute(order).is_contiguous():
        return getattr(torch, fn_name)(x, dim, *args, **kwargs)
    dims = [d % x.dim() for d in (dim if isinstance(dim, (tuple, list)) else (dim,))]
    moved = [order.index(d) for d in dims]
    result = getattr(torch, fn_name)(x.permute(order), moved if isinstance(dim, (tuple, list))
                                     else moved[0], *args, **kwargs)
    keepdim = kwargs.get("keepdim", args[0] if args else False)
    kept = order if keepdim else [d for d in order if d not in dims]
    back = sorted(range(len(kept)), key=lambda k: kept[k])  # result dim k holds kept[k]

    def restore(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if t.requires_grad:  # amax's backward lays its gradient out like the incoming one
            t = apply_function_fast(_ContiguousGradient, t)
        return t.permute(back)

    if isinstance(result, Tensor):
        return restore(result)
    return type(result)([restore(t) for t in result])  # torch.return_types.max, ...


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous.

    :func:`reduce_in_memory_order` puts it before permuting a result back: the gradient
    of the permuted result arrives contiguous in *its* order, which is a strided view
    in memory order; ``amax``'s backward (``grad / count * mask``) would lay its output
    out like that view.  The copies (here and in forward) are of the reduced tensor only.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(t: Tensor) -> Tensor:
        # A copy, not ``t.view_as(t)``: a view returned by a Function cannot be modified in
        # place (`y = h.amax(2); y.mul_(2)` failed); the reduced tensor is small.
        return t.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


#: float32 lanes of one SIMD vector for ATen's CPU capabilities (``Vectorized<float>``).
_FLOAT_LANES = {"AVX512": 16, "AVX2": 8}

#: Below this many elements ATen's kernel wins whatever the row length (measured: 256
#: rows of 3 took 11.9 us in ATen against 13.5 us decomposed).
_SHORT_ROWS_MIN_NUMEL = 2048


def _short_rows(x: Tensor, dim: int) -> bool:
    """Whether ATen's CPU (log_)softmax over ``dim`` of ``x`` would take its slow short-row path.

    Over the last dim, ATen's CPU kernel reduces each row with SIMD vectors; a row
    shorter than one vector is reduced lane by lane through memory, ~16 ns per element.
    Measured on one core, log_softmax of [2048, 10] float32: 324 us (AVX512: rows under
    16 floats) against 32 us for [2048, 16]; under AVX2 (8 lanes) rows of 8-15 are fast
    and rows under 8 slow.  The decomposition below took 67 us.  The fused losses of N
    classifiers are exactly this shape (``[N*B, classes]``, 10 classes).
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() == 0 \
            or torch.compiler.is_compiling():
        # (Under torch.compile inductor generates its own softmax; and reading the CPU's
        # capability, a str, would break the graph in every fused loss.)
        return False
    lanes = _FLOAT_LANES.get(torch.backends.cpu.get_cpu_capability())
    return (lanes is not None and dim % x.dim() == x.dim() - 1 and x.shape[-1] < lanes
            and x.numel() >= _SHORT_ROWS_MIN_NUMEL)


def softmax(x: Tensor, dim: int, *, log: bool = False,
            dtype: torch.dtype | None = None) -> Tensor:
    """``F.softmax`` / ``F.log_softmax`` (``log=True``), computed where it is fastest.

    Rows shorter than a SIMD vector on the CPU (:func:`_short_rows`; the classes of a
    fused classifier's loss) take :class:`_ShortRowSoftmax`, the same formula as ATen's
    in whole-tensor ops::

        shifted = x - x.amax(-1, keepdim=True)
        log_softmax = shifted - log(exp(shifted).sum(-1, keepdim=True))
        softmax     = exp(shifted) / exp(shifted).sum(-1, keepdim=True)

    It sums each row in another order than ATen, so results agree within a rounding
    (a few ulps), not bit for bit.  Everything else is ATen's own kernel.
    """
    if dtype is not None:
        x = x.to(dtype)  # F.softmax(x, dim, dtype=d) casts first, too
    if _short_rows(x, dim):
        return apply_function_fast(_ShortRowSoftmax, x, log)
    return F.log_softmax(x, dim) if log else F.softmax(x, dim)


class _ShortRowSoftmax(torch.autograd.Function):
    """(Log-)softmax over the last dim in whole-tensor ops (see :func:`softmax`).

    Backward, ATen's formulas (``g`` the incoming gradient, ``y`` the output)::

        log_softmax:  g - exp(y) * g.sum(-1, keepdim=True)
        softmax:      y * (g - (g * y).sum(-1, keepdim=True))

    written in differentiable ops on the saved output, so a double backward works, and in
    ops with vmap rules, as is the forward (``torch.func.vmap`` vmaps both as they are).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, log: bool) -> Tensor:
        shifted = x - x.amax(-1, keepdim=True)
        if log:
            return shifted.sub_(shifted.exp().sum(-1, keepdim=True).log_())
        out = shifted.exp_()
        return out.div_(out.sum(-1, keepdim=True))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.log = inputs[1]
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        if ctx.log:
            return grad - out.exp() * grad.sum(-1, keepdim=True), None
        return out * (grad - (grad * out).sum(-1, keepdim=True)), None


def short_row_cross_entropy(x: Tensor, target: Tensor, num_models: int,
                            reduction: str = "mean", ignore_index: int = -100) -> Tensor | None:
    """N models' ``F.cross_entropy`` over rows of few classes, or ``None`` where
    :func:`_short_rows` says ATen's kernels are the fast ones.

    ``x`` ``[R, C]`` float32 logits, the N models' batches flattened (``R = N*B``,
    model i's rows ``[i*B, (i+1)*B)``), ``target`` ``[R]`` class indices.  Returns each
    model's loss ``[N]`` for ``reduction`` ``"mean"`` or ``"sum"``, each row's ``[R]`` for
    ``"none"``.  :class:`_ShortRowCrossEntropy` computes what ATen's
    ``nll_loss(log_softmax(x))`` computes, in fewer whole-tensor passes, without
    ``log_softmax``'s ``[R, C]`` output, and with the reduction inside (one autograd
    node, not five)::

        ATen:  log_softmax (amax, sub, exp, sum, log, sub) -> nll_loss (gather)
               -> per model: view, sum, divide by the count
               backward: the reduction's, nll_loss's scatter into zeros [R, C], then
               log_softmax's g - exp(out) * g.sum(-1)
        here:  amax, sub, gather, exp_, sum -> log(sum) - picked -> per model: sum, div_
               backward: exp * (g_row / sum), scatter_add_ -g_row at the targets

    Measured on one core, the MLP benchmark's fused loss (2048 rows of 10 classes)
    forward and backward: 200-220 against 380-422 us (``per_model`` as a user calls it).
    Within a rounding of ATen's (its sums run in another order), not bit for bit.
    """
    if not _short_rows(x, 1) or x.dim() != 2 or target.dtype != torch.long \
            or target.shape != x.shape[:1] or x.shape[0] % num_models \
            or reduction not in ("mean", "sum", "none"):
        return None
    return apply_function_fast(_ShortRowCrossEntropy, x, target, num_models, reduction,
                               ignore_index)[0]


class _ShortRowCrossEntropy(torch.autograd.Function):
    """Cross-entropy over short rows (see :func:`short_row_cross_entropy`).

    Loss of row r with target t: ``log(sum_j exp(x_rj - m_r)) - (x_rt - m_r)``, ``m_r``
    the row's max, as ATen's ``-log_softmax(x)[r, t]``; 0 where t is ``ignore_index``.
    A model's mean divides its rows' sum by its rows that are not ignored, as ATen's.
    Gradient: ``g_r * (softmax(x_r) - onehot(t))`` with ``g_r`` the row's share of its
    model's gradient, 0 on ignored rows.  A double backward (``create_graph=True``) gets
    the same gradient in differentiable ops.

    The forward returns ``(loss, exp, total, index, ignored, counts)``: what the backward
    reads besides ``x``, made in the forward (``setup_context``, which ``torch.func``
    transforms need, sees only inputs and outputs), non-differentiable; callers take
    ``[0]``.  Under ``torch.func.vmap`` the vmapped dim joins the rows (``[V, R, C]`` ->
    ``[V*R, C]``, ``V*N`` models of ``R/N`` rows each) and the loss runs on that, once:
    whether some target is ignored is read from the values, which vmap cannot branch on.
    Called through :func:`apply_function_fast`.
    """

    @staticmethod
    def forward(x: Tensor, target: Tensor, num_models: int, reduction: str,
                ignore_index: int) -> tuple[Any, ...]:
        ignored = target == ignore_index
        # Eager: the masks only where some target is ignored (rare).  Under torch.compile
        # always, as reading the tensor's value in Python would break the graph there.
        if not torch.compiler.is_compiling() and not bool(ignored.any()):
            ignored = None
        index = (target if ignored is None else target.masked_fill(ignored, 0)).unsqueeze(1)
        shifted = x - x.amax(1, keepdim=True)
        picked = shifted.gather(1, index)
        exp = shifted.exp_()
        total = exp.sum(1, keepdim=True)
        loss = total.log().sub_(picked).squeeze(1)
        if ignored is not None:
            loss.masked_fill_(ignored, 0.0)
        counts: Tensor | int = x.shape[0] // num_models
        if reduction == "mean" and ignored is not None:
            counts = ignored.logical_not().view(num_models, -1).sum(1)
        if reduction != "none":
            loss = loss.view(num_models, -1).sum(1)
            if reduction == "mean":
                loss = loss.div_(counts)
        return loss, exp, total, index, ignored, counts

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, _, ctx.num_models, ctx.reduction, _ = inputs
        _, exp, total, index, ignored, counts = output
        ctx.mark_non_differentiable(exp, total)  # (the integer ones are anyway)
        ctx.set_materialize_grads(False)  # (no zeros made for the outputs besides the loss)
        saved_counts = counts if isinstance(counts, Tensor) else None
        ctx.counts = None if saved_counts is not None else counts
        ctx.save_for_backward(x, index, ignored, exp, total, saved_counts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        x, index, ignored, exp, total, counts = ctx.saved_tensors
        n = ctx.num_models
        if ctx.reduction == "none":
            rows = grad.reshape(-1, 1)
        else:
            if ctx.reduction == "mean":
                grad = grad / (ctx.counts if counts is None else counts)
            rows = grad.reshape(n, 1).expand(n, x.shape[0] // n).reshape(-1, 1)
        if ignored is not None:
            rows = rows.masked_fill(ignored.unsqueeze(1), 0.0)
        if torch.is_grad_enabled():  # create_graph=True: a gradient that can be differentiated
            # (out of place: under vmap x may be shared while the targets are batched)
            onehot = torch.zeros_like(x).scatter(1, index, 1.0)
            return (torch.softmax(x, 1) - onehot) * rows, None, None, None, None
        out = exp * (rows / total)  # softmax(x) * g_row in one pass over [R, C]
        out.scatter_add_(1, index, -rows)
        return out, None, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, target: Tensor, num_models: int,
             reduction: str, ignore_index: int) -> tuple:
        def rows(t: Tensor, dim: int | None) -> Tensor:  # [V, R, ...] -> [V*R, ...]
            t = t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)
            return t.flatten(0, 1)

        output = apply_function_fast(
            _ShortRowCrossEntropy, rows(x, in_dims[0]), rows(target, in_dims[1]),
            info.batch_size * num_models, reduction, ignore_index)
        batched = [isinstance(t, Tensor) for t in output]
        return (tuple(t.unflatten(0, (info.batch_size, -1)) if b else t
                      for t, b in zip(output, batched)),
                tuple(0 if b else None for b in batched))


def stack_or_cat(fn: Callable[..., Tensor], tensors: Sequence[Any], dim: int,
                 batched: Sequence[bool]) -> Tensor:
    """``torch.cat`` / ``torch.stack`` of batched and shared tensors: shared ones are expanded."""
    n = next(t.shape[0] for t, b in zip(tensors, batched) if b)
    parts = [t if b else expand_models(t, n) for t, b in zip(tensors, batched)]
    return fn(parts, dim)


def size(x: Tensor, dim: int | None = None) -> Any:
    """``x.size()`` / ``x.size(d)`` / ``x.shape`` per model."""
    if dim is None:
        return x.shape[1:]
    return x.shape[shift_dim(dim)]


# --------------------------------------------------------------------------- the fallback


def _stack_results(outs: list[Any], name: str) -> Any:
    """Stack N per-model results: tensors along a new model dim; Python values once."""
    flat = [pytree.tree_flatten(o) for o in outs]
    first, out_spec = flat[0]
    stacked = []
    for pos, leaf in enumerate(first):
        column = [f[0][pos] for f in flat]
        if isinstance(leaf, Tensor):
            if any(t.shape != leaf.shape for t in column[1:]):
                raise RaggedResultError(
                    f"`{name}` gave the models results of different shapes "
                    f"({', '.join(str(list(t.shape)) for t in column)}): a value whose shape "
                    f"depends on the data (x[mask] with a per-model mask, torch.nonzero, a "
                    f"mixture of experts routing rows by index) cannot be stacked over the "
                    f"models. The fused module runs the models one by one where its first "
                    f"call finds this; to fuse them, keep shapes fixed (torch.where(mask, h, "
                    f"0), dense top-k routing with gather / scatter)")
            stacked.append(torch.stack(column))
        else:
            try:
                differ = any(bool(v != leaf) for v in column[1:])
            except RuntimeError:  # a value holding tensors pytree does not open (a dataclass)
                raise FusionError(
                    f"`{name}` returned a {type(leaf).__name__} that holds tensors, inside "
                    f"a container, which hftc cannot stack per model; return tensors in "
                    f"tuples, lists or dicts, or the dataclass itself as forward's output"
                ) from None
            if differ:
                raise RaggedResultError(
                    f"`{name}` returned different Python values for different models "
                    f"({column}), which one fused program cannot hold (.item() of a "
                    f"per-model tensor, a size that depends on the data). The fused module "
                    f"runs the models one by one where its first call finds this; to fuse "
                    f"them, compute with the tensor instead of its Python value"
                )
            stacked.append(leaf)
    return pytree.tree_unflatten(stacked, out_spec)


def _model_slice(value: Any, flag: Any, i: int) -> Any:
    """Model ``i``'s part of ``value``: ``flag`` mirrors its containers down to the
    graph's values, each flagged ``True`` (index its tensors by ``i``) or ``False``."""
    if isinstance(flag, bool):
        if not flag:
            return value
        return pytree.tree_map(lambda t: t[i] if isinstance(t, Tensor) else t, value)
    if isinstance(flag, dict):
        return {k: _model_slice(v, flag[k], i) for k, v in value.items()}
    if isinstance(flag, slice):
        return value
    return type(value)(_model_slice(v, f, i) for v, f in zip(value, flag))


def _per_model_arguments(n: int, batched: Any, args: tuple, kwargs: dict):
    for i in range(n):
        yield _model_slice((args, kwargs), batched, i)


def loop_over_models(
    fn: Callable[..., Any], n: int, batched: Any, args: tuple, kwargs: dict,
    per_model: dict[str, Sequence] | None = None,
) -> Any:
    """The lowering of last resort: call ``fn`` once per model and stack the results.

    ``batched`` is ``(args, kwargs)`` with each graph value replaced by a flag: the
    flagged values' tensors are indexed by model, the others are passed as they are.
    Tensor results are stacked along a new model dim; Python values must agree
    across models (they are shapes and flags) and are returned once.
    """
    outs = []
    for i, (a, k) in enumerate(_per_model_arguments(n, batched, args, kwargs)):
        if per_model:  # model i's own scalar arguments ("args[1]" / "kwargs[p]" slots)
            a, k = list(a), dict(k)
            for slot, values in per_model.items():
                if slot.startswith("args["):
                    a[int(slot[5:-1])] = values[i]
                else:
                    k[slot[7:-1]] = values[i]
        outs.append(fn(*a, **k))
    return _stack_results(outs, getattr(fn, "__name__", str(fn)))


def loop_module(module: torch.nn.Module, n: int, batched: Any,
                args: tuple, kwargs: dict, overrides: Sequence[Sequence] | None = None) -> Any:
    """Per-model loop over a module no rule fuses.

    ``module`` is the fused tree's node for it: a :class:`~hftc.runtime.modules.StackedModule`
    (model i runs as ``functional_call(template, {name: stacked[i]})``, so gradients
    and in-place buffer updates land in the stacked tensors) or, for a module
    without parameters or buffers, the module itself.
    """
    template = getattr(module, "_hftc_template", None)
    target = module if template is None else template
    saved = {name: getattr(target, name) for name, _ in (overrides[0] if overrides else ())}
    outs = []
    for i, (a, k) in enumerate(_per_model_arguments(n, batched, args, kwargs)):
        for name, value in (overrides[i] if overrides else ()):
            setattr(target, name, value)  # model i's own hyper-parameter (dropout p, eps ...)
        if template is None:
            outs.append(module(*a, **k))
            continue
        template.train(module.training)
        tensors = {name: t[i] for name, t in module.named_parameters(remove_duplicate=False)}
        tensors.update({name: t[i] for name, t in module.named_buffers(remove_duplicate=False)})
        outs.append(torch.func.functional_call(template, tensors, a, k, strict=True))
    for name, value in saved.items():
        setattr(target, name, value)
    return _stack_results(outs, type(template or module).__name__)


_METHODS: dict[str, Callable[..., Any]] = {}


def call_method(name: str) -> Callable[..., Any]:
    """A function that calls ``name`` as a method of its first argument (for loops)."""
    if name not in _METHODS:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, name)(*args, **kwargs)

        method.__name__ = method.__qualname__ = f"Tensor_{name}"
        _METHODS[name] = method
    return _METHODS[name]
