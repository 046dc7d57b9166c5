"""``pad_widths=True``: ops of the models' own forward over a padded dim, computed over each
model's real units (:mod:`hftc.module.padding` pads the modules; this module, forward's code).

::

    model i (C_i = 32):   h = fc1(x); a = h.sigmoid().softmax(-1)      # over 32 units
    padded  (C = 64):     a = softmax(h.sigmoid())  over 64: the 32 padded units (0.5) count
    rewritten:            a = real_units.reduce("softmax", h.sigmoid(), pad_i, count_i, dim=-1)
                              = softmax(masked_fill(s, pad_i, -inf), -1).masked_fill(pad_i, 0)

Every padded tensor is laid out as a prefix: model i's real units first, padding after.
Given the call's inputs (``example_inputs``), each ORIGINAL model and its padded model are
traced with the same leaves (the padded modules and stock ``torch.nn`` modules; the
user's modules traced through), so that the graphs match node by node, and run once: a
dim where the padded value is larger than model i's is padded, model i's size there is
its real extent.  Then, in the padded graph, each op over a padded dim does what its rule
declares (``@rule(..., padding=...)`` in :mod:`hftc.passes`; the kinds are
:data:`hftc.passes.registry.PADDING_KINDS`):

* ``Reduces``: reductions and normalisations (sum, mean, var, std, amax, amin, max, min,
  argmax, argmin, logsumexp, softmax, log_softmax, F.layer_norm, F.normalize, norm)
  take a mask of the padding (``pad_i``, True on padded units) and the real count
  (:func:`reduce`);
* ``SPLITS``: split / chunk / tensor_split along a padded dim take each piece's real
  units with the padding after it (:func:`split`: ``index_select`` with model i's
  indices, then padding zeroed), so that piece k is model i's own piece k, padded;
* ``CONTRACTS``: a matmul contracting a padded dim zeroes one operand's padding first;
* ``MOVES``: ops that only move units (view, reshape, transpose, getitem ...) are checked
  to keep each model's units where its prefix layout expects them, by running them on
  indices;
* a size of a padded dim in Python arithmetic that scales a tensor (``h * h.size(-1) **
  -0.5``, ``att / math.sqrt(k.size(-1))``) becomes model i's own size, a 0-d tensor
  (:meth:`_Rewriter.rewrite_sizes`);
* ``EXACT``: element-wise ops (and the padded modules) are exact as they are; an op that
  no rule knows is exact where ATen tags it pointwise; anything else over a padded dim
  is refused (:class:`UnsupportedOperatorError`, naming the op and its line).

The per-model masks, counts and indices are non-persistent buffers of each padded model's
root (not in ``state_dict``; the fused module stacks them per model, as the padded
modules' own buffers), and the rewritten graphs (one per train / eval mode) become the
padded models' forward.  The first-call check against the original models stays.
"""

from __future__ import annotations

import inspect
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.graph_module import _format_import_block, _forward_from_src
from torch.package import sys_importer

from ..errors import UnsupportedOperatorError
from ..frontends.symbolic import record_values, trace_with_leaves
from ..ir import set_training
from ..passes.differing_ops import elementwise_op, op_input
from ..passes.registry import (
    ATTENDS,
    CONTRACTS,
    EXACT,
    MOVES,
    PER_CHANNEL,
    SPLITS,
    Reduces,
    lookup,
    padding_of,
    widens_of,
)
from .padding import PaddedModule, is_padded

# ---------------------------------------------------------------- the rewritten ops


def _fill(x: Tensor, pad: Tensor, value: float, integer: bool = False) -> Tensor:
    """``x`` with ``value`` on the padding; for an ``integer`` tensor (known when the op
    was rewritten: no branch on a traced dtype) +-inf is its dtype's largest / smallest."""
    if integer and value in (float("inf"), float("-inf")):
        info = torch.iinfo(x.dtype)
        value = info.max if value > 0 else info.min
    return x.masked_fill(pad, value)


def reduce(op: str, x: Tensor, pad: Tensor, count: Tensor, args: dict[str, Any]) -> Any:
    """``op`` (with the normalised arguments ``args``) over model i's real units of ``x``:
    ``pad`` is True on the padded units of the reduced dims (broadcast to ``x``),
    ``count`` the number of real units reduced.  Padded outputs of the ops that keep
    ``x``'s shape are 0."""
    dim, keepdim = args.get("dim"), args.get("keepdim", False)
    integer = args.get("integer", False)

    def _filled(x: Tensor, pad: Tensor, value: float) -> Tensor:
        return _fill(x, pad, value, integer)

    if op in ("sum", "nansum"):
        return getattr(_filled(x, pad, 0), op)(dim, keepdim=keepdim, dtype=args.get("dtype"))
    if op == "mean":
        return _filled(x, pad, 0).sum(dim, keepdim=keepdim, dtype=args.get("dtype")) / count
    if op in ("var", "std"):
        centred = _filled(x - _filled(x, pad, 0).sum(dim, keepdim=True) / count, pad, 0)
        var = (centred * centred).sum(dim, keepdim=keepdim) / (count - args["correction"])
        return var if op == "var" else var.sqrt()
    if op in ("amax", "logsumexp"):
        return getattr(torch, op)(_filled(x, pad, float("-inf")), dim, keepdim)
    if op == "amin":
        return torch.amin(_filled(x, pad, float("inf")), dim, keepdim)
    if op in ("max", "argmax", "min", "argmin"):
        fill = float("-inf") if op in ("max", "argmax") else float("inf")
        return getattr(torch, op)(_filled(x, pad, fill), dim, keepdim)
    if op in ("softmax", "log_softmax"):
        out = getattr(torch, op)(_filled(x, pad, float("-inf")), dim, dtype=args.get("dtype"))
        return out.masked_fill(pad, 0)
    if op == "norm":
        return torch.linalg.vector_norm(_filled(x, pad, 0), args["ord"], dim, keepdim,
                                        dtype=args.get("dtype"))
    if op == "normalize":
        norm = torch.linalg.vector_norm(_filled(x, pad, 0), args["ord"], dim, True)
        return (x / norm.clamp_min(args["eps"]).expand_as(x)).masked_fill(pad, 0)
    if op == "layer_norm":
        mean = _filled(x, pad, 0).sum(dim, keepdim=True) / count
        centred = _filled(x - mean, pad, 0)
        y = centred * torch.rsqrt((centred * centred).sum(dim, keepdim=True) / count
                                  + args["eps"])
        if args.get("weight") is not None:
            y = y * args["weight"]
        if args.get("bias") is not None:
            y = y + args["bias"]
        return y
    raise AssertionError(op)  # not reached: _reduction only gives the ops above


def split(x: Tensor, select: Tensor, dim: int, sizes: list[int]) -> tuple:
    """``x`` split along ``dim`` into pieces of the padded ``sizes``, piece k holding model
    i's own piece k in its first units: ``select[j, u]`` is 1 where unit u of the pieces
    reads unit j of ``x``, and a unit after a piece's real ones reads none (0).  A matmul
    with one 1 per column is exact, and a per-model matrix fuses as a batched matmul."""
    return (x.movedim(dim, -1) @ select.to(x.dtype)).movedim(-1, dim).split(sizes, dim)


def masked(x: Tensor, pad: Tensor) -> Tensor:
    """``x`` with its padded units zeroed (before a matmul contracts the padded dim)."""
    return x.masked_fill(pad, 0)


# ---------------------------------------------------------------- which op is which

#: Python arithmetic on a size that :meth:`_Rewriter.rewrite_sizes` runs on a per-model
#: 0-d tensor instead, and the element-wise ops through which such a number may scale a
#: tensor.
_NUMBER_OPS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv,
                         operator.pow, operator.neg, math.sqrt})
#: Ops that pick units by their values: over a padded dim, whether a padded zero is
#: picked depends on the inputs, so they are refused even where the first call's check
#: passes.
_SELECTS = frozenset({"sort", "argsort", "msort", "topk", "kthvalue", "median", "nanmedian",
                      "mode", "quantile", "nanquantile"})
_SCALES = frozenset({operator.add, operator.sub, operator.mul, operator.truediv,
                     torch.add, torch.sub, torch.mul, torch.div})


def _op_name(node: fx.Node) -> str | None:
    """The op's torch name (``x.softmax`` and ``F.softmax`` -> "softmax"), or None."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        target = node.target
        if target is torch.linalg.vector_norm:
            return "vector_norm"
        name = getattr(target, "__name__", None)
        if name and target in (getattr(torch, name, None), getattr(F, name, None),
                               getattr(torch.Tensor, name, None),
                               getattr(torch.linalg, name, None)):
            return name
    return None


def _where(node: fx.Node) -> str:
    """The node's module path and the user's source line, for messages."""
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()), ("",))[0] if stack else ""
    path = path if isinstance(path, str) else ""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    files = [k for k, ln in enumerate(lines) if ln.startswith("File ")
             and "/torch/" not in ln and "/hftc/" not in ln]
    line = ""
    if files:
        k = files[-1]
        found = re.match(r'File "(.*)", line (\d+)', lines[k])
        line = f"{found[1]}:{found[2]}" if found else lines[k]
        if k + 1 < len(lines):
            line += f": `{lines[k + 1]}`"
    where = f"`{path}`" if path else "the root"
    return f"in {where}" + (f" ({line})" if line else "")


def _dims(dim: Any, ndim: int) -> tuple[int, ...]:
    if dim is None or dim == () or dim == []:
        return tuple(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return tuple(d % ndim for d in dims)


def _reduction(node: fx.Node, fact: Reduces, values: dict[fx.Node, Any], ndim: int
               ) -> tuple[str, dict[str, Any], tuple[int, ...]] | None:
    """(op, normalised arguments, reduced dims) of a reduction / normalisation node, as its
    rule declares it (``@rule(padding=Reduces(...))``), or None where the call reduces
    nothing (``torch.max(a, b)``).  Tensors are passed to the rule's function as graph
    nodes, the rest as their values."""
    def value(a: Any) -> Any:
        return a if not isinstance(a, fx.Node) or isinstance(values.get(a), Tensor) \
            else values.get(a, a)

    args = [value(a) for a in node.args]
    kwargs = {k: value(v) for k, v in node.kwargs.items()}
    try:
        bound = fact.parameters(*args, **kwargs)
    except TypeError:
        return None
    if bound is None:
        return None
    dims = _dims(bound["dim"], ndim)
    if bound["dim"] is not None:
        bound["dim"] = dims[0] if fact.one_dim else dims
    return fact.op, bound, dims


def _unknown_pointwise(node: fx.Node) -> bool:
    """An op no rule knows, exact over a padded dim because ATen tags it pointwise."""
    try:
        if lookup(node, None) is not None:
            return False
    except TypeError:  # an unhashable target
        pass
    name = _op_name(node)
    if name is None:
        return False
    op = getattr(torch.ops.aten, name.rstrip("_"), None) or getattr(torch.ops.aten, name, None)
    if not isinstance(op, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.pointwise in getattr(op, o).tags for o in op.overloads())


# ---------------------------------------------------------------- tracing and values


def _trace(model: nn.Module, training: bool, concrete: dict[str, Any]) -> fx.GraphModule:
    was = [(m, m.training) for m in model.modules()]
    set_training(model, training)
    try:
        return trace_with_leaves(model, is_padded, concrete)
    finally:
        for m, mode in was:
            m.training = mode


def _run(model: nn.Module, training: bool, concrete: dict[str, Any], args: Sequence[Any]
         ) -> tuple[fx.GraphModule, dict[fx.Node, Any]]:
    gm = _trace(model, training, concrete)
    # Run on the model's own modules, not on a deep copy of the trace (one per model and
    # mode was an eighth of a padded fusing): their training flags and the values of
    # their parameters and buffers (running statistics) are put back after.
    tensors = {id(t): t for t in (*gm.parameters(), *gm.buffers())}
    saved = [(t, t.detach().clone()) for t in tensors.values()]
    modes = [(m, m.training) for m in gm.modules()]
    set_training(gm, training)
    try:
        with torch.no_grad():
            values = record_values(gm, *args)
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for t, value in saved:
                t.copy_(value)
    return gm, values


# ---------------------------------------------------------------- the analysis


class _Refused(Exception):
    pass


class _Rewriter:
    """One mode's padded graph, rewritten with every model's real extents."""

    def __init__(self, padded: fx.GraphModule, padded_values: dict[fx.Node, Any],
                 originals: list[tuple[fx.GraphModule, dict[fx.Node, Any]]], mode: str):
        self.gm = padded
        self.values = padded_values
        self.mode = mode
        self.n = len(originals)
        #: per model: padded graph node -> the original graph's value there
        self.real: list[dict[fx.Node, Any]] = []
        #: per model: padded graph node -> the original graph's node (its own constants)
        self.original_nodes: list[dict[fx.Node, fx.Node]] = []
        self.original_values = [values for _, values in originals]
        for gm, values in originals:
            self.real.append({p: values[o] for p, o in zip(padded.graph.nodes, gm.graph.nodes)})
            self.original_nodes.append(dict(zip(padded.graph.nodes, gm.graph.nodes)))
        #: buffer name -> per model tensor
        self.constants: dict[str, list[Tensor]] = {}
        self.changed = False

    # per-model tensors, as get_attr nodes of the root
    def constant(self, before: fx.Node, kind: str, per_model: list[Tensor]) -> fx.Node:
        name = f"_hftc_real_units_{self.mode}_{len(self.constants)}_{kind}"
        self.constants[name] = per_model
        self.gm.register_buffer(name, per_model[0], persistent=False)
        with self.gm.graph.inserting_before(before):
            return self.gm.graph.get_attr(name)

    def padded_dims(self, node: fx.Node) -> dict[int, list[int]]:
        """dim -> each model's real extent, for the dims of ``node``'s tensor that some
        model has narrower than the padded one."""
        value = self.values.get(node)
        if not isinstance(value, Tensor):
            return {}
        dims: dict[int, list[int]] = {}
        reals = [r.get(node) for r in self.real]
        for d, size in enumerate(value.shape):
            extents = [r.shape[d] if isinstance(r, Tensor) and r.dim() == value.dim() else None
                       for r in reals]
            if any(e is None or e > size for e in extents):
                raise _Refused(f"its value has shape {tuple(value.shape)} padded, but "
                               f"{[tuple(r.shape) if isinstance(r, Tensor) else r for r in reals]}"
                               f" in the models: not a padding of theirs")
            if any(e < size for e in extents):
                dims[d] = extents
        return dims

    def pad_mask(self, node: fx.Node, x: fx.Node, dims: Sequence[int]) -> list[Tensor]:
        shape = self.values[x].shape
        padded = self.padded_dims(x)
        masks = []
        for i in range(self.n):
            mask_shape = [shape[d] if d in dims and d in padded else 1 for d in range(len(shape))]
            pad = torch.ones(mask_shape, dtype=torch.bool)
            pad[tuple(slice(0, padded[d][i]) if d in dims and d in padded else slice(None)
                      for d in range(len(shape)))] = False
            masks.append(pad)
        return masks

    def run(self) -> None:
        self.rewrite_sizes()
        self.rewrite_scalars()
        for node in list(self.gm.graph.nodes):
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            inputs = [a for a in node.all_input_nodes if isinstance(self.values.get(a), Tensor)]
            try:
                if not any(self.padded_dims(a) for a in inputs):
                    continue
                self.visit(node, inputs)
            except _Refused as why:
                refused = UnsupportedOperatorError(
                    f"pad_widths=True cannot compute `{self.describe(node)}` {_where(node)} "
                    f"over each model's real units: {why}. Give every model the same width "
                    f"there (hftc.fuse_groups fuses models of one width together), or write "
                    f"the op as one hftc computes over the real units (sum, mean, var, std, "
                    f"amax, amin, max, min, logsumexp, softmax, log_softmax, F.layer_norm, "
                    f"F.normalize, norm over the padded dim; split / chunk along it; views "
                    f"that keep each model's units first)", [self.describe(node)])
                # a selection's exactness depends on the values: no check vouches for it
                refused.values_decide = _op_name(node) in _SELECTS
                raise refused from None

    def differs(self, node: fx.Node) -> bool:
        """A Python number (a size, or computed from one) that some model has another
        value of than the padded graph."""
        value = self.values.get(node)
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and any(r.get(node) != value for r in self.real))

    def only_scales(self, node: fx.Node) -> bool:
        """Every use of the number ``node`` is Python arithmetic (:data:`_NUMBER_OPS`) whose
        result is used so too, or scales a tensor element-wise (:data:`_SCALES`)."""
        for user in node.users:
            value = self.values.get(user)
            if isinstance(value, Tensor):
                if user.op != "call_function" or user.target not in _SCALES:
                    return False
            elif (not isinstance(value, (int, float)) or user.op != "call_function"
                  or user.target not in _NUMBER_OPS or not self.only_scales(user)):
                return False
        return bool(node.users)

    def rewrite_sizes(self) -> None:
        """A size of a padded dim in forward's arithmetic (``h * h.size(-1) ** -0.5``)
        is the padded width in the padded graph: each model's own value instead, as a
        per-model 0-d tensor (its Python arithmetic then runs on tensors)::

            size = h.size(-1); s = size ** -0.5; y = h * s     # 64 ** -0.5 for all
            size = self._hftc_real_units_..._size; ...          # 32 ** -0.5 for model i
        """
        done: set[fx.Node] = set()
        for node in list(self.gm.graph.nodes):
            if node in done or not self.differs(node) or not self.only_scales(node):
                continue
            per_model = [torch.tensor(float(r[node]), dtype=torch.float64) for r in self.real]
            const = self.constant(node, "size", per_model)
            node.replace_all_uses_with(const)
            self.gm.graph.erase_node(node) if not node.users else None
            users = list(const.users)
            while users:  # its arithmetic now takes a tensor: math.sqrt cannot
                user = users.pop()
                if user not in done and not isinstance(self.values.get(user), Tensor):
                    done.add(user)
                    user.target = torch.sqrt if user.target is math.sqrt else user.target
                    users.extend(user.users)
            self.changed = True

    def rewrite_scalars(self) -> None:
        """A number an element-wise op takes that is another in the models' own graphs: a
        user's int attribute padding widened (``math.sqrt(self.d_model)`` is the widest
        model's in the padded graph), as each model's own, a per-model 0-d tensor::

            x * 2.83   (the padded graph: d_model 8)    ->  x * self._hftc_..._scalar
            x * 2.0    (model 0's own: d_model 4)           (2.0 for model 0, 2.83 for 1)
        """
        for node in list(self.gm.graph.nodes):
            value = self.values.get(node)
            if (node.op != "call_function" or node.target not in _SCALES
                    or not isinstance(value, Tensor) or not value.is_floating_point()):
                continue
            args = list(node.args)
            if any(len(self.original_nodes[i][node].args) != len(args) for i in range(self.n)):
                continue
            for k, arg in enumerate(args):
                if isinstance(arg, bool) or not isinstance(arg, (int, float)):
                    continue
                own = [self.original_nodes[i][node].args[k] for i in range(self.n)]
                if all(o == arg for o in own):
                    continue
                per_model = [torch.tensor(float(o), dtype=torch.float64) for o in own]
                args[k] = self.constant(node, "scalar", per_model)
                self.changed = True
            node.args = tuple(args)

    def describe(self, node: fx.Node) -> str:
        if node.op == "call_module":
            return f"{type(self.gm.get_submodule(node.target)).__name__} ({node.target})"
        return _op_name(node) or getattr(node.target, "__name__", str(node.target))

    def visit(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        """The op over a padded dim, as its rule declares (``@rule(padding=...)``:
        :func:`hftc.passes.registry.padding_of`): left as it is, checked, rewritten to
        compute over each model's real units, or refused."""
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        if module is not None and self.padded_by_pad_models(node):
            return
        fact = padding_of(node, module)
        if isinstance(fact, Reduces) and module is not None:
            call = fact.as_function(module) if fact.as_function else None
            if call is None:
                raise _Refused("hftc does not know what this module computes over a padded dim")
            node.op, node.target = "call_function", call[0]
            node.kwargs = {**node.kwargs, **call[1]}
            return self.visit(node, inputs)
        x = inputs[0]
        if isinstance(fact, Reduces):
            found = _reduction(node, fact, self.values, self.values[x].dim()) \
                if node.args and node.args[0] is x else None
            if found is not None:
                return self.rewrite_reduction(node, x, *found)
            fact = fact.otherwise
        if fact == EXACT or (fact is None and module is None and _unknown_pointwise(node)):
            return None
        if fact == PER_CHANNEL:  # the spatial dims must be whole
            return self.check_per_channel(node, x)
        if fact is not None:
            return {SPLITS: self.rewrite_split, MOVES: self.check_moves,
                    CONTRACTS: self.rewrite_matmul, ATTENDS: self.check_attention}[fact](
                        node, inputs)
        what = "module" if module is not None else "op"
        if _op_name(node) in _SELECTS:
            raise _Refused("it selects among the units by value, and the padding's zeros "
                           "would rank among them on some inputs (the first-call check "
                           "cannot vouch for the others)")
        raise _Refused(f"hftc does not know what this {what} computes over a padded dim")

    def check_per_channel(self, node: fx.Node, x: fx.Node) -> None:
        out = self.values[node]
        spatial = range(self.values[x].dim() - len(out.shape[2:]), self.values[x].dim()) \
            if isinstance(out, Tensor) else range(self.values[x].dim())
        if set(self.padded_dims(x)) & set(spatial):
            raise _Refused("pooling over a padded spatial dim")

    def padded_by_pad_models(self, node: fx.Node) -> bool:
        """A module :func:`hftc.module.padding.pad_models` padded: exact on padded inputs
        by its construction (:func:`_padded_by_pad_models`)."""
        originals = [self.original_nodes[i][node].graph.owning_module for i in range(self.n)]
        return _padded_by_pad_models(node.target, self.gm.get_submodule(node.target),
                                     originals)

    def rewrite_reduction(self, node: fx.Node, x: fx.Node, op: str, args: dict[str, Any],
                          dims: tuple[int, ...]) -> None:
        padded = self.padded_dims(x)
        if not set(dims) & set(padded):
            return
        if op in ("argmax", "argmin") and args.get("dim") is None:
            raise _Refused("an index into the flattened padded tensor is not the model's")
        counts = []
        for i in range(self.n):
            count = 1
            for d in dims:
                count *= padded[d][i] if d in padded else self.values[x].shape[d]
            counts.append(torch.tensor(float(count), dtype=torch.float64))
        pad = self.constant(node, "pad", self.pad_mask(node, x, dims))
        count = self.constant(node, "count", counts)
        node.op, node.target = "call_function", reduce
        args = {**args, "integer": not self.values[x].is_floating_point()}
        node.args, node.kwargs = (op, x, pad, count, args), {}
        self.changed = True

    def rewrite_split(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        x = inputs[0]
        dim_arg = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        shape = self.values[x].shape
        dim = dim_arg % len(shape)
        padded = self.padded_dims(x)
        if dim not in padded:
            return self.check_moves(node, [x])
        sizes = [p.shape[dim] for p in self.values[node]]
        selects = []
        for i in range(self.n):
            real = [p.shape[dim] for p in self.real[i][node]]
            if len(real) != len(sizes) or any(r > s for r, s in zip(real, sizes)):
                raise _Refused(f"model {i}'s pieces {real} do not fit the padded pieces {sizes}")
            select = torch.zeros(shape[dim], sum(sizes), dtype=torch.float64)
            start, column = 0, 0
            for r, s in zip(real, sizes):
                select[torch.arange(start, start + r), torch.arange(column, column + r)] = 1
                start, column = start + r, column + s
            selects.append(select)
        select_node = self.constant(node, "select", selects)
        node.op, node.target = "call_function", split
        node.args, node.kwargs = (x, select_node, dim, sizes), {}
        self.changed = True

    def rewrite_matmul(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        a, b = node.args[0], node.args[1]
        if not isinstance(self.values.get(a), Tensor):
            raise _Refused("a matmul of a non-tensor")
        contracted = self.values[a].dim() - 1
        if contracted in self.padded_dims(a):
            pad = self.constant(node, "pad", self.pad_mask(node, a, (contracted,)))
            with self.gm.graph.inserting_before(node):
                zeroed = self.gm.graph.call_function(masked, (a, pad))
            node.args = (zeroed, b, *node.args[2:])
            self.changed = True

    def check_attention(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        q, k = node.args[0], node.args[1]
        for t, what in ((q, "the query's"), (k, "the key's")):
            if self.values[t].dim() - 2 in self.padded_dims(t):
                raise _Refused(f"{what} sequence length is padded (its softmax would count "
                               f"the padded positions)")
        contracted = self.values[q].dim() - 1
        if contracted in self.padded_dims(q):
            pad = self.constant(node, "pad", self.pad_mask(node, q, (contracted,)))
            with self.gm.graph.inserting_before(node):
                zeroed = self.gm.graph.call_function(masked, (q, pad))
            node.args = (zeroed, *node.args[1:])
            self.changed = True

    def check_moves(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        """An op that moves units: run on each model's unit numbers (its real units
        numbered, padding -1), the padded op must put model i's units where the prefix
        of the original op's result has them."""
        for i in range(self.n):
            padded_args, real_args, offset = {}, {}, 0
            for x in inputs:
                real_shape = self.real[i][x].shape
                numbers = torch.arange(offset, offset + real_shape.numel(),
                                       dtype=torch.float64).view(real_shape)
                offset += real_shape.numel()
                marked = torch.full(self.values[x].shape, -1.0, dtype=torch.float64)
                marked[tuple(slice(0, s) for s in real_shape)] = numbers
                padded_args[x], real_args[x] = marked, numbers
            try:
                got = self.call(node, {**self.values, **padded_args})
                want = self.call(self.original_nodes[i][node], {
                    **self.original_values[i],
                    **{self.original_nodes[i][x]: v for x, v in real_args.items()}})
            except Exception as exc:  # noqa: BLE001 - not a pure move: refused below
                raise _Refused(f"it does not only move units ({exc})") from None
            gots = got if isinstance(got, (tuple, list)) else (got,)
            wants = want if isinstance(want, (tuple, list)) else (want,)
            if len(gots) != len(wants) or any(
                    not isinstance(g, Tensor) or g.dim() != w.dim()
                    or any(gs < ws for gs, ws in zip(g.shape, w.shape))
                    or not torch.equal(g[tuple(slice(0, s) for s in w.shape)], w)
                    for g, w in zip(gots, wants)):
                raise _Refused(f"it moves model {i}'s real units out of the first positions "
                               f"(the padding would land among them)")

    def call(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":  # (Flatten, Unflatten: no state)
            return node.graph.owning_module.get_submodule(node.target)(*args, **kwargs)
        return node.target(*args, **kwargs)


# ---------------------------------------------------------------- the entry point


def compute_over_real_units(originals: Sequence[nn.Module], padded: Sequence[nn.Module],
                            example_args: Sequence[tuple]) -> list[nn.Module]:
    """The ``padded`` models (:func:`hftc.module.padding.pad_models` of ``originals``), their
    forward rewritten so that its ops over a padded dim compute over each model's real
    units (``example_args[i]``: model i's inputs, for the shapes); the models themselves
    where nothing needs it, or where forward cannot be traced with those leaves (the
    first-call check then judges).  Raises :class:`UnsupportedOperatorError` for an op
    over a padded dim that cannot be made exact."""
    signature = inspect.signature(type(padded[0]).forward)
    params = list(signature.parameters.values())[1:]
    given = {p.name for p in params[:len(example_args[0])]}
    concrete = {p.name: p.default for p in params if p.name not in given
                and p.default is not inspect.Parameter.empty}
    if _nothing_to_rewrite(originals, padded, concrete):
        return list(padded)
    sources: dict[str, str] = {}
    constants: dict[str, list[Tensor]] = {}
    attributes: dict[str, list[Any]] = {}  # each model's own number or op, by name
    for training in (True, False):
        mode = "train" if training else "eval"
        try:
            runs = [_run(m, training, concrete, a) for m, a in zip(originals, example_args)]
            pads = [_run(m, training, concrete, a) for m, a in zip(padded, example_args)]
        except Exception:  # noqa: BLE001 - not traceable so: the first-call check judges
            return list(padded)
        ops = _differing_elementwise_ops([p[0] for p in pads])
        same = ops is not None and all(
            [(n.op, n.target) for n in r[0].graph.nodes]
            == [(n.op, n.target) for n in p[0].graph.nodes] for r, p in zip(runs, pads))
        if not same:
            return list(padded)
        floats = _differing_floats([p[0] for p in pads])
        rewriter = _Rewriter(pads[0][0], pads[0][1], runs, mode)
        rewriter.run()
        if rewriter.changed:
            attributes.update(_floats_as_attributes(rewriter.gm, floats, mode))
            attributes.update(_ops_as_attributes(rewriter.gm, ops, mode))
            code = rewriter.gm.graph.python_code(root_module="self")
            sources[mode] = _format_import_block(code.globals, sys_importer) + "\n" + code.src
            constants.update(rewriter.constants)
    if not sources:
        return list(padded)
    rewritten = _rewritten_class(type(padded[0]), tuple(sorted(sources.items())))
    for i, model in enumerate(padded):
        model.__class__ = rewritten
        like = next((t for t in model.parameters()), torch.zeros(()))
        for name, per_model in constants.items():
            value = per_model[i]
            if value.is_floating_point():
                value = value.to(like.dtype)
            model.register_buffer(name, value.to(like.device), persistent=False)
        for name, values in attributes.items():
            vars(model)[name] = values[i]
    return list(padded)


def _signature(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """Each node's op, target and arguments (nodes by position, floats as ``float``): the
    padded models' graphs are one program when these agree; their floats (a per-model
    dropout p) may differ (:func:`_differing_floats`), and so may their elementwise ops
    (:func:`_differing_elementwise_ops`)."""
    position = {n: k for k, n in enumerate(gm.graph.nodes)}

    def mask(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", position[a])
        return float if isinstance(a, float) else a

    return [(n.op, n.target, fx.node.map_aggregate(n.args, mask),
             fx.node.map_aggregate(n.kwargs, mask)) for n in gm.graph.nodes]


def _differing_elementwise_ops(graphs: Sequence[fx.GraphModule]
                               ) -> list[tuple[fx.Node, list[ElementwiseCall]]] | None:
    """(node of ``graphs[0]``, each graph's op) where the padded models' graphs differ
    only in an elementwise op on the same input (``F.relu(h)`` in one model,
    ``torch.tanh(h)`` in another: the fusion's differing ops, exact over a padded dim);
    None where they differ otherwise (not one program)."""
    signatures = [_signature(g) for g in graphs]
    if len({len(s) for s in signatures}) != 1:
        return None
    found = []
    for entries, nodes in zip(zip(*signatures), zip(*(g.graph.nodes for g in graphs))):
        if all(e == entries[0] for e in entries):
            continue
        if any(elementwise_op(n, g) is None or n.op == "call_module"
               for n, g in zip(nodes, graphs)):
            return None
        inputs = [op_input(n) for n in nodes]
        positions = {list(g.graph.nodes).index(x) for x, g in zip(inputs, graphs)}
        if len(positions) != 1:
            return None
        found.append((nodes[0], [ElementwiseCall.of(n) for n in nodes]))
    return found


class ElementwiseCall:
    """One model's elementwise op with its constants, called on its input: ``F.leaky_relu(x,
    0.2)`` as ``ElementwiseCall(F.leaky_relu, (0.2,), {})(x)``, ``x.tanh()`` as
    ``ElementwiseCall("tanh", (), {})(x)`` (a root attribute the rewritten forward calls,
    each model's own; tracing it records the op itself, in the model's spelling)."""

    def __init__(self, target: Callable[..., Any] | str, args: tuple, kwargs: dict) -> None:
        self.target, self.args, self.kwargs = target, args, kwargs

    @classmethod
    def of(cls, node: fx.Node) -> ElementwiseCall:
        kwargs = {k: v for k, v in node.kwargs.items() if k != "input"}
        return cls(node.target, tuple(node.args[1:]), kwargs)

    def __call__(self, x: Any) -> Any:
        if isinstance(self.target, str):  # a method: x.tanh()
            return getattr(x, self.target)(*self.args, **self.kwargs)
        return self.target(x, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        name = getattr(self.target, "__name__", self.target)
        return f"{name}(x, *{self.args}, **{self.kwargs})"


def _ops_as_attributes(gm: fx.GraphModule, ops: list[tuple[fx.Node, list[ElementwiseCall]]],
                       mode: str) -> dict[str, list[ElementwiseCall]]:
    """The rewritten graph (model 0's) calls each differing elementwise op through an
    attribute of the root, each model's own op there (the fusion then reads it as a
    differing op)::

        F.relu(h)  ->  self._hftc_op_train_0(h)     (F.relu in model 0, torch.tanh in 1)
    """
    calls: dict[str, list[ElementwiseCall]] = {}
    for node, per_model in ops:
        if node.graph is not gm.graph:
            continue
        name = f"_hftc_op_{mode}_{len(calls)}"
        calls[name] = per_model
        vars(gm)[name] = per_model[0]
        with gm.graph.inserting_before(node):
            read = gm.graph.create_node("get_attr", name)
            call = gm.graph.call_method("__call__", (read, op_input(node)))
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    return calls


def _differing_floats(graphs: Sequence[fx.GraphModule]
                      ) -> list[tuple[fx.Node, int | str, list[float]]]:
    """(node of ``graphs[0]``, argument index or keyword, each graph's value) of every
    top-level float argument that differs among the padded models' graphs."""
    found = []
    for nodes in zip(*(g.graph.nodes for g in graphs)):
        first = nodes[0]
        if any(n.target != first.target for n in nodes):
            continue  # a differing op: its own constants (:func:`_differing_elementwise_ops`)
        for key in [*range(len(first.args)), *first.kwargs]:
            values = [n.args[key] if isinstance(key, int) else n.kwargs[key] for n in nodes]
            if isinstance(values[0], float) and any(v != values[0] for v in values):
                found.append((first, key, values))
    return found


def _floats_as_attributes(gm: fx.GraphModule,
                          floats: list[tuple[fx.Node, int | str, list[float]]], mode: str
                          ) -> dict[str, list[float]]:
    """The rewritten graph (traced from model 0's padded model, so holding its floats)
    reads each differing float from an attribute of the root, each model's own value
    there (the fusion then treats it as any per-model float attribute)::

        sdpa(q, k, v, dropout_p=0.1)  ->  sdpa(q, k, v, dropout_p=self._hftc_float_train_0)
    """
    numbers: dict[str, list[float]] = {}
    for node, key, values in floats:
        current = node.args[key] if isinstance(key, int) else node.kwargs[key]
        if node.graph is not gm.graph or not isinstance(current, float) \
                or current != values[0]:  # rewritten since (a per-model 0-d tensor)
            continue
        name = f"_hftc_float_{mode}_{len(numbers)}"
        numbers[name] = values
        vars(gm)[name] = values[0]
        with gm.graph.inserting_before(node):
            read = gm.graph.create_node("get_attr", name)  # (a float: no tensor warning)
        if isinstance(key, int):
            node.args = (*node.args[:key], read, *node.args[key + 1:])
        else:
            node.kwargs = {**node.kwargs, key: read}
    return numbers


def _nothing_to_rewrite(originals: Sequence[nn.Module], padded: Sequence[nn.Module],
                        concrete: dict[str, Any]) -> bool:
    """Whether no op of forward can see a padded dim otherwise than exactly: every call
    is a module :func:`~hftc.module.padding.pad_models` padded, or an op or module whose
    rule declares it ``EXACT`` (one trace of model 0's padded forward, nothing run: the
    common case, a stack of layers, costs no analysis)."""
    try:
        gm = _trace(padded[0], True, concrete)
    except Exception:  # noqa: BLE001 - the analysis decides (and says why)
        return False
    if any(_scales_by_a_size(node) for node in gm.graph.nodes) or _widened_ints(
            originals, padded):
        return False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if module is not None and _padded_by_pad_models(node.target, module, originals):
            continue
        fact = padding_of(node, module) if node.op != "get_attr" else None
        if fact == EXACT or (fact is None and node.op in ("call_function", "call_method")
                             and _unknown_pointwise(node)):
            continue
        return False
    return True


def _widened_ints(originals: Sequence[nn.Module], padded: Sequence[nn.Module]) -> bool:
    """Whether :func:`~hftc.module.padding.pad_models` widened an int attribute of the
    user's modules (``self.d_model``), which forward's arithmetic may read."""
    for original, pad in zip(originals, padded):
        for path, module in original.named_modules():
            if type(module).__module__.startswith("torch.nn"):
                continue
            mine = vars(pad.get_submodule(path))
            if any(isinstance(v, int) and not isinstance(v, bool) and mine.get(k) != v
                   for k, v in vars(module).items()):
                return True
    return False


def _scales_by_a_size(node: fx.Node) -> bool:
    """Whether ``node`` reads a size (``x.size(-1)``, ``x.shape``, ``x.numel()``) that flows
    through Python arithmetic into an element-wise op: a padded dim's size there is the
    padded width, which :meth:`_Rewriter.rewrite_sizes` makes each model's own."""
    reads = (node.op == "call_method" and node.target in ("size", "numel")) or (
        node.op == "call_function" and node.target is getattr and node.args[1:2] == ("shape",))
    users, seen = list(node.users) if reads else [], set()
    while users:
        user = users.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if user.target in _SCALES:
            return True
        if user.target in _NUMBER_OPS or user.target is operator.getitem:
            users.extend(user.users)
    return False


def _padded_by_pad_models(path: str, module: nn.Module, originals: Sequence[nn.Module]) -> bool:
    """Module ``path`` of a padded model is one :func:`~hftc.module.padding.pad_models`
    padded (a masked norm, a layer at the widest widths, one holding them): any of its
    tensors wider than some original model's own, or, for a layer padding widens
    (``@rule(widens=...)``) without tensors (``BatchNorm1d(affine=False,
    track_running_stats=False)``), a width attribute (``num_features``) widened."""
    if any(isinstance(m, PaddedModule) for m in module.modules()):
        return True
    mine = {n: t.shape for n, t in [*module.named_parameters(), *module.named_buffers()]}
    sizes = {k: v for k, v in vars(module).items() if not k.startswith("_")
             and isinstance(v, (int, tuple)) and not isinstance(v, bool)} \
        if not mine and widens_of(module) is not None else {}
    for original in originals:
        owner = original.get_submodule(path)
        theirs = {n: t.shape for n, t in [*owner.named_parameters(), *owner.named_buffers()]}
        if any(theirs.get(n, shape) != shape for n, shape in mine.items()) or any(
                vars(owner).get(k, v) != v for k, v in sizes.items()):
            return True
    return False


_REWRITTEN: dict[tuple, type] = {}


def _rewritten_class(base: type, sources: tuple[tuple[str, str], ...]) -> type:
    """``base`` with the rewritten forward (``sources``: (mode, the graph's Python source)),
    one class per rewrite, so that every padded model and its copies have one type; a
    model of it pickles as ``base``'s with the sources (the class is rebuilt on load)."""
    key = (base, sources)
    if key not in _REWRITTEN:
        _REWRITTEN[key] = type(base.__name__, (base,), {
            "forward": _mode_forward(base, dict(sources)), "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__reduce_ex__": lambda self, protocol: (
                _rebuilt, (base, sources, self.__getstate__()))})
    return _REWRITTEN[key]


def _rebuilt(base: type, sources: tuple[tuple[str, str], ...], state: dict) -> nn.Module:
    model = nn.Module.__new__(_rewritten_class(base, sources))
    model.__setstate__(state)
    return model


def _mode_forward(cls: type, sources: dict[str, str]) -> Callable[..., Any]:
    """forward(self, <forward's own parameters>): the train or eval graph's code, by
    ``self.training`` (a mode without a rewrite runs the class's own forward)."""
    train, evaluate = (_forward_from_src(sources[mode], {}) if mode in sources else cls.forward
                       for mode in ("train", "eval"))
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    scope: dict[str, Any] = {"_train": train, "_eval": evaluate}
    heads = []
    for k, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise UnsupportedOperatorError(
                f"pad_widths=True: {cls.__name__}.forward's parameter `{p}` (*args, **kwargs "
                f"or keyword-only) cannot be rewritten; give forward plain parameters", [])
        if p.default is inspect.Parameter.empty:
            heads.append(p.name)
        else:
            scope[f"_default{k}"] = p.default
            heads.append(f"{p.name}=_default{k}")
    names = ", ".join(p.name for p in params)
    source = (f"def forward(self, {', '.join(heads)}):\n"
              f"    return (_train if self.training else _eval)(self, {names})\n")
    exec(source, scope)  # noqa: S102 - a signature of forward's own parameter names
    return scope["forward"]


__all__ = ["compute_over_real_units", "masked", "reduce", "split"]
