"""Differing ops (ops that may differ per model): which elementwise op a node is (the
fused node that runs each model's own on its slice is the driver's:
:func:`hftc.passes.driver.fuse_differing_op`).

Models that are one program except for an activation (ReLU in some, GELU or Tanh in
others) or dropout on in some and off in others (``nn.Dropout`` against ``nn.Identity``)
fuse: the matcher reads such a node as "an elementwise op" (:func:`elementwise_op`, through
:class:`hftc.match.PerModelTable`), records each model's op on model 0's node where they
differ (``meta[DIFFERING_OPS]``), and the driver emits::

    nn.ReLU()(h) | nn.GELU()(h) | nn.Identity()(h)    (models 0, 1, 2)
    -> differing_elementwise(h [3, ...], (("relu", ...), ("gelu", ...), ("identity", ())))

(:func:`hftc.lowering.runtime.differing_ops.differing_elementwise`: each model's op on its slice,
exact in forward and backward).  Only elementwise, shape-preserving ops are read so: any
other difference is refused as before.  (Before, this module was ``per_model_ops.py``
and :class:`DifferingOp` ``PerModelOp``: both names still import.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from ..lowering.runtime import differing_ops as rt_differing_ops

Op = rt_differing_ops.Op


@dataclass(frozen=True)
class DifferingOp:
    """``differing_op=``: an elementwise, shape-preserving op that may differ per model (ReLU
    in some models, GELU in others: :mod:`hftc.passes.differing_ops`)::

        DifferingOp("leaky_relu", F.leaky_relu, (("negative_slope", 0.01), ("inplace", False)),
                   ((("call_function", F.leaky_relu), ("negative_slope", "inplace"), ()),
                    (("call_module", nn.LeakyReLU), (), ())))

    ``name``: how the generated code names it; ``function``: ``function(x, **keywords)`` on
    a model's slice computes what the model computes; ``parameters``: its parameters
    besides the input, with their defaults; ``spellings``: the keys read as this op, each
    with the parameters it takes by position after the input and the keywords it fixes
    (``torch.relu_``: ``inplace=True``); a module key reads its attributes.  A spelling
    counts on a rule that has its key."""

    name: str
    function: Callable[..., Any]
    parameters: tuple[tuple[str, Any], ...] = ()
    spellings: tuple[tuple[tuple[str, Any], tuple[str, ...], tuple[tuple[str, Any], ...]], ...] = ()


#: The earlier name.
PerModelOp = DifferingOp


#: Key -> (the op, the parameters it takes by position after its input, the keywords it
#: fixes), and op name -> its parameters with their defaults: from every rule's
#: ``differing_op=`` (:func:`declare_differing_op`).
_SPELLINGS: dict[tuple[str, Any], tuple[DifferingOp, tuple[str, ...], dict[str, Any]]] = {}
OP_PARAMETERS: dict[str, tuple[tuple[str, Any], ...]] = {}


def declare_differing_op(op: DifferingOp, keys: Sequence[tuple[str, Any]], rule: str) -> None:
    """A rule's ``differing_op=`` (:func:`hftc.passes.registry.rule`): its spellings among
    the rule's ``keys`` read as ``op``, whose function the generated code calls by name
    (:data:`~hftc.lowering.runtime.differing_ops.ELEMENTWISE_OPS`)."""
    known = rt_differing_ops.ELEMENTWISE_OPS.setdefault(op.name, op.function)
    if known is not op.function or OP_PARAMETERS.setdefault(op.name, op.parameters) \
            != op.parameters:
        raise TypeError(f"rule `{rule}`: differing op `{op.name}` is declared twice, "
                        f"with another function or parameters")
    wanted = set(keys)  # (a list compared torch's op objects one by one: slow at import)
    _SPELLINGS.update({key: (op, positional, dict(fixed))
                       for key, positional, fixed in op.spellings if key in wanted})


_PLAIN = (bool, int, float, str)


def is_elementwise_function(value: Any) -> bool:
    """Is ``value`` a function :func:`elementwise_op` reads (``F.gelu``, ``torch.tanh``), as
    a model may hold one (``self.act = F.gelu``)?"""
    try:
        return ("call_function", value) in _SPELLINGS
    except TypeError:  # unhashable
        return False


def is_elementwise_module(module: nn.Module) -> bool:
    """Is ``module`` of a class :func:`elementwise_op` reads (``nn.ReLU``, ``nn.Tanh``: its
    exact class), one that may differ per model?"""
    return ("call_module", type(module)) in _SPELLINGS


def _op(name: str, given: dict[str, Any]) -> Op | None:
    """``(name, ((parameter, value), ...))`` with every parameter's default filled in; None
    where a value is not a plain constant (computed in forward) or not the op's."""
    parameters = dict(OP_PARAMETERS[name])
    if name == "dropout" and "training" in given:  # a function's own training flag
        parameters["training"] = True
    if not set(given) <= set(parameters):
        return None
    values = {**parameters, **given}
    if not all(isinstance(v, _PLAIN) for v in values.values()):
        return None
    return name, tuple(values.items())


def elementwise_op(node: fx.Node, root: nn.Module) -> Op | None:
    """The elementwise, shape-preserving op ``node`` computes on its one tensor input, as a
    :data:`~hftc.lowering.runtime.differing_ops.Op` (``("leaky_relu", (("negative_slope", 0.2),
    ("inplace", False)))``), or None for any other node."""
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        # its exact class: a subclass may compute something else
        found = _SPELLINGS.get(("call_module", type(module)))
        if found is None or len(node.args) != 1 or node.kwargs:
            return None
        name = found[0].name
        return _op(name, {key: getattr(module, key) for key, _ in OP_PARAMETERS[name]})
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        found = _SPELLINGS.get((node.op, node.target))
    except TypeError:  # an unhashable target
        return None
    if found is None:
        return None
    op, positional, fixed = found
    name = op.name
    args, kwargs = list(node.args), dict(node.kwargs)
    if not args:
        if "input" not in kwargs:
            return None
        args = [kwargs.pop("input")]
    if not isinstance(args[0], fx.Node) or len(args) - 1 > len(positional):
        return None
    given = dict(zip(positional, args[1:]))
    if set(given) & set(kwargs):
        return None
    given.update(kwargs)
    if "train" in given:  # torch.dropout's name for it
        given["training"] = given.pop("train")
    return _op(name, {**given, **fixed})


def op_input(node: fx.Node) -> Any:
    """The tensor input of a node :func:`elementwise_op` reads."""
    return node.args[0] if node.args else node.kwargs["input"]


def describe_op(op: Op) -> str:
    """``gelu(approximate='tanh')``: the op with the parameters it sets off their defaults."""
    name, values = op
    defaults = dict(OP_PARAMETERS[name])
    changed = [f"{k}={v!r}" for k, v in values if k not in defaults or defaults[k] != v]
    return f"{name}({', '.join(changed)})" if changed else name


def describe_ops(ops: list[Op]) -> str:
    """``relu (models 0, 1), gelu(approximate='tanh') (model 2)``."""
    models: dict[Op, list[int]] = {}
    for i, op in enumerate(ops):
        models.setdefault(op, []).append(i)
    return ", ".join(
        f"{describe_op(op)} (model{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))})"
        for op, ix in models.items())
