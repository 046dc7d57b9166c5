"""Stage 2: are the N graphs the same program?  Which node of model i is node k of model 0?

Every node gets a *signature*: its op, its target (the function, the method name,
or the module's class with its constructor hyper-parameters and the shapes,
dtypes and devices of its own parameters and buffers), and the constant part of
its arguments (``x.view(-1, 400)`` keeps ``-1`` and ``400``; each tensor argument
becomes a numbered slot).  Two models fuse when their graphs are isomorphic as
labelled DAGs: a bijection of nodes that keeps signatures and maps every
argument edge (producer -> consumer, slot number) onto an edge with the same slot.

Algorithm (:func:`match_graphs`):

1. Trace order, fast path: models built by the same code give their nodes in the
   same order.  Zip the node lists, compare signatures and argument slots
   (slot ``j`` of node ``k`` must point at the same position in both lists).
   Cost ``O(V + E)`` per model; this is what every same-class sweep hits.
2. Otherwise build a ``networkx.DiGraph`` per model (nodes labelled with their
   signature, edges with their slots) and ask VF2
   (``networkx.algorithms.isomorphism.DiGraphMatcher``) for an isomorphism.
   Models written by different code (another attribute order, branches computed
   in another order) land here.  VF2 is exponential in the worst case, but with
   every node labelled by op and target and every edge by slot the candidate
   pairs are few and the search stays close to linear on real networks.
3. If neither finds a mapping, the models differ: the nodes whose signatures
   differ at the same trace position are reported in words, each differing
   attribute as model i's value vs model 0's (``model 2's `conv` (nn.Conv2d) differs
   from model 0's: kernel_size (5, 5) vs (3, 3)``), with what to change, as a
   :class:`~hftc.errors.MismatchError` (:func:`describe_differences`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .errors import MismatchError
from .frontends.same_program import attribute_differences
from .ir import DIFFERING_OPS, EXAMPLE_VALUE, PER_MODEL, ArgKey, user_line
from .lowering.runtime import differing_ops as rt_differing_ops
from .lowering.runtime.guards import INPUT_GUARDS

if TYPE_CHECKING:  # networkx: imported where two graphs need VF2, not by import hftc
    import networkx as nx

#: Stand-in for a tensor argument inside a node's constant-argument skeleton.
_SLOT = "<tensor>"
#: Stand-in for a scalar hyper-parameter that may differ per model.
_PER_MODEL = "<per-model scalar>"

@dataclass(frozen=True)
class PerModelTable:
    """Which hyper-parameters may differ between the models: the node still fuses, and its
    rule receives one value per model (HFTA and Hydro force these to be equal).

    The rules declare them (``@rule(..., per_model=...)``); :func:`hftc.passes.registry.
    per_model_table` builds this table from the rule table and the callers of
    :func:`match_graphs` pass it in.  The empty table (:data:`STRICT`) lets nothing differ.
    """

    #: ``(module class, attribute names)``: for every module that is an instance of the class.
    modules: tuple[tuple[type, tuple[str, ...]], ...] = ()
    #: ``{function: {position: keyword}}``
    arguments: Mapping[Any, Mapping[int, str]] = dataclasses.field(default_factory=dict)
    #: ``{function: defaults}``: the defaults of the positional arguments up to the last
    #: per-model one, for functions torch records without trailing defaults:
    #: ``F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)`` arrives as ``(q, k, v)``,
    #: with ``dropout_p=0.1`` as ``(q, k, v, None, 0.1)``; both are read as ``(q, k, v,
    #: None, <per-model>)``.  (torch.export's graphs leave an argument at its default out:
    #: ``LeakyReLU(0.01)`` against ``LeakyReLU(0.02)`` was ``(x,)`` against ``(x, 0.02)``.)
    defaults: Mapping[Any, tuple] = dataclasses.field(default_factory=dict)
    #: ``(node, root) -> op or None``: the elementwise op a node computes where that op may
    #: differ per model (:func:`hftc.passes.differing_ops.elementwise_op`); such nodes match
    #: any node of the same kind (module, function or method) that computes one too.
    elementwise_op: Callable[[fx.Node, nn.Module], Any] | None = None

    def argument_positions(self, target: Any) -> Mapping[int, str]:
        """``{position: keyword}`` of a function's per-model arguments (by the function,
        or by its :func:`function_name` for a library's functions hftc does not import)."""
        return self.arguments.get(target) or self.arguments.get(function_name(target), {})

    def argument_defaults(self, target: Any) -> tuple | None:
        found = self.defaults.get(target)
        return found if found is not None else self.defaults.get(function_name(target))

    def module_attributes(self, module: nn.Module) -> tuple[str, ...]:
        """The module's attributes that may differ per model (of every class it is an
        instance of, so the table's order does not matter)."""
        names = [name for cls, names in self.modules if isinstance(module, cls) for name in names]
        return tuple(dict.fromkeys(names))


#: Nothing may differ between the models.
STRICT = PerModelTable()


def function_name(target: Any) -> str | None:
    """``"torchvision.ops.stochastic_depth.stochastic_depth"``: a Python function's module
    and qualified name, by which the rule table knows the functions of libraries hftc does
    not import (``torch.fx.wrap``-ped leaves); None for anything else (a method name, a
    builtin, an ``OpOverload``)."""
    if not isinstance(target, types.FunctionType):
        return None
    return f"{target.__module__}.{target.__qualname__}"

#: Comparisons, whose float threshold may differ between models (a bool result).
COMPARISONS = (operator.gt, operator.ge, operator.lt, operator.le, torch.gt, torch.ge,
               torch.lt, torch.le, "gt", "ge", "lt", "le", "__gt__", "__ge__", "__lt__",
               "__le__")

#: Arithmetic whose float constants may differ between models (a per-model scale).
SCALAR_ARITHMETIC = {
    operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub,
    torch.mul, torch.div, "add", "sub", "mul", "div", "__mul__", "__rmul__", "__add__",
    "__radd__", "__sub__", "__rsub__", "__truediv__", "__rtruediv__",
    # in place: timm's drop_path scales its mask by ``random_tensor.div_(keep_prob)``
    "add_", "sub_", "mul_", "div_",
    # a per-model exponent (timm's GeM pooling: ``x.clamp(min=eps).pow(self.p)``)
    torch.pow, "pow", operator.pow, "__pow__",
    # an EMA at a per-model decay: ``self.shadow.lerp_(x, 1 - self.decay)``
    torch.lerp, "lerp", "lerp_",
    # a per-model threshold: ``h * (h > self.threshold)``
    *COMPARISONS,
}

#: Ops whose float arguments given by keyword may differ between models too: bounds
#: (``torch.clamp(x, min=self.lo, max=self.hi)``), an interpolation weight, the scale of an
#: added operand (``self.shadow.mul_(d).add_(x, alpha=1 - d)``), attention's keyword-only
#: softmax scale (its rule runs a per-model one model by model).
SCALAR_KEYWORDS = {torch.clamp: ("min", "max"), torch.clip: ("min", "max"),
                   "clamp": ("min", "max"), "clip": ("min", "max"),
                   torch.clamp_min: ("min",), torch.clamp_max: ("max",),
                   "clamp_min": ("min",), "clamp_max": ("max",),
                   torch.lerp: ("weight",), "lerp": ("weight",), "lerp_": ("weight",),
                   # the operand by keyword: torch.mul(x, other=self.scale) as x * self.scale
                   **{op: ("other",) for op in (torch.mul, torch.div, "mul", "div", "mul_",
                                                "div_")},
                   **{op: ("other", "alpha") for op in (torch.add, torch.sub, "add", "sub",
                                                         "add_", "sub_")},
                   torch.pow: ("exponent",), "pow": ("exponent",), "pow_": ("exponent",),
                   F.scaled_dot_product_attention: ("scale",)}


def canonical_args(node: fx.Node, soft: PerModelTable) -> tuple:
    """``node.args`` with the trailing defaults of ``soft.defaults`` filled in up to the
    per-model-able position, where it is not given by keyword."""
    args = tuple(node.args)
    defaults = soft.argument_defaults(node.target) if node.op == "call_function" else None
    if defaults is None:
        return args
    positions = soft.argument_positions(node.target)
    last = max(positions)
    if len(args) > last or positions[last] in node.kwargs:
        return args
    first = last + 1 - len(defaults)
    return args + defaults[len(args) - first:] if len(args) >= first else args


def _soft_argument_keys(node: fx.Node, soft: PerModelTable) -> dict[ArgKey, Any]:
    """``{ArgKey(position=1): value, ArgKey(keyword="p"): value}`` for the node's
    per-model-able scalars."""
    found: dict[ArgKey, Any] = {}
    if node.op not in ("call_function", "call_method"):
        return found
    positions = soft.argument_positions(node.target)
    args = canonical_args(node, soft)
    for pos, name in positions.items():
        if pos < len(args) and isinstance(args[pos], (int, float)):
            found[ArgKey(position=pos)] = args[pos]
        elif isinstance(node.kwargs.get(name), (int, float)):
            found[ArgKey(keyword=name)] = node.kwargs[name]
    scalar_op = node.target in SCALAR_ARITHMETIC or node.target in SCALAR_KEYWORDS
    if scalar_op and any(isinstance(a, fx.Node) for a in node.args):
        for pos, a in enumerate(node.args):
            if isinstance(a, float):
                found[ArgKey(position=pos)] = a
        for name in SCALAR_KEYWORDS.get(node.target, ()):
            if isinstance(node.kwargs.get(name), float):
                found[ArgKey(keyword=name)] = node.kwargs[name]
    return found


def per_model_values(node: fx.Node, root: nn.Module,
                     soft: PerModelTable) -> dict[str | ArgKey, Any]:
    """The node's hyper-parameters that are allowed to differ between models, by key.

    Keys: a module attribute name (``"p"``, ``"eps"``) or an argument (:class:`ArgKey`).
    """
    values: dict[str | ArgKey, Any] = dict(_soft_argument_keys(node, soft))
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        for name in soft.module_attributes(module):
            values[name] = getattr(module, name)
    return values


@dataclass(frozen=True)
class ArgSkeleton:
    """The constant part of a node's arguments; graph inputs become :data:`_SLOT`."""

    args: Any
    kwargs: Any


def _simple(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_simple(v) for v in value)
    return False


@dataclass(frozen=True)
class TensorSignature:
    """What must agree about a parameter, buffer or tensor attribute across the models."""

    kind: str  # "parameter" or "tensor" (a buffer, a plain tensor attribute)
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool

    def __str__(self) -> str:
        grad = "" if self.requires_grad == (self.kind == "parameter") else (
            ", requires_grad=" + str(self.requires_grad))
        return f"a {dtype_name(self.dtype)} {self.kind} of shape {self.shape}{grad}"


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: how messages name a dtype."""
    return str(dtype).removeprefix("torch.")


def tensor_signature(t: torch.Tensor) -> TensorSignature:
    """A parameter's or buffer's :class:`TensorSignature` (what fusing compares)."""
    kind = "parameter" if isinstance(t, nn.Parameter) else "tensor"
    return TensorSignature(kind, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)


def module_hyperparameters(module: nn.Module, soft: PerModelTable) -> dict[str, Any]:
    """The constructor hyper-parameters of a module, as a user would compare them.

    Public, simple-valued attributes (``in_channels``, ``kernel_size``,
    ``padding_mode`` ...).  Private attributes are derived from public ones and
    left out, and so are the scalars that may differ per model (``p``, ``eps``).
    """
    differing = soft.module_attributes(module)
    init_only = _INIT_ONLY.get(type(module), ())
    params = {
        k: _python_scalars(v) for k, v in vars(module).items()
        if not k.startswith("_") and k != "training" and k not in differing
        and k not in init_only
    }
    return {k: v for k, v in sorted(params.items()) if _simple(v)}


#: torch.nn attributes that only ``__init__`` / ``reset_parameters`` read: models that
#: differ in one (a sweep over ``nn.PReLU(init=a)``) differ only in their weights' values.
_INIT_ONLY: dict[type, tuple[str, ...]] = {nn.PReLU: ("init",)}


def _python_scalars(value: Any) -> Any:
    """NumPy scalars (``np.float32(0.1)``, ``np.int64(2)``: a sweep's ``np.linspace``
    grid) as the Python numbers they are, in tuples and lists too: ``_simple`` took them
    for objects and left them out of the signature, so models that differed in one
    were fused with model 0's value."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (tuple, list)):
        return type(value)(_python_scalars(v) for v in value)
    return value


def module_signature(module: nn.Module, soft: PerModelTable) -> dict[str, Any]:
    sig: dict[str, Any] = {"class": type(module).__qualname__}
    sig.update(module_hyperparameters(module, soft))
    for name, p in module.named_parameters(recurse=False):
        sig[f"parameter `{name}`"] = tensor_signature(p)
    for name, b in module.named_buffers(recurse=False):
        sig[f"buffer `{name}`"] = tensor_signature(b)
    # Not "mode": a module's own hyper-parameter of that name (Upsample's, EmbeddingBag's)
    # was overwritten, and models differing in it were fused with model 0's.
    sig["train/eval mode"] = "train" if module.training else "eval"
    if parametrize.is_parametrized(module):
        sig.update(_parametrizations_signature(module, soft))
    return sig


def _parametrizations_signature(module: nn.Module, soft: PerModelTable) -> dict[str, Any]:
    """A parametrized module's parametrizations (``weight_norm``, ``spectral_norm``, a
    user's ``Clamp(c)``), which run per model as model 0's code: each one's own
    :func:`module_signature`, so that models whose differ are refused, not run with model
    0's (spectral norm's ``n_power_iterations``, a clamp's bound, weight norm's ``dim``)."""
    return {f"parametrization `{path}` {key}" if path else f"parametrizations {key}": value
            for path, sub in module.parametrizations.named_modules()
            for key, value in module_signature(sub, soft).items()}


def target_name(node: fx.Node) -> str:
    """A readable name for what a node calls (``torch.nn.functional.relu``, ``.view``)."""
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        for prefix, namespace in (("torch.nn.functional", torch.nn.functional), ("torch", torch)):
            if name and getattr(namespace, name, None) is node.target:
                return f"{prefix}.{name}"
        return fx.node._get_qualified_name(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return str(node.target)


def module_path(node: fx.Node) -> str:
    """Where a node lives in the user's code: the module path (``layer3.1.conv2``)."""
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(next(reversed(stack.values()))[0]) or "<root>"
    return "<root>"


#: A custom ``torch.autograd.Function``'s node (:func:`hftc.ir.apply_function`, bound per class).
_FUNCTION_APPLY = "hftc.ir.apply_function__"
#: ``torch.fft.rfft`` and its kin, as torch names them (``torch._C._fft.fft_rfft``).
_NAMESPACED = re.compile(r"^torch\._C\._(fft|linalg|special)\.\1_(\w+)$")


def public_name(op: str) -> str:
    """A target's name as the user's code spells it where torch or hftc name it otherwise:
    ``hftc.ir.apply_function__ReverseGradient`` -> ``ReverseGradient.apply``;
    ``torch._C._fft.fft_rfft`` -> ``torch.fft.rfft``; anything else as it is."""
    if op.startswith(_FUNCTION_APPLY):
        return op[len(_FUNCTION_APPLY):] + ".apply"
    namespaced = _NAMESPACED.match(op)
    if namespaced:
        return f"torch.{namespaced.group(1)}.{namespaced.group(2)}"
    return op


def describe_node(node: fx.Node, root: nn.Module | None = None) -> str:
    """``node `conv1` (module path `conv1`, Conv2d)``: how errors name a node."""
    what = public_name(target_name(node))
    if node.op == "call_module" and root is not None:
        what = type(root.get_submodule(node.target)).__name__
    return f"node `{node.name}` (module path `{module_path(node)}`, {what})"


def _fold_constant(value: Any) -> Any:
    # NaN != NaN would make two identical graphs differ.
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


#: The signature key of a node whose elementwise op may differ per model.
ELEMENTWISE = "elementwise op"


def node_signature(node: fx.Node, root: nn.Module,
                   soft: PerModelTable) -> dict[str, Any]:
    """Everything about a node that must agree across models, as ``{attribute: value}``
    (``soft``: the hyper-parameters that may differ, left out)."""
    sig: dict[str, Any] = {"op": node.op}
    if soft.elementwise_op is not None and soft.elementwise_op(node, root) is not None:
        # which elementwise op (ReLU, GELU, dropout or none) may differ per model
        sig[ELEMENTWISE] = "an elementwise op"
        if node.op == "call_module":
            sig["train/eval mode"] = "train" if root.get_submodule(node.target).training \
                else "eval"
        sig["arguments"] = f"({_SLOT},)"
        return sig
    if node.op == "call_module":
        sig.update(module_signature(root.get_submodule(node.target), soft))
    elif node.op == "get_attr":
        value = _get_attr(root, node.target)
        if isinstance(value, torch.Tensor):
            sig["attribute"] = tensor_signature(value)
        elif isinstance(value, nn.Module):
            sig["attribute"] = module_signature(value, soft)
        else:
            sig["attribute"] = repr(value)
    elif node.op in ("call_function", "call_method"):
        sig["target"] = target_name(node)
    if node.op != "placeholder":  # input names differ between codebases; order is what counts
        sig["arguments"] = repr(_argument_skeleton(node, soft))
    return sig


def _argument_skeleton(node: fx.Node, soft: PerModelTable,
                       stand_ins: bool = True) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``node`` with each tensor argument :data:`_SLOT` and (with
    ``stand_ins``) each scalar that may differ per model :data:`_PER_MODEL`."""
    args, kwargs = list(canonical_args(node, soft)), dict(node.kwargs)
    for key in _soft_argument_keys(node, soft) if stand_ins else ():
        if key.keyword is None:
            args[key.position] = _PER_MODEL
        else:
            kwargs[key.keyword] = _PER_MODEL
    return fx.node.map_aggregate(
        (tuple(args), kwargs),
        lambda a: _SLOT if isinstance(a, fx.Node) else _fold_constant(a),
    )


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def argument_nodes(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued arguments of ``node`` in a fixed order (slot 0, 1, ...)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return found


@dataclass
class GraphMatch:
    """For each model i, ``mapping[i][node_of_model_0] -> node_of_model_i``."""

    mapping: list[dict[fx.Node, fx.Node]]
    method: str  # "trace order" or "vf2"


def _try_trace_order(
    nodes0: list[fx.Node], sigs0: list[dict], nodes: list[fx.Node], sigs: list[dict]
) -> dict[fx.Node, fx.Node] | None:
    if len(nodes0) != len(nodes):
        return None
    pos0 = {n: k for k, n in enumerate(nodes0)}
    pos = {n: k for k, n in enumerate(nodes)}
    for a, b, sa, sb in zip(nodes0, nodes, sigs0, sigs):
        if sa != sb:
            return None
        if [pos0[x] for x in argument_nodes(a)] != [pos[x] for x in argument_nodes(b)]:
            return None
    return dict(zip(nodes0, nodes))


def _align_skipping_elementwise(sigs0: list[dict], sigs: list[dict]) -> tuple[
        dict[int, int], list[int], list[int]] | None:
    """Trace-order alignment of two models' nodes where one runs an elementwise op the
    other skips (timm / torchvision: ``if self.drop_rate > 0: x = F.dropout(x, ...)`` with
    a per-model rate): ``(position in 0 -> position in i, model 0's skipped positions,
    model i's)``, or None where the lists differ otherwise (or not at all)."""
    def run_before(own: list[dict], start: int, wanted: dict) -> int:
        """How many elementwise functions from ``start`` on come before a node like
        ``wanted`` (functions only: the identity put for them is one, and a skipped module
        or method would differ from it in kind)."""
        end = start
        while end < len(own) and ELEMENTWISE in own[end] and own[end]["op"] == "call_function":
            end += 1
            if end < len(own) and own[end] == wanted:
                return end - start
        return 0

    pairs: dict[int, int] = {}
    skipped: tuple[list[int], list[int]] = ([], [])
    k = j = 0
    while k < len(sigs0) and j < len(sigs):
        if sigs0[k] == sigs[j]:
            pairs[k] = j
            k, j = k + 1, j + 1
        elif run := run_before(sigs0, k, sigs[j]):
            skipped[0].extend(range(k, k + run))
            k += run
        elif run := run_before(sigs, j, sigs0[k]):
            skipped[1].extend(range(j, j + run))
            j += run
        else:
            return None
    if k != len(sigs0) or j != len(sigs) or not (skipped[0] or skipped[1]):
        return None
    return pairs, *skipped


#: Where to put one identity: after which node, its input, the users to rewire (with
#: their flat argument positions), and the op the other model runs there.
_IdentityPlan = tuple[int, fx.Node, list[tuple[fx.Node, list[int]]], fx.Node]


def _identities_for_skipped(nodes: list[fx.Node], skipped: list[int], other: list[fx.Node],
                            pairs: dict[int, int]) -> list[_IdentityPlan] | None:
    """Where ``other`` lacks the elementwise ops at ``skipped`` of ``nodes`` (``pairs``:
    position in ``nodes`` -> position in ``other``), the identity calls that make them
    the same program: ``(position in other to insert after, the input in other, [(user in
    other, its flat argument positions that read the input)], the skipped op)``; None
    where a user does not read the input the skipped op reads."""
    position = {n: k for k, n in enumerate(nodes)}
    skipped_set = set(skipped)

    def origin(node: fx.Node) -> fx.Node | None:  # a skipped op's input, in other
        while position.get(node) in skipped_set:
            node = node.args[0] if node.args else node.kwargs.get("input")
            if not isinstance(node, fx.Node):
                return None
        k = position.get(node)
        return other[pairs[k]] if k in pairs else None

    plans = []
    for k in skipped:
        node, source = nodes[k], origin(nodes[k])
        if source is None or not node.users:
            return None
        before = max((pairs[p] for p in range(k) if p in pairs), default=-1)
        if before < 0:
            return None
        rewired = []
        for user in node.users:
            if position[user] in skipped_set:
                continue  # a skipped op after this one: its identity reads this one's
            counterpart = other[pairs[position[user]]]
            leaves, leaves_other = (fx.node.map_aggregate((u.args, u.kwargs), lambda a: a)
                                    for u in (user, counterpart))
            flat = torch.utils._pytree.tree_leaves(leaves)
            flat_other = torch.utils._pytree.tree_leaves(leaves_other)
            slots = [s for s, a in enumerate(flat) if a is node]
            if len(flat) != len(flat_other) or any(flat_other[s] is not source for s in slots):
                return None
            rewired.append((counterpart, slots))
        plans.append((before, source, rewired, node))
    return plans


def _insert_identities(graph: fx.GraphModule, nodes: list[fx.Node],
                       plans: list[_IdentityPlan]) -> None:
    """Put an identity call where :func:`_identities_for_skipped` planned (in order: a
    later plan's input may be an earlier plan's identity)."""
    made: dict[fx.Node, fx.Node] = {}  # the input (origin) -> its latest identity
    previous: tuple[int, fx.Node | None] = (-1, None)
    for before, source, rewired, skipped in plans:
        # after the node before the skipped op, or after the identity put there already
        anchor = previous[1] if before == previous[0] else nodes[before]
        with graph.graph.inserting_after(anchor):
            new = graph.graph.call_function(rt_differing_ops.identity,
                                            (made.get(source, source),))
        # where the skipped op is (for the report), and its input's value (the same)
        new.meta = {k: v for k, v in skipped.meta.items()
                    if k in ("stack_trace", "nn_module_stack")}
        if EXAMPLE_VALUE in source.meta:
            new.meta[EXAMPLE_VALUE] = source.meta[EXAMPLE_VALUE]
        for user, slots in rewired:
            flat, spec = torch.utils._pytree.tree_flatten(
                fx.node.map_aggregate((user.args, user.kwargs), lambda a: a))
            for s in slots:
                flat[s] = new
            user.args, user.kwargs = torch.utils._pytree.tree_unflatten(flat, spec)
        made[source], previous = new, (before, new)
    graph.recompile()


def _insert_skipped_ops(graphs: Sequence[fx.GraphModule], node_lists: list[list[fx.Node]],
                        sigs: list[list[dict]], i: int) -> set[int]:
    """Models 0 and i that are one program except for elementwise ops one of them skips:
    an identity where it skips each (:func:`~hftc.lowering.runtime.differing_ops.identity`),
    which the matcher then reads as a differing op (dropout in one model, nothing in the
    other).  Returns the models whose graphs it changed (0, i, or none)."""
    aligned = _align_skipping_elementwise(sigs[0], sigs[i])
    if aligned is None:
        return set()
    pairs, skipped0, skipped_i = aligned
    back = {j: k for k, j in pairs.items()}
    plans = (_identities_for_skipped(node_lists[i], skipped_i, node_lists[0], back),
             _identities_for_skipped(node_lists[0], skipped0, node_lists[i], pairs))
    if None in plans:
        return set()
    changed = set()
    for k, plan in zip((0, i), plans):
        if plan:
            _insert_identities(graphs[k], node_lists[k], plan)
            changed.add(k)
    return changed


def _to_networkx(nodes: list[fx.Node], sigs: list[dict]) -> nx.DiGraph:
    import networkx as nx

    g = nx.DiGraph()
    for n, s in zip(nodes, sigs):
        g.add_node(n, sig=s)
    for n in nodes:
        for slot, a in enumerate(argument_nodes(n)):
            if g.has_edge(a, n):
                g[a][n]["slots"] = g[a][n]["slots"] + (slot,)
            else:
                g.add_edge(a, n, slots=(slot,))
    return g


def _vf2(g0: nx.DiGraph, gi: nx.DiGraph) -> dict[fx.Node, fx.Node] | None:
    import networkx as nx

    matcher = nx.algorithms.isomorphism.DiGraphMatcher(
        g0,
        gi,
        node_match=lambda a, b: a["sig"] == b["sig"],
        edge_match=lambda a, b: a["slots"] == b["slots"],
    )
    if matcher.is_isomorphic():
        return dict(matcher.mapping)
    return None


#: What to change, for each kind of difference between two models' signatures.
_FIXES = {
    "dtype": "Convert every model to one dtype with .to(dtype) before fusing "
             "(model.float(), model.double()).",
    "device": "Move every model to one device with .to(device) before fusing.",
    "requires_grad": "Freeze the same parameters in every model "
                     "(p.requires_grad_(False) in each, or in none).",
    "mode": "Put every model in the same mode (.train() or .eval() on each) before fusing.",
    "widths": "Models that differ only in layer widths fuse with hftc.fuse(models, "
              "pad_widths=True) (each zero-padded to the widest, exactly), or apart by "
              "width with hftc.fuse_groups(models, pad_widths=True).",
    "structure": "hftc fuses models of the same architecture and hyper-parameters: "
                 "hftc.fuse_groups splits a mixed list into groups that can be fused.",
}

#: Module attributes that are a layer's width: models that differ only in these (and in
#: their tensors' sizes) may fuse padded (``pad_widths=True``).
_WIDTH_ATTRIBUTES = frozenset({
    "in_features", "out_features", "in_channels", "out_channels", "num_features",
    "num_channels", "hidden_size", "input_size", "embed_dim", "embedding_dim", "kdim",
    "vdim", "normalized_shape", "proj_size", "d_model", "dim_feedforward"})


def class_name(module: nn.Module) -> str:
    """``nn.Conv2d`` for torch's own modules, the class name for a user's."""
    cls = type(module)
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__qualname__


def _value_text(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, str):
        return value
    return repr(value)


def _tensor_differences(label: str, value: Any, reference: Any) -> tuple[list[str], set[str]]:
    """A parameter's or buffer's signature against model 0's, field by field."""
    if not isinstance(value, TensorSignature) or not isinstance(reference, TensorSignature):
        mine = "none" if value == _ABSENT else str(value)
        theirs = "none" if reference == _ABSENT else str(reference)
        return [f"{label}: {mine} vs {theirs}"], {"structure"}
    texts, kinds = [], set()
    if value.kind != reference.kind:
        texts.append(f"{label}: a {value.kind} vs a {reference.kind}")
        kinds.add("structure")
    for field, kind in (("shape", "widths"), ("dtype", "dtype"), ("device", "device"),
                        ("requires_grad", "requires_grad")):
        mine, theirs = getattr(value, field), getattr(reference, field)
        if mine != theirs:
            texts.append(f"{label}: {field} {_value_text(mine)} vs {_value_text(theirs)}")
            if kind == "widths" and len(mine) != len(theirs):
                kind = "structure"  # another rank is no width
            kinds.add(kind)
    return texts, kinds


def _argument_differences(node: fx.Node, reference: fx.Node, soft: PerModelTable) -> list[str]:
    """``argument 1: 0 vs 1`` / ``argument `dim`: 0 vs 1``: the constant arguments of a call
    that differ from model 0's (``<tensor>`` stands for a tensor argument)."""
    (args, kwargs), (args0, kwargs0) = (_argument_skeleton(node, soft),
                                        _argument_skeleton(reference, soft))
    # Compared as skeletons; shown as the values ``x / 2.5`` and ``x / 1`` pass, not as the
    # skeleton's stand-in for a per-model scalar (``<per-model scalar> vs 1``).
    (shown, shown_kw), (shown0, shown0_kw) = (_argument_skeleton(node, soft, False),
                                              _argument_skeleton(reference, soft, False))
    texts = []
    if len(args) != len(args0):
        texts.append(f"{len(args)} positional arguments vs {len(args0)}")
    arithmetic = node.target in SCALAR_ARITHMETIC or node.target in SCALAR_KEYWORDS
    arithmetic = arithmetic and any(isinstance(a, fx.Node) for a in node.args)
    texts += [f"argument {k}: {_value_text(shown[k])} vs {_value_text(shown0[k])}"
              f"{_as_floats(shown[k], shown0[k], _PER_MODEL in (a, b) or arithmetic)}"
              for k, (a, b) in enumerate(zip(args, args0)) if a != b]
    floats_differ = SCALAR_KEYWORDS.get(node.target, ()) if arithmetic else ()
    for key in dict.fromkeys([*kwargs, *kwargs0]):
        a, b = kwargs.get(key, _ABSENT), kwargs0.get(key, _ABSENT)
        if a != b:
            mine, theirs = shown_kw.get(key, _ABSENT), shown0_kw.get(key, _ABSENT)
            per_model = _PER_MODEL in (a, b) or key in floats_differ
            texts.append(f"argument `{key}`: {_value_text(mine)} vs {_value_text(theirs)}"
                         f"{_as_floats(mine, theirs, per_model)}")
    return texts


def _as_floats(a: Any, b: Any, per_model: bool) -> str:
    """The fix where models pass an int (``self.t = 1``) to an argument whose floats may
    differ per model (``per_model``: ``x / self.t``): floats in every model."""
    kinds = {type(v) for v in (a, b)}
    if per_model and kinds <= {int, float} and int in kinds:
        return (f" (a per-model number fuses as a float in every model: make them "
                f"{float(a)!r} and {float(b)!r})")
    return ""


#: A signature entry one model has and the other lacks.
_ABSENT = "<absent>"


def describe_differences(sig: dict[str, Any], reference: dict[str, Any], *,
                         prefix: str = "", nodes: tuple[fx.Node, fx.Node] | None = None,
                         soft: PerModelTable = STRICT) -> tuple[list[str], set[str]]:
    """Model i's signature ``sig`` against model 0's ``reference``, in words, and the kinds
    of difference (keys of :data:`_FIXES`): ``["kernel_size (5, 5) vs (3, 3)",
    "parameter `conv.weight`: shape (8, 3, 5, 5) vs (8, 3, 3, 3)"], {"structure"}``.

    ``prefix`` is the module path the signature's parameters live under (``conv.``);
    ``nodes`` the two nodes, whose constant arguments are compared one by one (less the
    hyper-parameters ``soft`` lets differ)."""
    texts: list[str] = []
    kinds: set[str] = set()
    for key in ("op", "class"):  # another kind of node: its attributes do not compare
        if sig.get(key, _ABSENT) != reference.get(key, _ABSENT):
            return [f"{key} {_value_text(sig.get(key, _ABSENT))} vs "
                    f"{_value_text(reference.get(key, _ABSENT))}"], {"structure"}
    for key in dict.fromkeys([*reference, *sig]):
        value, ref = sig.get(key, _ABSENT), reference.get(key, _ABSENT)
        if value == ref:
            continue
        if key == "arguments" and nodes is not None:
            texts += _argument_differences(*nodes, soft) or [f"arguments {value} vs {ref}"]
            kinds.add("structure")
            continue
        label = key
        for kind in ("parameter `", "buffer `"):
            if key.startswith(kind):
                label = f"{kind}{prefix}{key[len(kind):]}"
        if key == "attribute" and nodes is not None:
            tensor = value if isinstance(value, TensorSignature) else ref
            kind = tensor.kind if isinstance(tensor, TensorSignature) else "attribute"
            label = f"{kind} `{nodes[0].target}`"
        if isinstance(value, TensorSignature) or isinstance(ref, TensorSignature):
            found, found_kinds = _tensor_differences(label, value, ref)
        elif isinstance(value, dict) and isinstance(ref, dict):
            found, found_kinds = describe_differences(value, ref, prefix=prefix)
            found = [f"{label} {text}" for text in found]
        else:
            found = [f"{label} {_value_text(value)} vs {_value_text(ref)}"]
            found_kinds = {"mode" if key == "train/eval mode" else
                           "widths" if key in _WIDTH_ATTRIBUTES else "structure"}
        texts += found
        kinds |= found_kinds
    return texts, kinds


def fixes_for(kinds: set[str]) -> str:
    """What to change for these kinds of difference (keys of :data:`_FIXES`), in sentences
    (padding widths only where widths are all that differs in structure)."""
    if "structure" in kinds:
        kinds = kinds - {"widths"}
    return " ".join(fix for kind, fix in _FIXES.items() if kind in kinds)


#: How :func:`_where` begins for a tensor of the root module itself (a bare ``nn.Conv2d``).
_ITSELF = "(the model itself"


def _where(node: fx.Node, graph: fx.GraphModule, model: nn.Module | None) -> tuple[str, str]:
    """How a mismatch names a node of one model (``"`features.0` (nn.Conv2d)"``, ``"node
    `relu` (torch.relu in `block`)"``, ``"(the model itself, nn.Conv2d)"`` for a tensor of
    the root module), and the module path its parameters' names start with."""
    if node.op == "call_module":
        return f"`{node.target}` ({class_name(graph.get_submodule(node.target))})", \
            f"{node.target}."
    if node.op == "get_attr":
        owner_path = str(node.target).rpartition(".")[0]
        owner = _owner(model if model is not None else graph, owner_path)
        if not owner_path:
            return f"{_ITSELF}" + ("" if owner is None else f", {class_name(owner)}") + ")", ""
        return f"`{owner_path}`" + ("" if owner is None else f" ({class_name(owner)})"), ""
    if node.op == "placeholder":
        return f"input `{node.target}`", ""
    if node.op == "output":
        return "output", ""
    path = module_path(node)
    inside = "the model's own forward" if path == "<root>" else f"`{path}`"
    return f"node `{node.name}` ({public_name(target_name(node))} in {inside})", ""


def _owner(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _owner_hyperparameters(node: fx.Node, model: nn.Module | None,
                           soft: PerModelTable) -> dict[str, Any]:
    """For a parameter a graph reads directly (a bare ``nn.Conv2d`` traced as the whole
    model: ``get_attr weight``), its torch module's hyper-parameters (``kernel_size``),
    which say what differs better than the weight's shape does."""
    if node.op != "get_attr" or model is None:
        return {}
    owner = _owner(model, str(node.target).rpartition(".")[0])
    if owner is None or not type(owner).__module__.startswith("torch.nn"):
        return {}
    return {"class": type(owner).__qualname__, **module_hyperparameters(owner, soft)}


def _whose(indices: list[int], where: str) -> str:
    """``model 2's `fc` (nn.Linear)``; ``models 1 and 2 (the model itself, nn.Conv2d)``."""
    models = (f"model {indices[0]}" if len(indices) == 1 else
              f"models {', '.join(map(str, indices[:-1]))} and {indices[-1]}")
    return f"{models} {where}" if where.startswith(_ITSELF) else f"{models}'s {where}"


def _explain_mismatch(
    graphs: Sequence[fx.GraphModule], models: Sequence[nn.Module], sigs: list[list[dict]],
    failed: list[int], soft: PerModelTable,
) -> tuple[str, set[str]]:
    """Compare each failed model's graph with model 0's position by position, and say in
    words how each differing node differs (model i's value vs model 0's) and at which line
    of the user's code; returns the lines and the kinds of difference (:data:`_FIXES`).

    hftc's own input guards (the export front-end's ``check_input_shape`` after each input)
    are passed over: they come first and differ where the models' code does (a size one
    model's code fixes), so the first difference was a guard, named for an argument of it
    the user never wrote.  They are compared only where nothing else differs."""
    nodes = [list(g.graph.nodes) for g in graphs]
    model_at = (lambda i: models[i]) if len(models) == len(graphs) else (lambda i: None)
    found: dict[tuple[str, str], list[int]] = {}  # (where, what differs) -> the models
    kinds: set[str] = set()
    for i in failed:
        if len(nodes[i]) != len(nodes[0]):
            found.setdefault((f"graph has {len(nodes[i])} nodes, model 0's {len(nodes[0])} "
                              f"(an extra or missing layer)", ""), []).append(i)
            kinds.add("structure")
        for skip_guards in (True, False):
            per_place = _differing_nodes(graphs, (model_at(i), model_at(0)), sigs, nodes,
                                         i, soft, kinds, skip_guards)
            if per_place:
                break
        for place, texts in per_place.items():
            found.setdefault((place, "; ".join(texts)), []).append(i)
    lines = []
    for (place, texts), indices in found.items():
        where, _, than = place.partition("\0")
        than, _, source = than.partition("\0")
        if len(indices) > 1:  # "models 1 and 2's `fc` differ"
            than = than.replace("differs", "differ", 1)
        lines.append(f"  {_whose(indices, where)}" + (f" {than}: {texts}" if texts else "")
                     + source)
    if len(lines) > 30:
        lines = lines[:30] + ["  ... (more differences follow)"]
    if not lines:
        lines.append("  the nodes agree one by one, but their argument edges differ "
                     "(the same layers, connected in another order)")
        kinds.add("structure")
    if len(models) == len(graphs):
        lines += _state_lines(models, failed)
    return "\n".join(lines), kinds


def _state_lines(models: Sequence[nn.Module], failed: list[int]) -> list[str]:
    """Where each failed model's Python state (a config, a dict, an attribute forward
    reads) differs from model 0's, by attribute path: what made its code differ."""
    lines = []
    for i in failed[:5]:
        paths = attribute_differences(models[0], models[i])
        if paths:
            lines.append(f"  model {i}'s Python state differs from model 0's at "
                         f"{', '.join(paths)}")
    return lines


def _is_guard(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in INPUT_GUARDS


def _differing_nodes(
    graphs: Sequence[fx.GraphModule], owners: tuple[nn.Module | None, nn.Module | None],
    sigs: list[list[dict]], nodes: list[list[fx.Node]], i: int, soft: PerModelTable,
    kinds: set[str], skip_guards: bool,
) -> dict[str, list[str]]:
    """Model i's nodes that differ from model 0's at the same position (less the input
    guards with ``skip_guards``): the place (where, what it differs from and the user's
    lines, NUL-separated) -> the differences in words; ``kinds`` gets their kinds.
    ``owners``: models i and 0 (None where the graphs are not the models')."""
    positions = [[k for k, n in enumerate(nodes[m]) if not (skip_guards and _is_guard(n))]
                 for m in (i, 0)]
    shifted = len(positions[0]) != len(positions[1])
    per_place: dict[str, list[str]] = {}
    for k, k0 in zip(*positions):
        node, node0 = nodes[i][k], nodes[0][k0]
        if sigs[i][k] == sigs[0][k0]:
            continue
        where, prefix = _where(node, graphs[i], owners[0])
        where0, _ = _where(node0, graphs[0], owners[1])
        sig, sig0 = sigs[i][k], sigs[0][k0]
        elementwise = (ELEMENTWISE in sig) + (ELEMENTWISE in sig0)
        if elementwise:  # what the two nodes are, not that one may differ per model
            plain = dataclasses.replace(soft, elementwise_op=None)
            sig = node_signature(node, graphs[i], plain)
            sig0 = node_signature(node0, graphs[0], plain)
        texts, node_kinds = describe_differences(
            {**_owner_hyperparameters(node, owners[0], soft), **sig},
            {**_owner_hyperparameters(node0, owners[1], soft), **sig0},
            prefix=prefix, nodes=(node, node0), soft=soft)
        if elementwise and not shifted:  # (shifted: a missing layer)
            texts.append("only an elementwise op (an activation such as ReLU, GELU, SiLU, "
                         "Tanh or LeakyReLU, dropout, nn.Identity) may differ per model, "
                         "called the same way (a module, a function or a method) in every "
                         "model")
        kinds |= node_kinds
        than = "model 0" if where.startswith(_ITSELF) else "model 0's"
        if where != where0:
            than = f"model 0's {where0}"
        place = f"{where}\0differs from {than}\0{_source_lines(node, node0)}"
        texts_here = per_place.setdefault(place, [])
        texts_here += [t for t in texts if t not in texts_here]
        if len(per_place) > 30 or shifted:
            break  # (past a missing layer, every position is shifted)
    return per_place


def _source_lines(node: fx.Node, node0: fx.Node) -> str:
    """The user's lines two differing ops come from, for the message (one where they are
    the same line: ``x = x.mean(dim=1) if self.pool == 'mean' else x[:, 0]``).  Not for a
    module, a parameter or an input, which their paths and names say already, unless
    the other is forward's output (``if cfg.use_norm: h = self.norm(h)`` in one model:
    its return line and the norm's)."""
    if not {"call_function", "call_method", "output"} & {node.op, node0.op}:
        return ""
    line, line0 = user_line(node), user_line(node0)
    if not line and not line0:
        return ""
    if line == line0:
        return f"\n      at {line}"
    return (f"\n      at {line or 'a line not known'}"
            f"\n      model 0's at {line0 or 'a line not known'}")


def match_graphs(graphs: Sequence[fx.GraphModule], models: Sequence[nn.Module], *,
                 soft: PerModelTable) -> GraphMatch:
    """Map every node of model 0's graph onto its counterpart in each model's graph.

    ``graphs[i]`` is model i traced (its ``GraphModule`` is the root its call_module
    and get_attr targets resolve against); ``soft`` says which hyper-parameters may
    differ (the rules' declarations).  Raises :class:`MismatchError` listing every
    difference when some model is not isomorphic to model 0.
    """
    node_lists = [list(g.graph.nodes) for g in graphs]
    sigs = [[node_signature(n, g, soft) for n in nodes] for g, nodes in zip(graphs, node_lists)]
    mapping: list[dict[fx.Node, fx.Node]] = [{n: n for n in node_lists[0]}]
    method = "trace order"
    failed: list[int] = []
    g0_nx: nx.DiGraph | None = None
    insertions = sum(map(len, node_lists))  # (each adds a node: bounded)
    i = 1
    while i < len(graphs):
        found = _try_trace_order(node_lists[0], sigs[0], node_lists[i], sigs[i])
        if found is None:
            if g0_nx is None:
                g0_nx = _to_networkx(node_lists[0], sigs[0])
            found = _vf2(g0_nx, _to_networkx(node_lists[i], sigs[i]))
            method = "vf2" if found is not None else method
        changed = _insert_skipped_ops(graphs, node_lists, sigs, i) \
            if found is None and insertions > 0 and soft.elementwise_op is not None else set()
        if changed:
            insertions -= 1
            for k, g in enumerate(graphs):  # (a graph object two models share changed too)
                if any(g is graphs[c] for c in changed):
                    node_lists[k] = list(g.graph.nodes)
                    sigs[k] = [node_signature(n, g, soft) for n in node_lists[k]]
            if 0 in changed:  # model 0's graph changed: match every model against it anew
                mapping, failed, g0_nx, i = [{n: n for n in node_lists[0]}], [], None, 1
                method = "trace order"
            continue
        if found is None:
            failed.append(i)
        else:
            mapping.append(found)
        i += 1
    if failed:
        label = "model" if len(failed) == 1 else "models"
        explanation, kinds = _explain_mismatch(graphs, models, sigs, failed, soft)
        raise MismatchError(
            f"{label} {', '.join(map(str, failed))} of {len(graphs)} cannot be fused with model 0: "
            f"the models are not structurally identical.\n{explanation}\n{fixes_for(kinds)}"
        )
    _record_per_model_values(graphs, mapping, soft)
    return GraphMatch(mapping=mapping, method=method)


def _record_per_model_values(
    graphs: Sequence[fx.GraphModule], mapping: list[dict[fx.Node, fx.Node]], soft: PerModelTable,
) -> None:
    """Store each node's differing per-model scalars on model 0's node (``meta[PER_MODEL]``),
    and each model's elementwise op where the models' ops differ beyond those scalars
    (``meta[DIFFERING_OPS]``: ReLU in one model, GELU in another)."""
    plain = dataclasses.replace(soft, elementwise_op=None)
    for node in graphs[0].graph.nodes:
        node.meta.pop(DIFFERING_OPS, None)
        if soft.elementwise_op is not None and soft.elementwise_op(node, graphs[0]) is not None:
            signatures = [node_signature(m[node], g, plain) for m, g in zip(mapping, graphs)]
            if any(sig != signatures[0] for sig in signatures[1:]):
                node.meta[DIFFERING_OPS] = [soft.elementwise_op(m[node], g)
                                            for m, g in zip(mapping, graphs)]
                node.meta.pop(PER_MODEL, None)
                continue
        per_model = [per_model_values(m[node], g, soft) for m, g in zip(mapping, graphs)]
        differing = {
            key: [values.get(key) for values in per_model]
            for key in per_model[0]
            if any(values.get(key) != per_model[0][key] for values in per_model)
        }
        if differing:
            node.meta[PER_MODEL] = differing
            node.args = canonical_args(node, soft)  # the per-model slot exists in model 0's call
        else:
            node.meta.pop(PER_MODEL, None)
