"""Ops that may differ per model: which elementwise op a node is (the fused node that runs
each model's own on its slice is the driver's: :func:`hftc.passes.driver.fuse_per_model_op`).

Models that are one program except for an activation (ReLU in some, GELU or Tanh in
others) or dropout on in some and off in others (``nn.Dropout`` against ``nn.Identity``)
fuse: the matcher reads such a node as "an elementwise op" (:func:`elementwise_op`, through
:class:`hftc.match.PerModelTable`), records each model's op on model 0's node where they
differ (``meta[PER_MODEL_OPS]``), and the driver emits::

    nn.ReLU()(h) | nn.GELU()(h) | nn.Identity()(h)    (models 0, 1, 2)
    -> per_model_elementwise(h [3, ...], (("relu", ...), ("gelu", ...), ("identity", ())))

(:func:`hftc.lowering.runtime.per_model_ops.per_model_elementwise`: each model's op on its slice,
exact in forward and backward).  Only elementwise, shape-preserving ops are read so: any
other difference is refused as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..lowering.runtime import per_model_ops as rt_per_model_ops

Op = rt_per_model_ops.Op

_INPLACE = (("inplace", False),)

#: Each op's parameters besides its input, with their defaults (every spelling of an op
#: fills them in, so ``F.relu(x)`` and ``nn.ReLU()`` are one op).
OP_PARAMETERS: dict[str, tuple[tuple[str, Any], ...]] = {
    "identity": (), "relu": _INPLACE, "relu6": _INPLACE, "gelu": (("approximate", "none"),),
    "silu": _INPLACE, "mish": _INPLACE, "tanh": (), "tanh_": (), "sigmoid": (), "sigmoid_": (),
    "leaky_relu": (("negative_slope", 0.01), ("inplace", False)),
    "elu": (("alpha", 1.0), ("inplace", False)), "selu": _INPLACE,
    "celu": (("alpha", 1.0), ("inplace", False)),
    "softplus": (("beta", 1.0), ("threshold", 20.0)), "hardswish": _INPLACE,
    "hardsigmoid": _INPLACE,
    "hardtanh": (("min_val", -1.0), ("max_val", 1.0), ("inplace", False)),
    "softsign": (), "tanhshrink": (), "logsigmoid": (),
    # a module's dropout has no `training` here: it follows the fused module's flag
    "dropout": (("p", 0.5), ("inplace", False)),
}

#: Modules (their exact class: a subclass may compute something else) -> the op.
MODULE_OPS: dict[type, str] = {
    nn.Identity: "identity", nn.ReLU: "relu", nn.ReLU6: "relu6", nn.GELU: "gelu",
    nn.SiLU: "silu", nn.Mish: "mish", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
    nn.LeakyReLU: "leaky_relu", nn.ELU: "elu", nn.SELU: "selu", nn.CELU: "celu",
    nn.Softplus: "softplus", nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid",
    nn.Hardtanh: "hardtanh", nn.Softsign: "softsign", nn.Tanhshrink: "tanhshrink",
    nn.LogSigmoid: "logsigmoid", nn.Dropout: "dropout",
}

#: A function or method call -> (the op, its positional parameters after the input, the
#: keywords the spelling fixes).
_FUNCTION_OPS: dict[tuple[str, Any], tuple[str, tuple[str, ...], dict[str, Any]]] = {}


def _spell(name: str, keys: list[tuple[str, Any]], positional: tuple[str, ...] = (),
           **fixed: Any) -> None:
    for key in keys:
        _FUNCTION_OPS.setdefault(key, (name, positional, fixed))


def _function(fn: Any) -> tuple[str, Any]:
    return ("call_function", fn)


for _name in ("relu", "tanh", "sigmoid"):
    _spell(_name, [_function(getattr(torch, _name)), ("call_method", _name)])
    _spell(_name if _name == "relu" else f"{_name}_",
           [_function(getattr(torch, f"{_name}_")), ("call_method", f"{_name}_")],
           **({"inplace": True} if _name == "relu" else {}))
_spell("tanh", [_function(F.tanh)])
_spell("sigmoid", [_function(F.sigmoid)])
for _name in ("relu", "relu6", "silu", "mish", "selu", "hardswish", "hardsigmoid"):
    _spell(_name, [_function(getattr(F, _name))], ("inplace",))
_spell("gelu", [_function(F.gelu)], ("approximate",))
_spell("leaky_relu", [_function(F.leaky_relu)], ("negative_slope", "inplace"))
_spell("leaky_relu", [_function(F.leaky_relu_)], ("negative_slope",), inplace=True)
_spell("elu", [_function(F.elu)], ("alpha", "inplace"))
_spell("celu", [_function(F.celu)], ("alpha", "inplace"))
_spell("softplus", [_function(F.softplus)], ("beta", "threshold"))
_spell("hardtanh", [_function(F.hardtanh)], ("min_val", "max_val", "inplace"))
for _name in ("softsign", "tanhshrink", "logsigmoid"):
    _spell(_name, [_function(getattr(F, _name))])
_spell("dropout", [_function(F.dropout)], ("p", "training", "inplace"))
_spell("dropout", [_function(torch.dropout)], ("p", "train"))

_PLAIN = (bool, int, float, str)


def is_elementwise_function(value: Any) -> bool:
    """Is ``value`` a function :func:`elementwise_op` reads (``F.gelu``, ``torch.tanh``), as
    a model may hold one (``self.act = F.gelu``)?"""
    try:
        return ("call_function", value) in _FUNCTION_OPS
    except TypeError:  # unhashable
        return False


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
    :data:`~hftc.lowering.runtime.per_model_ops.Op` (``("leaky_relu", (("negative_slope", 0.2),
    ("inplace", False)))``), or None for any other node."""
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        name = MODULE_OPS.get(type(module))
        if name is None or len(node.args) != 1 or node.kwargs:
            return None
        return _op(name, {key: getattr(module, key) for key, _ in OP_PARAMETERS[name]})
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        found = _FUNCTION_OPS.get((node.op, node.target))
    except TypeError:  # an unhashable target
        return None
    if found is None:
        return None
    name, positional, fixed = found
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
