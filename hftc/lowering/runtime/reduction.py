"""Fused reductions: over a model's own dims, never across models.

::

    before:  x_n.sum()                       for n in 0..N-1
    after:   reduce_all("sum", x)  ->  x.reshape(N, -1).sum(1)       ([N])

Plus the reductions that read memory in the model's own order (``reduce_in_memory_order``)
and softmax over short rows (a faster CPU path with the same results).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .function_apply import apply_function_fast


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

    #: Under forward-mode AD (:func:`apply_function_fast`): the forward is stock ops.
    in_plain_ops = forward

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


#: float32 lanes of one SIMD vector for ATen's CPU capabilities (``Vectorized<float>``).
_FLOAT_LANES = {"AVX512": 16, "AVX2": 8}


#: Below this many elements ATen's kernel wins whatever the row length (docs/DESIGN_NOTES.md).
_SHORT_ROWS_MIN_NUMEL = 2048


def short_rows(x: Tensor, dim: int) -> bool:
    """Whether ATen's CPU (log_)softmax over ``dim`` of ``x`` would take its slow short-row path.

    Over the last dim, ATen's CPU kernel reduces each row with SIMD vectors; a row
    shorter than one vector is reduced lane by lane through memory, ten times slower
    than a row of one vector (docs/DESIGN_NOTES.md).  The fused losses of N classifiers
    are exactly this shape (``[N*B, classes]``, 10 classes).
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

    Rows shorter than a SIMD vector on the CPU (:func:`short_rows`; the classes of a
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
    if short_rows(x, dim):
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
    def in_plain_ops(x: Tensor, log: bool) -> Tensor:
        """ATen's own (log-)softmax, for forward-mode AD (:func:`apply_function_fast`)."""
        return F.log_softmax(x, -1) if log else F.softmax(x, -1)

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
