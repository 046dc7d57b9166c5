"""Channel-wise, per-sample and shape ops on fused ``[N, B, C, *S]`` activations.

::

    channelwise(fn, x):  fn on [B, N*C, *S] (models folded into the channels), unfolded again
    samplewise(fn, x):   fn on [N*B, C, *S] (models folded into the batch)
    reshape(x, *shape):  the per-model shape, with the model dim kept in front

Also the 2-d max pool through channels-last, ``prelu``, ``grid_sample`` /
``affine_grid`` and the dim shifts (``shift_dim``: a per-model dim -> the fused one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from . import layout
from .function_apply import apply_function_fast
from .layout import expand_models, fold_channels, pad_model_dims, unfold_channels


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

    ATen's NCHW max-pool forward on the CPU is about twenty times slower per element
    than its channels-last one, whatever the window (docs/DESIGN_NOTES.md)::

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
    def in_plain_ops(x: Tensor, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
                     ceil_mode: bool) -> tuple[Tensor, Tensor]:
        """The NCHW pool itself, for forward-mode AD (:func:`apply_function_fast`)."""
        return F.max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)

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


def shape_arg(shape: Sequence[Any]) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return tuple(shape[0])
    return tuple(shape)


def reshape(x: Tensor, *shape: Any) -> Tensor:
    """``x.view(*shape)`` / ``x.reshape(*shape)`` per model: prepend the model dim."""
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        return x.view(shape[0])
    return layout.layout_copy(x, x.reshape(x.shape[0], *shape_arg(shape)))


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """``x.flatten(start_dim, end_dim)`` of the fused value (dims already shifted past the
    model dim); a copy out of a channels-last map gives its gradient back channels-last
    (:func:`.layout.layout_copy`)."""
    return layout.layout_copy(x, x.flatten(start_dim, end_dim))


def contiguous(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.contiguous(...)``, its gradient back in ``x``'s layout (:func:`.layout.layout_copy`)."""
    return layout.layout_copy(x, x.contiguous(*args, **kwargs))


def permute(x: Tensor, *dims: Any) -> Tensor:
    dims = shape_arg(dims)
    rank = x.dim() - 1
    return x.permute(0, *(d % rank + 1 for d in dims))


def expand(x: Tensor, *sizes: Any) -> Tensor:
    """``x.expand(*sizes)`` per model; new leading per-model dims go after the model dim."""
    sizes = shape_arg(sizes)
    x = pad_model_dims(x, len(sizes))
    return x.expand(x.shape[0], *sizes)


def repeat(x: Tensor, *sizes: Any) -> Tensor:
    sizes = shape_arg(sizes)
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


def getitem_per_model(x: Tensor, index: Tensor) -> Tensor:
    """``x_n[index_n]`` for every model n, one integer index tensor each::

        x [N, R, ...], index [N, *I]  ->  x[arange(N).view(N, 1, ...), index]  [N, *I, ...]
    """
    n = x.shape[0]
    rows = torch.arange(n, device=x.device).view(n, *[1] * (index.dim() - 1))
    return x[rows, index]


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
