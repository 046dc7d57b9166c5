"""The fused activations' layout: the model dim folded into channels and back, and
the memory-format questions the kernels ask.

Every fused activation is *logically* ``[N, *per_model_shape]`` (the model dim
first, as under ``vmap``).  Physically the kernels keep whatever layout is
cheapest: a grouped conv returns ``[B, N*C, H, W]`` memory viewed as
``[N, B, C, H, W]`` (a ``movedim``, no copy), so the next conv folds it back with
a free ``reshape``::

    fold_channels:    [N, B, C, H, W] -> [B, N*C, H, W]   (model n's channels at [n*C, (n+1)*C))
    unfold_channels:  [B, N*C, H, W]  -> [N, B, C, H, W]   (a view)

Elementwise ops preserve strides, so a chain of conv -> batch norm -> relu -> conv
never copies between the layers.  The channels-last questions (``is_channels_last``,
oneDNN's unsafe strided 1x1 convolutions) are here too; *whether* a program runs
channels-last is chosen by :mod:`hftc.lowering.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree


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
    if vmap_batched(x):  # its layout is vmap's to keep (it refuses the questions below)
        return x
    if x.is_contiguous():
        order = list(range(x.dim()))
    elif x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        # The same for channels-last memory: an odd batch stride (B = 1 after a movedim)
        # gets wrong CPU batch-norm gradients (docs/DESIGN_NOTES.md, "torch behaviour").
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
    made ``y`` with canonical strides (:func:`canonical_grad`).
    """
    canonical_grad(y)
    if has_batch_dim:
        return y.unflatten(1, (n, -1)).movedim(1, 0)
    return y.unflatten(0, (n, -1))


def canonical_grad(y: Tensor) -> None:
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


def gradient_in_layout_of(x: Tensor) -> None:
    """Hand ``x``'s producer its gradient in ``x``'s own memory layout (one copy, where the
    gradient arrives in another).

    ATen's CPU backward kernels for operands of mixed layouts are its slow strided ones
    (``threshold_backward`` ~7x, batch-norm backward ~10x), so the backward of an op that
    left ``x``'s layout (a batched GEMM's ``[N, Cin, B, H, W]``, a channels-last map
    flattened for a linear) gives its input gradient back in ``x``'s layout.  Only for a
    dense ``x`` (an expanded one has no layout to match); the values are not touched.
    """
    shape, strides = x.shape, x.stride()
    dense = 1
    for size, stride in sorted(zip(shape, strides), key=lambda dim: dim[1]):
        if size != 1:
            if stride != dense:  # overlapping or gapped (an expanded x): no layout to match
                return
            dense *= size

    def restride(grad: Tensor) -> Tensor:
        if batched_gradient(grad) or grad.stride() == strides or grad.shape != shape:
            return grad
        return torch.empty_strided(shape, strides, dtype=grad.dtype,
                                   device=grad.device).copy_(grad)

    x.register_hook(restride)


def layout_copy(x: Tensor, y: Tensor) -> Tensor:
    """``y``, ``x`` reshaped, flattened or made contiguous; where that copied a channels-last
    map ``x`` into another layout, ``x``'s gradient comes back in ``x``'s layout
    (:func:`gradient_in_layout_of`)::

        relu(x) [N, B, C, H, W] channels-last -> flatten(2) copies to [N, B, C*H*W]
        backward: the flat gradient viewed [N, B, C, H, W] is contiguous -> copied to
                  channels-last, so relu's backward reads two channels-last operands

    A view (no copy) keeps ``x``'s memory and needs nothing.  Not for leaves (a user's
    input keeps the gradient autograd gives it), vmap's tensors or ``torch.compile``.
    """
    if y is x or not x.requires_grad or x.grad_fn is None or y._is_view() \
            or torch.compiler.is_compiling() or vmap_batched(x):
        return y
    if y.shape == x.shape and y.stride() == x.stride():
        return y  # the same layout already
    if x.dim() in (5, 6) and x.shape[2] > 1 and x.stride(2) == 1:
        # (only a feature map stored channels-last, [N, B, C, *S] with C innermost: where
        # the mixed-layout backward was measured; another copy's gradient stays as it was)
        gradient_in_layout_of(x)
    return y


def expand_models(x: Any, n: int) -> Any:
    """A shared value seen by all N models: every tensor leaf gains a model dim (a view)."""
    return pytree.tree_map(
        lambda t: t.unsqueeze(0).expand(n, *t.shape) if isinstance(t, Tensor) else t, x
    )


def model_slice(x: Any, index: int) -> Any:
    """Model ``index``'s part of a value stacked per model: ``x[index]``, taken of every
    tensor leaf of a container (a stacked LSTM state ``(h, c)``, ``in_dims`` of a tuple)."""
    if isinstance(x, Tensor):
        return x[index]
    return pytree.tree_map(lambda t: t[index] if isinstance(t, Tensor) else t, x)


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


#: oneDNN's 1x1 convolutions with a stride (torch 2.13's CPU build) reduce a channels-last
#: input to unit stride in a workspace that is too small when a group has fewer input
#: channels than oneDNN's channel block (8 with AVX2, 16 with AVX-512): the weight
#: gradient is wrong, and the write past the workspace corrupts the heap (a crash, or a
#: hang: uxlfoundation/oneDNN#6035; what was seen: docs/DESIGN_NOTES.md, "torch behaviour").
_ONEDNN_CHANNEL_BLOCK = 16


def unsafe_strided_pointwise_conv(in_channels_per_group: int, kernel: Sequence[int],
                                  stride: int | Sequence[int]) -> bool:
    """Would torch's CPU convolution (oneDNN) get this convolution's weight gradient
    wrong, or corrupt memory, on a channels-last input?  A 1x1 (1x1x1) kernel with a
    stride, over fewer than 16 input channels per group."""
    if in_channels_per_group >= _ONEDNN_CHANNEL_BLOCK or any(k != 1 for k in kernel):
        return False  # first: every fused conv call asks (conv.conv_lowerings)
    return any(s != 1 for s in ([stride] if isinstance(stride, int) else stride))


def vmap_batched(x: Tensor) -> bool:
    """Whether ``x`` is a tensor ``torch.func.vmap`` batches: vmap refuses layout queries
    (``is_contiguous(memory_format=...)``, strides) on it."""
    return torch._C._are_functorch_transforms_active() and torch._C._functorch.is_batchedtensor(x)


def batched_gradient(grad: Tensor) -> bool:
    """Whether a backward runs on gradients vmap batches: under a ``torch.func`` transform
    (``jacrev``, ``vmap(grad(...))``) or ``torch.autograd.grad(..., is_grads_batched=True)``
    (its legacy batching).  Such a gradient takes no ``out=`` and no copy into a plain
    tensor of a chosen layout, which would not hold its batch."""
    return torch._C._are_functorch_transforms_active() or \
        torch._C._functorch.is_legacy_batchedtensor(grad)


def is_channels_last(x: Tensor) -> bool:
    """A 4-D (5-D) tensor that ATen's CPU convolution reads as channels-last."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    if vmap_batched(x):
        return False  # vmap's batched tensor: its per-sample maps are NCHW
    return x.dim() in formats and not x.is_contiguous() \
        and x.is_contiguous(memory_format=formats[x.dim()])
