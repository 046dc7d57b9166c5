"""Views, shapes and indexing: every per-model dim moves one place right.

::

    x.view(x.size(0), -1)      ->  reshape(x, x.size(1), -1)  == x.reshape(N, B, -1)
    torch.flatten(x, 1)        ->  x.flatten(2)
    x.permute(0, 2, 1)         ->  x.permute(0, 1, 3, 2)
    x[:, 0]                    ->  x[:, :, 0]
    torch.cat([a, b], dim=1)   ->  torch.cat([a, b], dim=2)   (shared operands expanded)
    x.size(1) / x.shape        ->  x.size(2) / x.shape[1:]    (shared: plain ints)

Non-negative dims shift by one; negative dims count from the end and stay.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .. import ir
from ..frontends.export import Emitter
from ..ir import EXAMPLE_VALUE, bind_arguments
from ..lowering.runtime import guards as rt_guards
from ..lowering.runtime import layout as rt_layout
from ..lowering.runtime import per_model as rt_per_model
from ..lowering.runtime import spatial as rt_spatial
from ..lowering.runtime.spatial import shift_dim
from .registry import (
    EXACT,
    MOVES,
    SPLITS,
    FusionGroup,
    GraphBuilder,
    NotFusable,
    Reduces,
    rule,
    runs_one_by_one,
    spellings,
)

aten = torch.ops.aten


# ------------------------------------------------- torch.export's ATen ops, as these rules' ops


def slice_as_getitem(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.slice(x, 1, 0, 5)`` -> ``x[:, 0:5]``."""
    a = bind_arguments(e.source.target, args, kwargs)
    dim = a["dim"]
    part = slice(a["start"], a["end"], a["step"])
    index = (*([slice(None)] * dim), part) if dim >= 0 else (
        Ellipsis, part, *([slice(None)] * (-dim - 1)))
    return e.call(operator.getitem, a["input"], index)


def index_as_getitem(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.index(x, [None, i])`` -> ``x[:, i]``."""
    x, indices = args
    return e.call(operator.getitem, x, tuple(slice(None) if i is None else i for i in indices))


def sym_size_as_method(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    return e.method("size", *args)


def sym_numel_as_method(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    return e.method("numel", *args)


def expand_as_method(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    return e.method("expand", args[0], args[1])


def broadcast_tensors_as_torch(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    return e.call(torch.broadcast_tensors, *args[0])


def _self_and_rest(group: FusionGroup) -> tuple:
    return group.args[0], group.args[1:]


def _is_dims_value(value: Any) -> bool:
    """An int dim (not a bool), or a tuple/list of them."""
    if isinstance(value, (tuple, list)):
        return all(_is_dims_value(v) for v in value)
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def shift_dim_arg(builder: GraphBuilder, dims: Any) -> Any:
    """A per-model dim argument (an int, a tuple/list of them, or a graph node) as the
    fused op's dim: non-negative dims move past the model dim, negative ones stay.

    Constant dims shift now (:func:`spatial.shift_dims`).  A dim that forward computes
    (``x.dim() - 1``, ``x.ndim - 2``) or takes as an input (``forward(x, dim)``) is a
    node of the fused graph whose value is each model's dim, one int for all of them:
    the fused graph shifts it when it runs (``spatial.shift_dims(dim)``), so the dim is
    right for every call, however it was computed (also from sizes, which the program
    is not specialized on).  A node whose value is not an int dim, or one that carries
    the model dim, is not fused (the one-by-one fallback runs the op)."""
    if isinstance(dims, fx.Node):
        example = dims.meta.get(EXAMPLE_VALUE)
        if builder.is_batched(dims):
            raise NotFusable("a dim argument that differs between the models")
        if not _is_dims_value(example):
            raise NotFusable(f"a dim argument computed in forward whose value is "
                             f"{type(example).__name__}, not an int")
        return builder.call(rt_spatial.shift_dims, dims, batched=False)
    if isinstance(dims, (tuple, list)):
        return type(dims)(shift_dim_arg(builder, d) for d in dims)
    return shift_dim(dims)


@rule(*spellings("view", torch_fn=False), *spellings("reshape"), padding=MOVES)
def fuse_reshape(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x, rest = _self_and_rest(group)
    shape = rest or (group.kwargs.get("shape") or group.kwargs.get("size"),)
    return builder.call(rt_spatial.reshape, x, *shape)


def alias_as_view_as(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.alias(x)``, a view of all of ``x`` (export writes it for ``x[:, -0:]``, GPT-2's
    ``logits_to_keep=0`` at a static length), as ``x.view_as(x)``: the same view."""
    return e.method("view_as", args[0], args[0])


@rule(*spellings("view_as", torch_fn=False), *spellings("reshape_as", torch_fn=False),
      *spellings("expand_as", torch_fn=False), aten={aten.alias: alias_as_view_as},
      padding=MOVES)
def fuse_as(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x, other = group.args[0], group.args[1]
    size = (builder.call(rt_spatial.size, other, batched=False) if builder.is_batched(other)
            else builder.method("size", other, batched=False))
    if not builder.is_batched(x):
        x = builder.broadcast(x)
    kernel = rt_spatial.expand if group.node.target == "expand_as" else rt_spatial.reshape
    return builder.call(kernel, x, size)


def flatten_parameters(input, start_dim=0, end_dim=-1):
    """``torch.flatten``'s parameters (torch gives it named-dim schemas too), to bind by."""


def unflatten_parameters(input, dim, sizes):
    """``torch.unflatten``'s parameters (and a named-dim schema), to bind by."""


@rule(*spellings("flatten"), ("call_module", nn.Flatten), padding=MOVES)
def fuse_flatten(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``torch.flatten(x, 1)``, ``x.flatten(1)`` or ``nn.Flatten()(x)`` -> ``x.flatten(2)``,
    bound by name (a module's dims are its attributes)."""
    a = group.arguments(builder, flatten_parameters)
    x = a["input"]
    if _input_example(group).dim() == 0:
        return builder.method("reshape", x, -1, 1)
    return builder.call(rt_spatial.flatten, x, shift_dim_arg(builder, a["start_dim"]),
                        shift_dim_arg(builder, a["end_dim"]))


@rule(*spellings("unflatten"), ("call_module", nn.Unflatten), padding=MOVES)
def fuse_unflatten(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``torch.unflatten(x, 1, (2, 3))`` or ``nn.Unflatten(1, (2, 3))(x)`` -> ``x.unflatten(2,
    (2, 3))``, bound by name (a module's sizes are its ``unflattened_size``)."""
    sizes = {} if group.module is None else {"sizes": group.module.unflattened_size}
    a = group.arguments(builder, unflatten_parameters, **sizes)
    return builder.method("unflatten", a["input"], shift_dim_arg(builder, a["dim"]), a["sizes"])


def _input_example(group: FusionGroup) -> Any:
    """Model 0's value of the op's input, passed by position or as ``input=``."""
    return group.arg_example(0 if group.node.args else "input")


@rule(*spellings("permute"), padding=MOVES)
def fuse_permute(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x, dims = _self_and_rest(group)
    dims = dims or (group.kwargs["dims"],)
    return builder.call(rt_spatial.permute, x, *dims)


@rule(*spellings("transpose"), *spellings("swapaxes"), *spellings("swapdims"), padding=MOVES)
def fuse_transpose(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    return builder.method("transpose", group.args[0], shift_dim_arg(builder, group.arg(1, "dim0")),
                          shift_dim_arg(builder, group.arg(2, "dim1")))


@rule(*spellings("movedim"), *spellings("moveaxis"), padding=MOVES)
def fuse_movedim(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    return builder.method("movedim", group.args[0], shift_dim_arg(builder, group.arg(1, "source")),
                          shift_dim_arg(builder, group.arg(2, "destination")))


@rule(*spellings("t"), padding=MOVES)
def fuse_t(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    if group.arg_example(0).dim() < 2:  # t() of a vector is the vector
        return builder.method("view_as", group.args[0], group.args[0])
    return builder.method("transpose", group.args[0], 1, 2)


@rule(*spellings("unsqueeze"), padding=MOVES)
def fuse_unsqueeze(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    return builder.method("unsqueeze", group.args[0], shift_dim_arg(builder, group.arg(1, "dim")))


@rule(*spellings("squeeze"), padding=MOVES)
def fuse_squeeze(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    dim = group.arg(1, "dim")
    if dim is None:
        return builder.call(rt_spatial.squeeze_all, group.args[0])
    return builder.method("squeeze", group.args[0], shift_dim_arg(builder, dim))


@rule(*spellings("expand", torch_fn=False), aten={aten.expand: expand_as_method},
      padding=MOVES)
def fuse_expand(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x, sizes = _self_and_rest(group)
    return builder.call(rt_spatial.expand, x, *(sizes or (group.kwargs["size"],)))


@rule(*spellings("repeat", torch_fn=False), padding=MOVES)
def fuse_repeat(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x, sizes = _self_and_rest(group)
    return builder.call(rt_spatial.repeat, x, *(sizes or (group.kwargs["repeats"],)))


def normalize_over_real_units(input, p=2.0, dim=1, eps=1e-12, out=None):
    """``F.normalize``'s arguments for ``padding_graph.reduce`` (pad_widths=True), or None
    for a norm it does not compute (``p`` not a positive number)."""
    if not (isinstance(p, (int, float)) and p > 0):
        return None
    return {"ord": p, "dim": dim, "eps": eps}


def _dim_rule(position: int, name: str, default: int):
    """A rule for ops whose only per-model concern is one ``dim`` argument."""

    def fuse_dim_op(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
        args = list(group.args)
        kwargs = dict(group.kwargs)
        if position < len(args):
            args[position] = shift_dim_arg(builder, args[position])
        else:
            kwargs[name] = shift_dim_arg(builder, kwargs.get(name, default))
        args[0] = builder.broadcast(args[0])
        if group.per_model:  # F.normalize(x, eps=self.eps): each model's own eps
            bound = bind_arguments(torch.nn.functional.normalize, tuple(args), kwargs)
            return builder.call(rt_per_model.normalize, bound["input"], bound["p"],
                                bound["dim"], tuple(group.per_model_arg(3, "eps")))
        return builder.copy(FusionGroup(group.node, group.nodes, tuple(args), kwargs,
                                        group.module), batched=True)

    return fuse_dim_op


#: The ATen ops torch.export records for these ops under another name (``@rule(aten=...)``).
_EXPORTED_AS = {"split": {aten.split: torch.split}}
#: What these compute over a padded dim (``@rule(padding=...)``); the others are refused
#: there (a sort, a difference: not known).
_PADDING = {**dict.fromkeys(("chunk", "split", "tensor_split"), SPLITS),
            **dict.fromkeys(("unbind", "narrow", "select", "flip"), MOVES),
            **dict.fromkeys(("cumsum", "cumprod", "cummax", "cummin"), EXACT),
            "normalize": Reduces("normalize", normalize_over_real_units, one_dim=True)}
#: The numbers that may differ per model (``@rule(per_model=...)``): F.normalize's eps.
_PER_MODEL = {"normalize": ("eps",)}

for op_name, pos, kw, default in [
    ("chunk", 2, "dim", 0), ("split", 2, "dim", 0), ("tensor_split", 2, "dim", 0),
    ("unbind", 1, "dim", 0), ("narrow", 1, "dim", None), ("select", 1, "dim", None),
    ("flip", 1, "dims", None), ("diff", 2, "dim", -1), ("cumsum", 1, "dim", None),
    ("cumprod", 1, "dim", None), ("logcumsumexp", 1, "dim", None), ("cummax", 1, "dim", None),
    ("cummin", 1, "dim", None), ("sort", 1, "dim", -1), ("argsort", 1, "dim", -1),
    ("topk", 2, "dim", -1), ("kthvalue", 2, "dim", -1),
    ("normalize", 2, "dim", 1), ("split_with_sizes", 2, "dim", 0),
]:
    rule(*spellings(op_name, inplace=False), name=f"fuse_dim_op[{op_name}]",
         aten=_EXPORTED_AS.get(op_name), padding=_PADDING.get(op_name),
         per_model=_PER_MODEL.get(op_name, ()))(
        _dim_rule(pos, kw, default)
    )


@rule(("call_function", torch.broadcast_tensors),
      aten={aten.broadcast_tensors: broadcast_tensors_as_torch})
def fuse_broadcast_tensors(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``torch.broadcast_tensors(a, b, ...)`` (``F.mse_loss`` calls it) per model: batched
    operands get their missing dims after the model dim, shared ones a model dim."""
    tensors = group.args
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    return builder.call(rt_layout.broadcast_per_model, list(tensors),
                        [builder.is_batched(t) for t in tensors])


@rule(*spellings("roll"), padding=MOVES)
def fuse_roll(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    dims = group.arg(2, "dims")
    if dims is None:
        raise NotFusable("roll without dims rolls the flattened tensor")
    return builder.call(torch.roll, group.args[0], group.arg(1, "shifts"),
                        shift_dim_arg(builder, dims))


@rule(*spellings("index_select"), padding=MOVES)
def fuse_index_select(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    index = group.arg(2, "index")
    if builder.is_batched(index):
        raise NotFusable("per-model index tensors")
    return builder.call(torch.index_select, builder.broadcast(group.args[0]),
                        shift_dim_arg(builder, group.arg(1, "dim")), index)


@rule(*spellings("gather"))
def fuse_gather(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    return builder.call(torch.gather, builder.broadcast(group.args[0]),
                        shift_dim_arg(builder, group.arg(1, "dim")),
                        builder.broadcast(group.arg(2, "index")))


@rule(("call_function", torch.cat), ("call_function", torch.concat),
      ("call_function", torch.concatenate), ("call_function", torch.stack), padding=MOVES)
def fuse_cat(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    tensors = group.arg(0, "tensors")
    dim = group.arg(1, "dim", group.kwargs.get("axis", 0))
    fn = torch.stack if group.node.target is torch.stack else torch.cat
    if isinstance(tensors, fx.Node):
        # A sequence one node computed (``torch.cat(x.chunk(2, -1), -1)``): the fused
        # node's value is the sequence of the fused parts, each with the model dim first.
        return builder.call(fn, tensors, shift_dim_arg(builder, dim))
    flags = tuple(builder.is_batched(t) for t in tensors)
    return builder.call(ir.bind(rt_spatial.stack_or_cat, fn), tensors,
                        shift_dim_arg(builder, dim), flags)


@rule(("call_method", "size"), aten={aten.sym_size: sym_size_as_method}, padding=EXACT)
def fuse_size(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    return builder.call(rt_spatial.size, group.args[0], group.arg(1, "dim"), batched=False)


@rule(("call_method", "dim"), ("call_method", "ndimension"), padding=EXACT)
def fuse_ndim(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    return builder.call(operator.sub, builder.method("dim", group.args[0], batched=False), 1,
                        batched=False)


@rule(("call_method", "numel"), ("call_function", torch.numel),
      aten={aten.sym_numel: sym_numel_as_method}, padding=EXACT)
def fuse_numel(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    total = builder.method("numel", group.args[0], batched=False)
    count = builder.method("size", group.args[0], 0, batched=False)
    return builder.call(operator.floordiv, total, count, batched=False)


#: Tensor attributes that move units (``x.T``); the others (``x.shape``, ``x.dtype``) hold none.
_MOVING_ATTRIBUTES = ("T", "mT", "H", "mH")


@rule(("call_function", builtins.getattr),
      padding=lambda node: MOVES if node.args[1] in _MOVING_ATTRIBUTES else EXACT)
def fuse_getattr(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x, name = group.args[0], group.args[1]
    example = group.arg_example(0)
    if not isinstance(example, torch.Tensor):  # a namedtuple field (values, indices)
        return builder.copy(group, batched=builder.is_batched(x) and _has_tensor(group.example))
    if name == "shape":
        return builder.call(rt_spatial.size, x, batched=False)
    if name == "ndim":
        return builder.call(operator.sub, builder.call(getattr, x, "ndim", batched=False), 1,
                            batched=False)
    if name == "T":
        dims = tuple(reversed(range(example.dim())))
        return builder.call(rt_spatial.permute, x, *dims)
    if name in ("mT", "mH"):
        return builder.method("transpose", x, -2, -1)
    if name in ("data", "real", "imag"):
        return builder.copy(group, batched=True)
    if name in ("dtype", "device", "is_cuda", "requires_grad", "layout", "is_sparse"):
        return builder.copy(group, batched=False)
    raise NotFusable(f"tensor attribute `{name}`")


def _has_tensor(value) -> bool:
    return any(isinstance(v, torch.Tensor)
               for v in torch.utils._pytree.tree_leaves(value))


def _index_is_fusable(group: FusionGroup, builder: GraphBuilder) -> None:
    index = group.node.args[1]
    parts = index if isinstance(index, tuple) else (index,)
    advanced = []
    for k, p in enumerate(parts):
        if isinstance(p, fx.Node):
            example = p.meta.get(EXAMPLE_VALUE)
            if builder.is_batched(group.args[1][k] if isinstance(index, tuple) else group.args[1]):
                raise NotFusable("indexing with per-model index tensors")
            if isinstance(example, torch.Tensor):
                advanced.append(k)
        elif isinstance(p, (list, torch.Tensor)):
            advanced.append(k)
    if len(advanced) > 1 and advanced != list(range(advanced[0], advanced[0] + len(advanced))):
        raise NotFusable("advanced indices separated by slices move their dims to the front")


#: Index tensors that pick elements (a bool or uint8 one is a mask).
_INTEGER_INDICES = (torch.int64, torch.int32, torch.int16, torch.int8)


@rule(("call_function", operator.getitem),
      aten={aten.slice: slice_as_getitem, aten.index: index_as_getitem}, padding=MOVES)
def fuse_getitem(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    container = group.arg_example(0)
    if not isinstance(container, torch.Tensor):  # a tuple/list/Size of per-model values
        batched = builder.is_batched(group.args[0]) and _has_tensor(group.example)
        return builder.copy(group, batched=batched)
    index = group.node.args[1]
    example = index.meta.get(EXAMPLE_VALUE) if isinstance(index, fx.Node) else None
    if builder.is_batched(group.args[1]) and isinstance(example, torch.Tensor) and (
            example.dtype in _INTEGER_INDICES):
        # Swin's relative_position_bias_table[self.relative_position_index.view(-1)]: a
        # stacked index buffer picks rows of each model's own table
        return builder.call(rt_spatial.getitem_per_model, builder.broadcast(group.args[0]),
                            group.args[1])
    _index_is_fusable(group, builder)
    return builder.call(rt_spatial.getitem, group.args[0], group.args[1])


@rule(("call_function", ir.reentrant_checkpoint_output), padding=EXACT)
def fuse_reentrant_checkpoint_output(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """The gate of a reentrant checkpoint's output (:func:`hftc.ir.reentrant_checkpoint_
    output`) on the fused values: whether an input requires grad is the same for all N."""
    return builder.copy(group, batched=builder.is_batched(group.args[0]))


@rule(("call_function", rt_guards.check_input_shape))
def fuse_check_input_shape(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """The export front-end's guard: a stacked input's fixed sizes sit after its model dim."""
    x, shape, name = group.args[:3]
    return builder.call(rt_guards.check_input_shape, x, shape, name, offset=1, batched=False,
                        **group.kwargs)  # (``exported``: how its sizes were exported)


#: Ops no rule fuses (each model runs its own), declared for what they compute over a
#: padded dim: they move units.
rule(*spellings("tile"), *spellings("broadcast_to"), ("call_method", "transpose_"),
     name="one_by_one[moves]", padding=MOVES)(runs_one_by_one)
