"""Reductions and softmax: reduce over per-model dims, never over the model dim.

::

    x.sum(1)          ->  x.sum(2)
    x.mean()          ->  x.reshape(N, -1).mean(1)          (a full reduction per model)
    x.max(dim=1)      ->  reduce_in_memory_order("max", x, 2) (values, indices per model;
                                                             in x's memory order)
    F.softmax(x, -1)  ->  reduction.softmax(x, -1)           (ATen's, or whole-tensor ops for
                                                          rows shorter than a SIMD vector)
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..frontends.export import Emitter, aten_name
from ..ir import EXAMPLE_VALUE, bind_arguments
from ..lowering.runtime import layout as rt_layout
from ..lowering.runtime import reduction as rt_reduction
from .elementwise import fuse_pointwise
from .registry import EXACT, FusionGroup, GraphBuilder, NotFusable, Reduces, rule, spellings
from .shape import shift_dim_arg

aten = torch.ops.aten

#: op name -> position of ``dim`` (self/input at 0) for ``op(x, dim, ...)``.
REDUCTIONS = {
    "sum": 1, "mean": 1, "prod": 1, "amax": 1, "amin": 1, "max": 1, "min": 1, "argmax": 1,
    "argmin": 1, "std": 1, "var": 1, "logsumexp": 1, "all": 1, "any": 1, "median": 1,
    "nansum": 1, "nanmean": 1, "count_nonzero": 1, "std_mean": 1, "var_mean": 1, "norm": 2,
    "aminmax": None, "nanmedian": 1, "mode": 1,
}


def _reduction_rule(op_name: str, position: int | None):
    def fuse_reduction(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
        # max/min of two tensors is elementwise, not a reduction.
        if op_name in ("max", "min") and len(group.node.args) > 1 and isinstance(
            group.arg_example(1), torch.Tensor
        ):
            return fuse_pointwise(group, builder)
        args = list(group.args)
        kwargs = dict(group.kwargs)
        key = "dim"
        if position is None:
            dim = kwargs.get("dim")
        elif position < len(args):
            dim = args[position]
        else:
            dim = kwargs.get(key)
        value = dim.meta.get(EXAMPLE_VALUE) if isinstance(dim, fx.Node) else dim
        if isinstance(value, bool):  # std(x, unbiased) overload: no dim
            if op_name in ("std", "var") and position is not None and position < len(args):
                # over all dims, with the given unbiased (dropping it computed the unbiased
                # std of x.std(False))
                return builder.call(rt_reduction.reduce_all, op_name, builder.broadcast(args[0]),
                                    *args[1:], **kwargs)
            dim = None
        x = builder.broadcast(args[0])
        if dim is None:
            if position is not None and position < len(args):
                args = args[:position] + args[position + 1:]
            kwargs.pop(key, None)
            if op_name in ("norm", "aminmax", "mode", "std_mean", "var_mean"):
                raise NotFusable(f"{op_name} over all dims")
            return builder.call(rt_reduction.reduce_all, op_name, x, *args[1:], **kwargs)
        if op_name in rt_reduction.SELECTING_REDUCTIONS and position == 1:
            if len(args) > 1:
                args = args[:1] + args[2:]
            kwargs.pop(key, None)
            return builder.call(rt_reduction.reduce_in_memory_order, op_name, x,
                                shift_dim_arg(builder, dim), *args[1:], **kwargs)
        if position is not None and position < len(args):
            args[position] = shift_dim_arg(builder, dim)
        else:
            kwargs[key] = shift_dim_arg(builder, dim)
        args[0] = x
        return builder.copy(FusionGroup(group.node, group.nodes, tuple(args), kwargs,
                                        group.module), batched=True)

    fuse_reduction.__name__ = f"fuse_reduction[{op_name}]"
    return fuse_reduction


# ---------------------------------------------------------------- over padded dims
# What padding_graph.reduce (pad_widths=True) takes for each reduction: the op's
# parameters -> reduce's arguments, or None where the call reduces nothing.


def _summed(input, dim=None, keepdim=False, dtype=None):  # sum, nansum, mean
    return {"dim": dim, "keepdim": keepdim, "dtype": dtype}


def _extreme(input, dim=(), keepdim=False):  # amax, amin
    return {"dim": dim, "keepdim": keepdim}


def _logsumexp(input, dim, keepdim=False):
    return {"dim": dim, "keepdim": keepdim}


def _spread(input, dim=None, unbiased=None, keepdim=False, correction=None):  # var, std
    if isinstance(dim, bool):  # var(x, unbiased)
        unbiased, dim = dim, None
    return {"dim": dim, "keepdim": keepdim,
            "correction": correction if correction is not None else 0 if unbiased is False else 1}


def _selected(input, dim=None, keepdim=False):  # max, min, argmax, argmin
    if isinstance(dim, fx.Node):  # torch.max(a, b): elementwise
        return None
    return {"dim": dim, "keepdim": keepdim}


def _norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    p = 2 if p == "fro" else p
    if not (isinstance(p, (int, float)) and p > 0):
        return None
    return {"dim": dim, "keepdim": keepdim, "dtype": dtype, "ord": p}


def _vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):  # noqa: A002 - torch's
    return _norm(x, ord, dim, keepdim, dtype)


def _softmax(input, dim=None, dtype=None, _stacklevel=3):  # (a dtype by position too)
    return None if dim is None else {"dim": dim, "dtype": dtype}


def _softmax_module(module: nn.Module):
    return None if module.dim is None else (
        F.log_softmax if isinstance(module, nn.LogSoftmax) else F.softmax, {"dim": module.dim})


#: ``@rule(padding=...)`` of the reductions hftc computes over each model's real units.
_OVER_PADDING = {
    **{name: Reduces(name, _summed) for name in ("sum", "nansum", "mean")},
    **{name: Reduces(name, _extreme) for name in ("amax", "amin")},
    "logsumexp": Reduces("logsumexp", _logsumexp),
    **{name: Reduces(name, _spread) for name in ("var", "std")},
    **{name: Reduces(name, _selected, one_dim=True, otherwise=EXACT) for name in ("max", "min")},
    **{name: Reduces(name, _selected, one_dim=True) for name in ("argmax", "argmin")},
    "norm": Reduces("norm", _norm),
}

for _name, _pos in REDUCTIONS.items():
    rule(*spellings(_name, functional=False), name=f"fuse_reduction[{_name}]",
         padding=_OVER_PADDING.get(_name))(_reduction_rule(_name, _pos))


@rule(("call_function", torch.linalg.vector_norm),
      aten={aten.linalg_vector_norm: torch.linalg.vector_norm},
      padding=Reduces("norm", _vector_norm))
def fuse_vector_norm(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``torch.linalg.vector_norm(x, ord, dim, keepdim)`` (what ``F.normalize`` exports to)
    over each model's dims; over all of them: ``vector_norm(x.flatten(1), ord, 1)``."""
    x = builder.broadcast(group.arg(0, "x"))
    ord_, dim = group.arg(1, "ord", 2), group.arg(2, "dim")
    keepdim, dtype = group.arg(3, "keepdim", False), group.kwargs.get("dtype")
    if dim is None:
        if keepdim:
            raise NotFusable("vector_norm over all dims with keepdim")
        return builder.call(torch.linalg.vector_norm, builder.method("flatten", x, 1), ord_, 1,
                            dtype=dtype)
    return builder.call(torch.linalg.vector_norm, x, ord_, shift_dim_arg(builder, dim), keepdim,
                        dtype=dtype)


@rule(*spellings("cosine_similarity"), ("call_module", nn.CosineSimilarity))
def fuse_cosine_similarity(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """Per model, ``cosine_similarity`` reduces ``dim`` of its two inputs broadcast together;
    fused, both get the model dim in front and the broadcast rank after it, and a
    non-negative ``dim`` moves past the model dim::

        before (per model):  cosine_similarity(x_i [B, D], w_i [D], dim=1)
        after:               cosine_similarity(x [N, B, D], w.reshape(N, 1, D), dim=2)
    """
    node = group.node
    inputs = [(0, "x1"), (1, "x2")]
    examples = [group.arg_example(pos if pos < len(node.args) else name) for pos, name in inputs]
    rank = max(example.dim() for example in examples)
    x1, x2 = (builder.call(rt_layout.pad_model_dims, builder.broadcast(group.arg(pos, name)),
                           rank) for pos, name in inputs)
    if group.module is not None:
        dim, eps = group.module.dim, group.module.eps
    else:
        dim, eps = group.arg(2, "dim", 1), group.arg(3, "eps", 1e-8)
    return builder.call(F.cosine_similarity, x1, x2, shift_dim_arg(builder, dim), eps)


#: softmax and log_softmax run through ``reduction.softmax`` (ATen's kernel, or a faster
#: formula for rows shorter than a SIMD vector on the CPU); the rest call ``fn`` itself.
_SOFTMAX_KERNELS = {F.softmax: {"log": False}, F.log_softmax: {"log": True}}


def _call_softmax(builder: GraphBuilder, fn, x: fx.Node, dim: int, **kwargs) -> fx.Node:
    if fn in _SOFTMAX_KERNELS:
        return builder.call(rt_reduction.softmax, x, dim, **_SOFTMAX_KERNELS[fn], **kwargs)
    return builder.call(fn, x, dim, **kwargs)


def torch_softmax_parameters(input, dim=None, dtype=None):
    """``torch.softmax(x, dim, dtype)``'s and ``x.softmax(dim, dtype)``'s parameters (F.softmax
    has a ``_stacklevel`` before ``dtype``), to bind a call's arguments by."""


def _softmax_rule(fn):
    def fuse_softmax(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
        """``F.softmax(x, dim)``, ``torch.softmax``, ``x.softmax(dim, dtype)`` or
        ``nn.Softmax(dim)(x)``, bound by name (a ``dtype`` given by position too)."""
        by_torch = group.module is None and group.node.target is not fn
        a = group.arguments(builder, torch_softmax_parameters if by_torch else fn)
        if a["dim"] is None:
            raise NotFusable("softmax without an explicit dim (legacy implicit dim)")
        return _call_softmax(builder, fn, builder.broadcast(a["input"]),
                             shift_dim_arg(builder, a["dim"]), dtype=a.get("dtype"))

    return fuse_softmax


def softmax_as_torch(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.softmax`` / ``aten._softmax(x, dim, half_to_float)`` -> ``torch.softmax(x, dim)``
    (and the log ones), with the ``dtype`` only the public op takes."""
    name = aten_name(e)
    fn = torch.log_softmax if "log" in name else torch.softmax
    a = bind_arguments(e.source.target, args, kwargs)
    x, dim, dtype = a["input"], a["dim"], a.get("dtype")  # (_softmax: half_to_float instead)
    return e.call(fn, x, dim, dtype=dtype) if dtype is not None else e.call(fn, x, dim)


for _fn, _cls, _aten in [
    (F.softmax, nn.Softmax, (aten.softmax, aten._softmax)),
    (F.log_softmax, nn.LogSoftmax, (aten.log_softmax, aten._log_softmax)),
    (F.softmin, nn.Softmin, ()),
]:
    rule(*spellings(_fn.__name__), ("call_module", _cls), name=f"fuse_softmax[{_fn.__name__}]",
         aten=dict.fromkeys(_aten, softmax_as_torch),
         padding=None if _fn is F.softmin else Reduces(
             _fn.__name__, _softmax, one_dim=True,
             as_function=_softmax_module))(_softmax_rule(_fn))


@rule(("call_module", nn.GLU), *spellings("glu"), aten={aten.glu: F.glu})
def fuse_glu(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``nn.GLU(dim)(x)`` or ``F.glu(x, dim)`` -> ``F.glu(x, dim + 1)`` (a negative dim
    stays), the arguments bound by ``F.glu``'s names (a module's ``dim`` its attribute)."""
    a = group.arguments(builder, F.glu)
    return builder.call(F.glu, builder.broadcast(a["input"]), shift_dim_arg(builder, a["dim"]))
