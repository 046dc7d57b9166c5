"""Elementwise ops in every spelling: activations, arithmetic, comparisons, dropout.

An elementwise op on ``[N, *s]`` computes each model's slice independently, so
it runs unchanged on fused data.  The one subtlety is broadcasting: per model,
``x [C] + y [B, C]`` lines up trailing dims; fused, ``x [N, C]`` must become
``[N, 1, C]`` first or its model dim would line up with ``B``::

    before (per model):  add(x_i [C], y [B, C])
    after:               add(x.reshape(N, 1, C), y)        -> [N, B, C]

Dropout and other random ops expand a shared input first, so each model draws
its own mask.  torchvision's stochastic depth (a ``torch.fx.wrap``-ped leaf) is one
draw for all models, each its own rate::

    before (per model):  stochastic_depth(x_i, p_i, "row", training)
    after:               x * noise            noise [N, B, 1, ...]: model i's rows kept
                                              with probability 1 - p_i, scaled 1 / (1 - p_i)
                         x                    (eval, or every p_i = 0: no draw)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..frontends.export import Emitter, aten_name
from ..ir import EXAMPLE_VALUE, TORCH_RANDOM_DRAWS, ArgKey, bind_arguments
from ..lowering.runtime import differing_ops as rt_differing_ops
from ..lowering.runtime import layout as rt_layout
from ..lowering.runtime import per_model as rt_per_model
from ..lowering.runtime import random as rt_random
from ..lowering.runtime import spatial as rt_spatial
from ..match import COMPARISONS
from .registry import (
    EXACT,
    MOVES,
    ChainLink,
    DifferingOp,
    FusionGroup,
    GraphBuilder,
    NotFusable,
    rule,
    runs_one_by_one,
    spellings,
)

aten = torch.ops.aten

UNARY = """
abs absolute acos arccos acosh arccosh asin arcsin asinh arcsinh atan arctan atanh arctanh
ceil cos cosh deg2rad digamma erf erfc erfinv exp exp2 expm1 floor frac lgamma log log10
log1p log2 logit neg negative rad2deg reciprocal round rsqrt sigmoid sign sgn sin sinc sinh
sqrt square tan tanh trunc fix relu nan_to_num clamp clip clamp_min clamp_max bitwise_not
logical_not isnan isinf isfinite signbit positive i0 angle conj
relu6 elu selu celu gelu silu mish leaky_relu hardtanh hardswish hardsigmoid softplus
softsign softshrink hardshrink tanhshrink threshold logsigmoid
float double half bfloat16 int long bool short char byte to type type_as contiguous clone
detach requires_grad_ cpu cuda zeros_like ones_like full_like empty_like fill_ zero_ tril triu
""".split()

#: Draws shaped like their input: from a shared ``[B, ...]`` input each model draws its own
#: ``[B, ...]`` (the input is broadcast to ``[N, B, ...]`` first, :func:`fuse_random`).
RANDOM_LIKE = "rand_like randn_like randint_like".split()

BINARY = """
add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow
float_power atan2 arctan2 hypot maximum minimum fmax fmin eq ne lt le gt ge greater less
greater_equal less_equal not_equal logical_and logical_or logical_xor bitwise_and bitwise_or
bitwise_xor copysign xlogy where masked_fill lerp addcmul addcdiv rsub heaviside
""".split()

OPERATORS = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs, operator.invert,
    operator.and_, operator.or_, operator.xor, operator.eq, operator.ne, operator.lt,
    operator.le, operator.gt, operator.ge, operator.iadd, operator.isub, operator.imul,
    operator.itruediv,
]
DUNDER = """__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__
__pow__ __rpow__ __neg__ __and__ __or__ __xor__ __iadd__ __isub__ __imul__ __itruediv__""".split()

#: Parameterless modules that act elementwise: run unchanged on fused data.
ELEMENTWISE_MODULES = [
    nn.ReLU, nn.ReLU6, nn.SELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign,
    nn.Softshrink, nn.Hardshrink, nn.Tanhshrink, nn.Threshold, nn.LogSigmoid, nn.Identity,
]


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


#: ``inplace=True`` activations the fused program runs out of place (the functional and
#: its constant arguments): their input there is usually a view (a fused conv or norm
#: unfolds ``[B, N*C, ...]`` to ``[N, B, C, ...]``), and an in-place op on a view makes
#: autograd rebuild the base in the backward (a clone, as_strided and copy_ of the whole
#: activation per op: docs/DESIGN_NOTES.md). Only these, whose backward from the input
#: equals the in-place one's: from the result (the ReLUs), or from the input that the
#: in-place op clones before writing (SiLU, Hardswish, Mish, Hardsigmoid: EfficientNet's
#: and MobileNetV3's, where the rebuild also handed their backward an N-major gradient).
OUT_OF_PLACE = {
    nn.ReLU: lambda m: (F.relu, ()),
    nn.ReLU6: lambda m: (F.hardtanh, (m.min_val, m.max_val)),
    nn.Hardtanh: lambda m: (F.hardtanh, (m.min_val, m.max_val)),
    nn.LeakyReLU: lambda m: (F.leaky_relu, (m.negative_slope,)),
    nn.SiLU: lambda m: (F.silu, ()),
    nn.Hardswish: lambda m: (F.hardswish, ()),
    nn.Mish: lambda m: (F.mish, ()),
    nn.Hardsigmoid: lambda m: (F.hardsigmoid, ()),
}


def _out_of_place(group: FusionGroup) -> tuple | None:
    """The out-of-place form of an in-place activation module, where no one sees the
    difference: the input is an intermediate value that this op alone uses."""
    module, node = group.module, group.node
    make = OUT_OF_PLACE.get(type(module))
    if node.op != "call_module" or make is None or not getattr(module, "inplace", False):
        return None
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node) or source.op not in (
            "call_module", "call_function", "call_method") or len(source.users) != 1:
        return None
    if isinstance(module, nn.LeakyReLU) and module.negative_slope < 0:
        return None  # the in-place backward reads the sign from the result: not the same
    return make(module)


def fuse_pointwise(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """Run the op unchanged, after lining up batched operands with the result's rank."""
    if group.node.op == "call_method" and group.node.target == "contiguous" and group.args \
            and builder.is_batched(group.args[0]):
        # a copy out of channels-last memory whose gradient goes back channels-last
        return builder.call(rt_spatial.contiguous, *group.args, **group.kwargs)
    out_of_place = _out_of_place(group)
    if out_of_place is not None and len(group.args) == 1 and not group.kwargs:
        fn, constants = out_of_place
        return builder.call(fn, group.args[0], *constants)
    out = group.example
    if not _is_tensor(out):
        if isinstance(out, (tuple, list)) or out is None:
            raise NotFusable("elementwise op with a non-tensor result")
        if group.per_model:
            # x.shape[-1] ** -0.5 / self.t: a Python number per model, which the copy
            # below would compute with model 0's t for all
            raise NotFusable("Python arithmetic on sizes with a per-model number")
        return builder.copy(group, batched=builder.is_batched((group.args, group.kwargs)))
    if group.node.target == "where" or group.node.target is torch.where:
        if len(group.args) + len(group.kwargs) == 1:
            raise NotFusable("torch.where(condition) returns data-dependent indices")
    rank = out.dim()

    def align(fused, original):
        if isinstance(fused, fx.Node) and fused in builder.batched and isinstance(
            original, fx.Node
        ):
            example = original.meta.get(EXAMPLE_VALUE)
            if _is_tensor(example) and example.dim() < rank:
                return builder.call(rt_layout.pad_model_dims, fused, rank)
        return fused

    args = [align(f, o) for f, o in zip(group.args, group.node.args)]
    kwargs = {k: align(v, group.node.kwargs[k]) for k, v in group.kwargs.items()}
    # A float constant that differs per model (x * 0.5 in one, x * 0.7 in another) becomes
    # a [N, 1, ..., 1] tensor of the dtype the Python scalar would have promoted to.
    if group.per_model:
        if isinstance(group.node.target, str) and group.node.target.endswith("_") and (
                args[0] not in builder.batched):
            # x.div_(p_n) on a tensor the models share would write N values into one
            raise NotFusable("an in-place op with per-model scalars on a shared tensor")
        tensors = [(f, o.meta[EXAMPLE_VALUE]) for f, o in zip(args, group.node.args)
                   if isinstance(o, fx.Node) and _is_tensor(o.meta.get(EXAMPLE_VALUE))]
        # (the promotion is with the values' operand: torch.where(cond, x, v)'s x, not cond)
        like = next((f for f, t in tensors if t.is_floating_point()), tensors[0][0])
        if not out.is_floating_point() and group.node.target not in COMPARISONS:
            # a tensor of bounds would promote an integer result to float
            raise NotFusable("per-model float constants of an op with a non-float result")
        number_only = NUMBER_ONLY.get(_op_name(group.node))
        if number_only is not None:  # torch takes one number there, not a tensor of N
            return number_only(group, builder, args, kwargs)
        for pos in range(len(args)):
            values = group.per_model_arg(pos, "")
            if values is not None:
                args[pos] = builder.call(rt_per_model.scalars, tuple(values), like, rank)
        for name in group.per_model_keywords():  # clamp(x, min=lo_n, max=hi_n)
            values = group.per_model[ArgKey(keyword=name)]
            kwargs[name] = builder.call(rt_per_model.scalars, tuple(values), like, rank)
        if "alpha" in group.per_model_keywords():
            # add(x, y, alpha=a_n) takes only a number: x + y * a, a a [N, 1, ...] tensor
            alpha = kwargs.pop("alpha")
            if len(args) > 1:
                args[1] = builder.call(operator.mul, args[1], alpha)
            else:  # add(x, other=y, alpha=a_n)
                kwargs["other"] = builder.call(operator.mul, kwargs["other"], alpha)
    aligned = FusionGroup(group.node, group.nodes, tuple(args), kwargs, group.module)
    return builder.copy(aligned, batched=True)


def _op_name(node: fx.Node) -> str:
    """``masked_fill`` for ``x.masked_fill_(...)`` and ``torch.masked_fill(...)``."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.removesuffix("_")


def _in_place(group: FusionGroup) -> bool:
    return isinstance(group.node.target, str) and group.node.target.endswith("_")


def _per_model_masked_fill(group: FusionGroup, builder: GraphBuilder, args: list,
                           kwargs: dict) -> fx.Node:
    """``x.masked_fill(mask, value_n)`` -> ``where(mask, value_n, x)`` (masked_fill takes one
    number): the same values and gradient."""
    if _in_place(group):
        raise NotFusable("masked_fill_ with a per-model value (run model by model)")
    x, mask = builder.broadcast(args[0]), args[1] if len(args) > 1 else kwargs["mask"]
    return builder.call(rt_per_model.masked_fill, x, mask,
                        tuple(group.per_model_arg(2, "value")))


def _per_model_full_like(group: FusionGroup, builder: GraphBuilder, args: list,
                         kwargs: dict) -> fx.Node:
    """``torch.full_like(x, v_n, ...)``: each model's slice filled with its own value."""
    options = {k: v for k, v in kwargs.items() if k != "fill_value"}
    return builder.call(rt_per_model.full_like, builder.broadcast(args[0]),
                        tuple(group.per_model_arg(1, "fill_value")), **options)


def _per_model_value(group: FusionGroup, builder: GraphBuilder, args: list,
                     kwargs: dict) -> fx.Node:
    """``addcmul(x, t1, t2, value=v_n)`` / ``addcdiv``: ``value`` takes one number, so
    ``addcmul(x, t1 * v_n, t2)``: the same values to rounding (ATen's CPU kernel computes
    ``x + value * t1 * t2`` and ``x + value * t1 / t2`` in that order: the same bits)."""
    values = group.per_model_arg(3, "value")
    like = builder.broadcast(args[0])
    value = builder.call(rt_per_model.scalars, tuple(values), like, group.example.dim())
    kwargs = {k: v for k, v in kwargs.items() if k != "value"}
    tensors = [*args[1:3]] + [kwargs.pop(k) for k in ("tensor1", "tensor2") if k in kwargs]
    scaled = builder.call(operator.mul, tensors[0], value)
    fused = FusionGroup(group.node, group.nodes, (like, scaled, tensors[1]), kwargs,
                        group.module)
    return builder.copy(fused, batched=True)


#: The ops whose per-model number torch takes only as a Python number (a tensor of N
#: values is refused): how each runs with every model's own.
NUMBER_ONLY = {"masked_fill": _per_model_masked_fill, "full_like": _per_model_full_like,
               "addcmul": _per_model_value, "addcdiv": _per_model_value}


# Parameters of the ops whose number arguments may differ per model (``per_model=``'s
# positions, for every spelling: torch.where has several schemas, a method none).
def _where_signature(condition, input, other):
    """``torch.where(condition, input, other)``."""


def _masked_fill_signature(input, mask, value):
    """``Tensor.masked_fill(mask, value)``."""


def _rsub_signature(input, other, alpha=1):
    """``torch.rsub(input, other)``: ``other - input``."""


def _binary_signature(input, other):
    """``torch.remainder(input, other)``, ``fmod``, ``xlogy``."""


def _addcmul_signature(input, tensor1, tensor2, value=1):
    """``torch.addcmul`` / ``addcdiv`` (``value`` keyword-only in torch; read by name)."""


def _full_like_signature(input, fill_value, *, dtype=None, layout=None, device=None,
                         pin_memory=False, requires_grad=False, memory_format=None):
    """``torch.full_like(input, fill_value, ...)``."""


#: op -> its parameters and the numbers that may differ per model
#: (``torch.where(h > 0, h, self.floor)``, ``x.masked_fill(mask, self.fill)``,
#: ``torch.rsub(x, self.c)``, ``torch.addcmul(x, a, b, value=self.rate)``,
#: ``torch.full_like(x, self.init)``, ``torch.remainder(x, self.period)``).
PER_MODEL_NUMBERS = {
    "where": (_where_signature, ("input", "other")),
    "masked_fill": (_masked_fill_signature, ("value",)),
    "rsub": (_rsub_signature, ("other",)),
    "addcmul": (_addcmul_signature, ("value",)),
    "addcdiv": (_addcmul_signature, ("value",)),
    "full_like": (_full_like_signature, ("fill_value",)),
    "remainder": (_binary_signature, ("other",)),
    "fmod": (_binary_signature, ("other",)),
    "xlogy": (_binary_signature, ("input", "other")),
}


def fuse_random(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``torch.rand_like(x)`` and the random methods (``x.bernoulli_()``): a shared input
    is expanded so every model draws its own numbers; the op runs on the fused tensor.
    A per-model probability (timm's ``drop_path`` at each model's rate)::

        x.bernoulli_(p_n)  ->  random.per_model_bernoulli_(x [N, ...], (p_0, ..., p_N-1))
    """
    if group.per_model:
        p = group.per_model_arg(1, "p")
        if group.node.target != "bernoulli_" or p is None or len(group.per_model) > 1 or any(
                isinstance(v, fx.Node) for v in p):
            raise NotFusable("per-model arguments of a random op")
        return builder.call(rt_random.per_model_bernoulli_, builder.broadcast(group.args[0]),
                            tuple(p))
    args = (builder.broadcast(group.args[0]), *group.args[1:])
    return builder.copy(FusionGroup(group.node, group.nodes, args, group.kwargs, group.module),
                        batched=True)


#: Each dropout's functional: its module and its torch.* spelling (``train`` for ``training``).
_DROPOUTS = {F.dropout: (nn.Dropout, torch.dropout),
             F.alpha_dropout: (nn.AlphaDropout, torch.alpha_dropout)}


def fuse_dropout(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``nn.Dropout(p)(x)``, ``F.dropout(x, p, training, inplace)``, ``torch.dropout(x, p,
    train)`` (and alpha dropout's), bound by the functional's names (a module's ``p`` its
    attribute, ``training`` its flag at run time); a shared input is expanded so each model
    draws its own mask::

        F.dropout(x, p)      -> random.dropout(x [N, ...], p)   (a faster CPU mask sampler)
        p differs per model  -> per_model.dropout(x, (p_0, ..., p_N-1))
    """
    module = group.module
    if module is not None:
        functional = next(fn for fn, (cls, _) in _DROPOUTS.items() if isinstance(module, cls))
        a = group.arguments(builder, functional, training=builder.training_flag(group))
    else:
        functional = next(fn for fn, spellings in _DROPOUTS.items()
                          if group.node.target in (fn, *spellings))
        a = group.arguments(builder, group.node.target)
        if "train" in a:  # torch.dropout's name
            a["training"] = a.pop("train")
    x, p = builder.broadcast(a["input"]), group.per_model_values("p")
    if functional is F.alpha_dropout:
        if p is not None:
            raise NotFusable("per-model rates of alpha dropout")
        return builder.call(F.alpha_dropout, x, a["p"], a["training"], a.get("inplace", False))
    if p is not None:
        return builder.call(rt_random.per_model_dropout, x, tuple(p), a["training"])
    return builder.call(rt_random.dropout, x, a["p"], a["training"], a.get("inplace", False))


#: torchvision's ``stochastic_depth(input, p, mode, training=True)`` (fx-wrapped: a leaf of
#: the traced graph), and its stand-in for machines without torchvision, by name: the
#: passes import neither.
STOCHASTIC_DEPTH = ("torchvision.ops.stochastic_depth.stochastic_depth",
                    "hftc.bench.torchvision_ops.stochastic_depth")


def _stochastic_depth_signature(input, p, mode, training=True):  # noqa: A002 - torchvision's
    """torchvision's parameters (for ``per_model``'s positions)."""


@rule(*(("call_function", name) for name in STOCHASTIC_DEPTH), random=True,
      per_model=("p",), signature=_stochastic_depth_signature)
def fuse_stochastic_depth(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """One draw for all models, each its own rate (:func:`random.stochastic_depth`); the
    input itself in eval mode or where every model's rate is 0."""
    p = group.per_model_arg(1, "p") or [group.arg(1, "p")] * builder.num_models
    mode, training = group.arg(2, "mode"), group.arg(3, "training", True)
    if any(isinstance(v, fx.Node) for v in (*p, mode, training)):
        raise NotFusable("stochastic depth's p, mode or training computed in forward")
    if not all(isinstance(q, (int, float)) and 0 <= q <= 1 for q in p) \
            or mode not in ("batch", "row"):
        raise NotFusable(f"stochastic depth's p {p} or mode {mode!r} out of range "
                         f"(each model raises torchvision's error)")
    example = group.arg_example(0)
    if not isinstance(example, torch.Tensor) or example.dim() == 0:
        raise NotFusable("stochastic depth of a 0-d value")
    if not training or not any(p):
        return group.args[0]
    return builder.call(rt_random.stochastic_depth, builder.broadcast(group.args[0]),
                        tuple(float(q) for q in p), mode)


def fuse_slope(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """LeakyReLU / ELU / CELU, with a slope or alpha that may differ per model."""
    node = group.node
    if type(group.module) is nn.CELU or node.target is F.celu:
        if group.per_model:
            # ATen differentiates celu with 1/alpha rounded to float32; only a per-model
            # call reproduces that gradient bit for bit.
            raise NotFusable("celu with a per-model alpha (exact only model by model)")
        return fuse_pointwise(group, builder)
    # a subclass that keeps LeakyReLU's forward is fused by its base's key
    target = node.target if node.op != "call_module" else next(
        cls for op, cls in SLOPE_KEYS if op == "call_module" and isinstance(group.module, cls))
    values = group.per_model_values(SLOPE_KEYS[(node.op, target)])
    kernel = {nn.LeakyReLU: rt_per_model.leaky_relu, nn.ELU: rt_per_model.elu,
              F.leaky_relu: rt_per_model.leaky_relu, F.elu: rt_per_model.elu}[target]
    if values is None:
        return fuse_pointwise(group, builder)
    return builder.call(kernel, builder.broadcast(group.args[0]), tuple(values))


def chained_relu(node: fx.Node, root: nn.Module) -> bool:
    """Is this fused node a ReLU between two linears of a chain (:mod:`hftc.lowering.chains`):
    ``F.relu``, ``torch.relu``, ``x.relu()`` or ``nn.ReLU`` (out of place or in place)?"""
    if len(node.args) != 1 or set(node.kwargs) - {"inplace"}:
        return False
    if node.op == "call_function":
        return node.target in (F.relu, torch.relu)
    if node.op == "call_method":
        return node.target == "relu"
    if node.op == "call_module":
        return type(root.get_submodule(node.target)) is nn.ReLU
    return False


def fuse_new_tensor(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``x.new_zeros(shape)``: only x's dtype and device are read; the result is shared."""
    return builder.copy(group, batched=False)


#: LeakyReLU / ELU / CELU take a slope or alpha that may differ per model: ``fuse_slope``
#: (which runs ``fuse_pointwise`` where the models agree) for their module and ``F.*``
#: spellings, ``{key: the per-model hyper-parameter}``; the others (``torch.celu_``,
#: ``Tensor.elu``) take no per-model value.
SLOPE_KEYS = {
    ("call_module", nn.LeakyReLU): "negative_slope", ("call_module", nn.ELU): "alpha",
    ("call_module", nn.CELU): "alpha", ("call_function", F.leaky_relu): "negative_slope",
    ("call_function", F.elu): "alpha", ("call_function", F.celu): "alpha",
}



def elu_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.elu(x, alpha, scale, input_scale)`` -> ``F.elu(x, alpha)`` where the scales
    are 1 (``nn.ELU``); SELU-like scales stay ATen (the one-by-one fallback)."""
    a = bind_arguments(e.source.target, args, kwargs)
    if a["scale"] == 1 and a["input_scale"] == 1:
        return e.call(F.elu, a["input"], a["alpha"])
    return e.call(aten.elu.default, *args, **kwargs)


def to_as_method(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.to`` / ``aten._to_copy(x, dtype=...)`` -> ``x.to(dtype=..., copy=...)``."""
    kept = {k: v for k, v in kwargs.items()
            if k in ("dtype", "device", "non_blocking", "copy", "memory_format")}
    if aten_name(e) == "_to_copy":
        kept["copy"] = True
    return e.method("to", *args, **kept)


def lift_fresh_copy_as_clone(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    return e.call(torch.clone, args[0])


def dropout_inplace_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    a = bind_arguments(e.source.target, args, kwargs)
    return e.call(F.dropout, a["input"], a["p"], a["train"], True)


#: The ATen ops torch.export records for these ops where it does not spell them
#: ``torch.NAME`` with the same arguments (``@rule(aten=...)``), by op name or function.
EXPORTED_AS = {
    "gelu": {aten.gelu: F.gelu}, "silu": {aten.silu: F.silu}, "mish": {aten.mish: F.mish},
    "hardswish": {aten.hardswish: F.hardswish}, "hardsigmoid": {aten.hardsigmoid: F.hardsigmoid},
    "hardtanh": {aten.hardtanh: F.hardtanh}, "softplus": {aten.softplus: F.softplus},
    "logsigmoid": {aten.log_sigmoid: F.logsigmoid}, "relu6": {aten.relu6: F.relu6},
    "to": {aten.to: to_as_method, aten._to_copy: to_as_method},
    "clone": {aten.lift_fresh_copy: lift_fresh_copy_as_clone},
    F.leaky_relu: {aten.leaky_relu: F.leaky_relu}, F.elu: {aten.elu: elu_as_functional},
    F.dropout: {aten.dropout: F.dropout, aten.dropout_: dropout_inplace_as_functional},
    F.alpha_dropout: {aten.alpha_dropout: F.alpha_dropout},
}

def _differing_op(name: str, function, parameters=(), spellings=(), module=None) -> DifferingOp:
    """A :class:`DifferingOp` whose spellings are ``(function, positional parameters after the
    input, fixed keywords)`` or ``(method name, ...)``, and its ``module`` class."""
    keys = [(("call_method", f) if isinstance(f, str) else ("call_function", f), p, tuple(k))
            for f, p, k in spellings]
    if module is not None:
        keys.append((("call_module", module), (), ()))
    return DifferingOp(name, function, tuple(parameters), tuple(keys))


_INPLACE = (("inplace", False),)
_IN_PLACE = {"inplace": True}.items()
#: The elementwise, shape-preserving ops that may differ per model (``@rule(differing_op=
#: ...)``: :mod:`hftc.passes.differing_ops`), each with its spellings.
DIFFERING_OPS = [
    # the function: what the matcher puts where a model skips an op the others run
    # (`if self.drop_rate > 0: x = F.dropout(x, ...)`: hftc.match)
    _differing_op("identity", rt_differing_ops.identity,
                  spellings=[(rt_differing_ops.identity, (), ())], module=nn.Identity),
    _differing_op("relu", F.relu, _INPLACE, [
        (torch.relu, (), ()), ("relu", (), ()), (torch.relu_, (), _IN_PLACE),
        ("relu_", (), _IN_PLACE), (F.relu, ("inplace",), ())], nn.ReLU),
    *(_differing_op(name, getattr(torch, name), (), [
        (getattr(torch, name), (), ()), (name, (), ()), (getattr(F, name), (), ())],
        getattr(nn, name.title())) for name in ("tanh", "sigmoid")),
    *(_differing_op(f"{name}_", getattr(torch, f"{name}_"), (), [
        (getattr(torch, f"{name}_"), (), ()), (f"{name}_", (), ())])
      for name in ("tanh", "sigmoid")),
    *(_differing_op(name, getattr(F, name), _INPLACE, [(getattr(F, name), ("inplace",), ())],
                    module) for name, module in (
        ("relu6", nn.ReLU6), ("silu", nn.SiLU), ("mish", nn.Mish), ("selu", nn.SELU),
        ("hardswish", nn.Hardswish), ("hardsigmoid", nn.Hardsigmoid))),
    _differing_op("gelu", F.gelu, [("approximate", "none")], [(F.gelu, ("approximate",), ())],
                  nn.GELU),
    _differing_op("leaky_relu", F.leaky_relu, [("negative_slope", 0.01), ("inplace", False)], [
        (F.leaky_relu, ("negative_slope", "inplace"), ()),
        (F.leaky_relu_, ("negative_slope",), _IN_PLACE)], nn.LeakyReLU),
    *(_differing_op(name, getattr(F, name), [("alpha", 1.0), ("inplace", False)],
                    [(getattr(F, name), ("alpha", "inplace"), ())], module)
      for name, module in (("elu", nn.ELU), ("celu", nn.CELU))),
    _differing_op("softplus", F.softplus, [("beta", 1.0), ("threshold", 20.0)],
                  [(F.softplus, ("beta", "threshold"), ())], nn.Softplus),
    _differing_op("hardtanh", F.hardtanh, [("min_val", -1.0), ("max_val", 1.0), ("inplace", False)],
                  [(F.hardtanh, ("min_val", "max_val", "inplace"), ())], nn.Hardtanh),
    *(_differing_op(name, getattr(F, name), (), [(getattr(F, name), (), ())], module)
      for name, module in (("softsign", nn.Softsign), ("tanhshrink", nn.Tanhshrink),
                           ("logsigmoid", nn.LogSigmoid))),
    # a module's dropout has no `training` here: it follows the fused module's flag
    _differing_op("dropout", rt_differing_ops.dropout, [("p", 0.5), ("inplace", False)], [
        (F.dropout, ("p", "training", "inplace"), ()), (torch.dropout, ("p", "train"), ())],
        nn.Dropout),
]


def _differing_ops(keys) -> tuple[DifferingOp, ...]:
    """The differing ops some of ``keys`` spell."""
    keys = set(keys)
    return tuple(op for op in DIFFERING_OPS if any(k in keys for k, _, _ in op.spellings))


#: Over a padded dim (``@rule(padding=...)``) an elementwise op is exact as it is (each
#: real unit reads its own units); these copy their input, whose layout is checked.
COPIES = ("contiguous", "clone", "detach")
#: The ReLUs a linear chain takes between two linears (``@rule(chain=...)``).
RELU_LINK = ChainLink("relu", chained_relu)

for _name in UNARY + BINARY:
    _keys = [key for key in spellings(_name, inplace=True) if key not in SLOPE_KEYS]
    _signature, _per_model = PER_MODEL_NUMBERS.get(_name, (None, ()))
    rule(*_keys, name=f"fuse_pointwise[{_name}]", aten=EXPORTED_AS.get(_name),
         padding=MOVES if _name in COPIES else EXACT,
         chain=RELU_LINK if _name == "relu" else None, per_model=_per_model,
         signature=_signature, differing_op=_differing_ops(_keys))(fuse_pointwise)
for _key, _slope in SLOPE_KEYS.items():
    rule(_key, name=f"fuse_slope[{_key[1].__name__}]", per_model=(_slope,),
         aten=EXPORTED_AS.get(_key[1]), padding=EXACT,
         differing_op=_differing_ops([_key]))(fuse_slope)
for _name in RANDOM_LIKE:
    rule(*spellings(_name, inplace=True), name=f"fuse_random[{_name}]", random=True)(fuse_random)
for _op in OPERATORS:
    rule(("call_function", _op), name=f"fuse_pointwise[{_op.__name__}]",
         padding=EXACT)(fuse_pointwise)
for _name in DUNDER:
    rule(("call_method", _name), name=f"fuse_pointwise[{_name}]", padding=EXACT)(fuse_pointwise)
for _cls in ELEMENTWISE_MODULES:
    rule(("call_module", _cls), name=f"fuse_pointwise[{_cls.__name__}]", padding=EXACT,
         chain=RELU_LINK if _cls is nn.ReLU else None,
         differing_op=_differing_ops([("call_module", _cls)]))(fuse_pointwise)
rule(("call_function", rt_differing_ops.identity), name="fuse_pointwise[identity]",
     padding=EXACT,
     differing_op=_differing_ops([("call_function", rt_differing_ops.identity)]))(fuse_pointwise)
for _fn, (_cls, _torch_fn) in _DROPOUTS.items():
    _keys = [("call_module", _cls), ("call_function", _fn), ("call_function", _torch_fn)]
    rule(*_keys, name=f"fuse_dropout[{_fn.__name__}]", random=True, per_model=("p",),
         aten=EXPORTED_AS.get(_fn), padding=EXACT,
         differing_op=_differing_ops(_keys))(fuse_dropout)
for _name in ("dropout", "dropout_", "bernoulli", "uniform_", "normal_"):
    rule(("call_method", _name), name=f"fuse_random[{_name}]", random=True,
         padding=EXACT if _name.startswith("dropout") else None)(fuse_random)


def _bernoulli_signature(self, p=0.5, *, generator=None):
    """``Tensor.bernoulli_``'s parameters (for ``per_model``'s positions)."""


rule(("call_method", "bernoulli_"), name="fuse_random[bernoulli_]", random=True,
     per_model=("p",), signature=_bernoulli_signature)(fuse_random)
for _name in ("new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"):
    rule(("call_method", _name), name=f"fuse_new_tensor[{_name}]")(fuse_new_tensor)

#: Draws no rule fuses: each model draws its own in the one-by-one fallback, even from a shared
#: input (one draw for all of them made every model's result the same).  RReLU's slopes
#: (in training) and fractional max-pooling's regions are drawn too; their deterministic
#: uses (RReLU in eval, given regions) run as the one-by-one fallback as well: exact.
_RRELU = (F.rrelu, F.rrelu_, torch.rrelu, torch.rrelu_)
RANDOM_DRAWS = [
    *(getattr(torch, name) for name in TORCH_RANDOM_DRAWS if name not in RANDOM_LIKE),
    F.rrelu, F.rrelu_, torch.rrelu, torch.rrelu_,
    F.fractional_max_pool2d, F.fractional_max_pool3d, F.fractional_max_pool2d_with_indices,
    F.fractional_max_pool3d_with_indices,
]
RANDOM_DRAW_METHODS = ["random_", "exponential_", "geometric_", "log_normal_", "cauchy_",
                       "multinomial"]
RANDOM_DRAW_MODULES = [nn.RReLU, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d]
rule(*(("call_function", fn) for fn in RANDOM_DRAWS),
     *(("call_method", name) for name in RANDOM_DRAW_METHODS),
     *(("call_module", cls) for cls in RANDOM_DRAW_MODULES),
     name="one_by_one[random]", random=True,
     # RReLU is elementwise: exact over a padded dim as it is
     padding=lambda node: EXACT if node.target in _RRELU else None)(runs_one_by_one)
