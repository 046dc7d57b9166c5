"""The rule table: one fusion rule per operator, looked up by what a node calls.

A rule takes a :class:`FusionGroup` (model 0's node, its N counterparts, its
arguments already rewritten into the fused graph) and a :class:`GraphBuilder`
(which emits nodes into the fused graph), and returns the fused node, whose
value is every model's result stacked along a leading model dim.  A rule that
cannot fuse a particular use raises :class:`NotFusable`; the driver then runs
the op one by one (the fallback) and says so in the fusion report.

Keys are ``("call_module", ModuleClass)``, ``("call_function", fn)`` or
``("call_method", "name")``; a library's function that hftc does not import (a
``torch.fx.wrap``-ped leaf of torchvision) is keyed by its name,
``("call_function", "torchvision.ops.stochastic_depth.stochastic_depth")``
(:func:`hftc.match.function_name`).  Each key is registered once with :func:`rule`, which
also declares what the rest of the pipeline asks the table (does the op draw random
numbers, which of its hyper-parameters may differ per model, which ATen ops
``torch.export`` records for it).  :func:`spellings` lists every spelling of one op,
so a family of ops (every elementwise op in all its spellings) shares one rule body.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils import parametrize

from ..frontends.export import Converter, same_arguments
from ..ir import (
    EXAMPLE_VALUE,
    ORIGIN,
    PER_MODEL,
    RULE,
    SOURCE,
    TORCH_RANDOM_DRAWS,
    ArgKey,
    bind_arguments,
    call_signature,
    parameter_position,
    positional_defaults,
)
from ..lowering.runtime import layout as rt_layout
from ..match import PerModelTable, describe_node, function_name, public_name, target_name
from .differing_ops import DifferingOp, declare_differing_op, elementwise_op


class NotFusable(Exception):
    """Raised by a rule for a use it cannot fuse; the driver loops over models instead."""


@dataclass
class FusionGroup:
    """N matched nodes, one per model, about to become one fused node.

    ``args``/``kwargs`` are model 0's arguments with every graph input replaced by
    its fused node (batched or shared: ask the builder); ``module`` is model 0's
    submodule for a ``call_module`` node (on the meta device: hyper-parameters
    only, never weights).
    """

    node: fx.Node
    nodes: list[str]  # the names of the N matched nodes, one per model
    args: tuple
    kwargs: dict
    module: nn.Module | None = None

    @property
    def example(self) -> Any:
        """Model 0's value at this node (meta tensors)."""
        return self.node.meta.get(EXAMPLE_VALUE)

    def arg_example(self, position: int | str) -> Any:
        """Model 0's value of an argument, by position or keyword."""
        a = self.node.args[position] if isinstance(position, int) else self.node.kwargs[position]
        return a.meta.get(EXAMPLE_VALUE) if isinstance(a, fx.Node) else a

    def arg(self, position: int, name: str, default: Any = None) -> Any:
        """A (fused) argument given by position or keyword, or ``default``."""
        if position < len(self.args):
            return self.args[position]
        return self.kwargs.get(name, default)

    def has_arg(self, position: int, name: str) -> bool:
        return position < len(self.args) or name in self.kwargs

    @property
    def per_model(self) -> dict[str | ArgKey, list]:
        """Hyper-parameters that differ between the models: ``{key: [value_0, ...]}``.

        Keys are module attributes (``"p"``, ``"eps"``) or arguments (:class:`ArgKey`);
        empty when every model agrees.
        """
        return self.node.meta.get(PER_MODEL, {})

    def per_model_arg(self, position: int, name: str) -> list | None:
        """The per-model values of an argument, or None if all models pass the same."""
        values = self.per_model
        return values.get(ArgKey(position=position), values.get(ArgKey(keyword=name)))

    def per_model_keywords(self) -> set[str]:
        """The names of the per-model arguments the call passes by keyword."""
        return {key.keyword for key in self.per_model
                if isinstance(key, ArgKey) and key.keyword is not None}

    def per_model_values(self, name: str) -> list | None:
        """The per-model values of hyper-parameter ``name`` (a module's attribute or a
        function's argument, however the call passed it), or None if the models agree."""
        if self.node.op == "call_module":
            return self.per_model.get(name)
        return self.per_model_arg(parameter_position(self.node.target, name), name)

    def arguments(self, builder: GraphBuilder, functional: Callable[..., Any],
                  **module_values: Any) -> dict[str, Any]:
        """The op's (fused) arguments by ``functional``'s parameter names, either spelling::

            F.linear(x, w, b)    -> bound by F.linear's signature, defaults filled in
                                    (:func:`hftc.ir.bind_arguments`)
            nn.Linear(...)(x)    -> {"input": x, "weight": the stacked weight, "bias": ...}
            nn.MSELoss()(y, t)   -> {"input": y, "target": t, "reduction": "mean", ...}

        ``functional`` is the op's function, or a Python function with its parameters
        where torch gives it several schemas (``F.conv2d``: ``passes.conv.conv_parameters``).
        A module's call is bound by its ``forward``: its first argument is the functional's
        first, the others are kept where the functional has a parameter of their name (a
        loss's ``target``).  Its tensors are the fused module's stacked ones, its Python
        hyper-parameters model 0's (those that differ: :meth:`per_model_values`);
        ``module_values`` give what a module computes itself (a norm's ``training``)."""
        if self.node.op != "call_module":  # a function, or a method (``self`` first)
            return bind_arguments(functional, self.args, self.kwargs)
        first, *names = call_signature(functional).parameters
        _, (_, x), *passed = bind_arguments(
            type(self.module).forward, (self.module, *self.args), self.kwargs).items()
        arguments = {first: x, **{name: value for name, value in passed if name in names}}
        for name in names:
            if name in arguments:
                continue
            value = getattr(self.module, name, None)
            if name in module_values:
                arguments[name] = module_values[name]
            elif isinstance(value, torch.Tensor) or name in ("weight", "bias"):
                arguments[name] = builder.module_attr(self, name)
            elif hasattr(self.module, name):
                arguments[name] = tuple(value) if isinstance(value, (list, torch.Size)) else value
        return arguments


Rule = Callable[[FusionGroup, "GraphBuilder"], fx.Node]
#: What a rule fuses: ``("call_module", ModuleClass)``, ``("call_function", fn)`` or
#: ``("call_method", "name")``; a function hftc does not import by its name (a string).
Key = tuple[str, Any]


@dataclass(frozen=True)
class RuleEntry:
    """A rule and what the pipeline must know about the ops it is registered for."""

    rule: Rule
    name: str
    #: The op draws random numbers: each model draws its own, even from a shared input.
    random: bool = False
    #: Hyper-parameters that may differ between the models: a module key's attributes, a
    #: function key's arguments (their positions and defaults from its signature).
    per_model: tuple[str, ...] = ()
    #: The ATen ops (overload packets) torch.export records for these ops, each with the
    #: converter that spells it back in the keys' vocabulary (:func:`aten_spellings`).
    aten: tuple[tuple[Any, Converter], ...] = ()
    #: A Python function with the keys' parameters (where ``per_model``'s positions and
    #: defaults come from), for keys that name a library's function by a string, methods,
    #: and torch builtins of several schemas (``torch.where``); every key then reads it.
    signature: Callable[..., Any] | None = None
    #: What the op computes over a dim ``pad_widths=True`` padded with zeros: a
    #: :data:`PADDING_KINDS` kind, a :class:`Reduces`, or a function of the node giving one
    #: (None: hftc does not know, and refuses the op over a padded dim).
    padding: Any = None
    #: May a CPU program run channels-last with this op (``hftc.lowering.layout.safe``):
    #: True, False, or a function of the module or call node that says.
    channels_last: bool | Callable[[Any], bool] = True
    #: The op's link in a linear chain (``hftc.lowering.chains``): which fused nodes it
    #: emits that a chain may take.
    chain: ChainLink | None = None
    #: The elementwise ops of these keys that may differ per model (:class:`DifferingOp`).
    differing_ops: tuple[DifferingOp, ...] = ()
    #: How ``pad_widths=True`` pads a module key's module (:class:`Widens`).
    widens: Widens | None = None

    def signature_of(self, target: Any) -> Any:
        return self.signature or target


#: ``padding=`` kinds: what an op computes over a dim padded with zeros (pad_widths=True,
#: every padded tensor laid out as each model's real units first, padding after).
EXACT = "exact"  # each real unit's result reads real units only: exact as it is
MOVES = "moves"  # only moves (copies, casts) units: checked by running it on unit numbers
SPLITS = "splits"  # split along a dim: each piece's real units, its padding after them
CONTRACTS = "contracts"  # a product contracting its first operand's last dim: zeroed first
ATTENDS = "attends"  # attention: the contracted head dim zeroed; a padded sequence refused
PER_CHANNEL = "per_channel"  # per channel over whole spatial dims (pooling)
PADDING_KINDS = (EXACT, MOVES, SPLITS, CONTRACTS, ATTENDS, PER_CHANNEL)


@dataclass(frozen=True)
class Reduces:
    """``padding=`` of a reduction or normalisation: computed over each model's real units
    (``hftc.module.padding_graph.reduce(op, x, pad, count, arguments)``)::

        @rule(*spellings("var"), padding=Reduces("var", var_over_real_units))

    ``parameters``: a function with the op's parameters (its tensors are graph nodes, its
    Python values the call's) returning ``reduce``'s arguments (``dim``, ``keepdim``, ...),
    or None where this call reduces nothing (``torch.max(a, b)``); ``one_dim``: the op
    takes one dim, not a tuple; ``otherwise``: the kind of a call that reduces nothing;
    ``as_function``: for a module key, the functional call it is (``nn.Softmax(dim)`` ->
    ``F.softmax``, ``{"dim": dim}``) or None (refused)."""

    op: str
    parameters: Callable[..., dict | None]
    one_dim: bool = False
    otherwise: str | None = None
    as_function: Callable[[nn.Module], tuple[Callable[..., Any], dict] | None] | None = None


@dataclass(frozen=True)
class Widens:
    """``widens=``: how ``pad_widths=True`` pads a module to the widest model's widths
    (:func:`hftc.module.padding.pad_models`, with :mod:`hftc.passes.padded`)::

        @rule(("call_module", nn.Linear), ..., widens=Widens(widened_linear, weight=True))

    ``pad(module, others, widths, where)``: model i's ``module`` at the widest widths
    (``others``: every model's module at its path; ``widths``: its own tensors' widest
    shapes; ``where`` names it for an error it raises); ``weight``: its ``weight``'s
    entries count the arithmetic padding multiplies (a Linear's, Conv's, Embedding's);
    ``attributes``: its width may be only in its attributes (a norm without parameters);
    ``blocks(module)``: its tensors padded as equal blocks along dim 0, each on its own
    (name -> blocks: attention's packed q, k, v)."""

    pad: Callable[..., nn.Module]
    weight: bool = False
    attributes: bool = False
    blocks: Callable[[nn.Module], dict[str, int]] | None = None


@dataclass(frozen=True)
class ChainLink:
    """``chain=``: the fused nodes of this op that a linear chain may take
    (``hftc.lowering.chains``): ``role`` "linear" (a link) or "relu" (the activation
    between two), ``accepts(node, root)`` says whether this fused node is one."""

    role: str
    accepts: Callable[[fx.Node, nn.Module], bool]


class _RuleTable(dict):
    """The rule table: a dict that counts its changes (``version``), so that what is
    derived from it (the chain links, the module facts) is derived again after a change."""

    version = 0

    def __setitem__(self, key: Key, entry: RuleEntry) -> None:
        self.version += 1
        super().__setitem__(key, entry)

    def __delitem__(self, key: Key) -> None:
        self.version += 1
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self.version += 1
        return super().pop(*args)

    def popitem(self) -> tuple[Key, RuleEntry]:
        self.version += 1
        return super().popitem()

    def setdefault(self, key: Key, default: Any = None) -> Any:
        self.version += 1
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.version += 1
        super().update(*args, **kwargs)

    def clear(self) -> None:
        self.version += 1
        super().clear()


RULES: dict[Key, RuleEntry] = _RuleTable()
_DERIVED: dict[str, tuple[int, Any]] = {}


def _derived(name: str, make: Callable[[], Any]) -> Any:
    """``make()``, made again only after the rule table changed."""
    version = RULES.version  # type: ignore[attr-defined]
    cached = _DERIVED.get(name)
    if cached is None or cached[0] != version:
        cached = _DERIVED[name] = (version, make())
    return cached[1]
#: ATen op (overload packet) -> its converter, from every rule's ``aten=``.
_ATEN: dict[Any, Converter] = {}



class DuplicateRuleError(Exception):
    """Two rules registered for one key: which one fuses the op would depend on import order."""


def rule(*keys: Key, name: str | None = None, random: bool = False,
         per_model: Sequence[str] = (),
         aten: Mapping[Any, Callable[..., Any]] | None = None,
         signature: Callable[..., Any] | None = None, padding: Any = None,
         channels_last: bool | Callable[[Any], bool] = True,
         chain: ChainLink | None = None,
         differing_op: DifferingOp | Sequence[DifferingOp] = (),
         widens: Widens | None = None) -> Callable[[Rule], Rule]:
    """Register a rule for ``keys`` (the one way to declare one)::

        @rule(("call_module", nn.Conv2d), ("call_function", F.conv2d))
        def fuse_conv(group, builder): ...

        rule(*spellings("relu", inplace=True), name="fuse_pointwise[relu]")(fuse_pointwise)

        @rule(("call_module", nn.BatchNorm2d), ("call_function", F.batch_norm),
              per_model=("momentum", "eps"))

        @rule(("call_function", F.linear), aten={aten.linear: F.linear})
        @rule(*conv_keys, aten={aten.convolution: convolution_as_functional})

    ``random``: the op draws random numbers.  ``per_model``: the hyper-parameters that may
    differ between the models (the rule reads them with :meth:`FusionGroup.per_model_values`):
    a module key's attributes and a function key's arguments of those names (its signature
    gives their positions and defaults, :func:`hftc.ir.call_signature`).  ``aten``: the
    ATen ops (overload packets) torch.export records for these ops where that is not
    ``torch.NAME`` / ``F.NAME`` with the same arguments, each with one of the rule's
    functions (the same arguments, another name) or a converter ``(emitter, args, kwargs)
    -> node`` (:mod:`hftc.frontends.export`).  ``signature``: for keys that name a
    library's function by a string (``"torchvision.ops.stochastic_depth.stochastic_depth"``),
    methods and torch builtins of several schemas, a Python function with the same
    parameters, where ``per_model`` finds their positions (for every key of the rule).
    ``padding``: what the op computes over a padded dim (``pad_widths=True``: a
    :data:`PADDING_KINDS` kind, :class:`Reduces`, or a function of the node giving one);
    ``channels_last``: whether a CPU program may run channels-last with it (or a function
    of its module or call node that says); ``chain``: its :class:`ChainLink` in a linear chain;
    ``differing_op``: the :class:`DifferingOp` (or several) its keys spell, an elementwise op
    that may differ per model; ``widens``: how ``pad_widths=True`` pads its module
    (:class:`Widens`).
    A key or ATen op registered twice raises :class:`DuplicateRuleError` at import,
    whatever the order the rule files load in.
    """
    functions = {target for op, target in keys if op == "call_function"}
    ops = (differing_op,) if isinstance(differing_op, DifferingOp) else tuple(differing_op)
    converters = tuple(
        (op, same_arguments(spelling) if spelling in functions else spelling)
        for op, spelling in (aten or {}).items())

    def wrap(body: Rule) -> Rule:
        entry = RuleEntry(body, name or body.__name__, random, tuple(per_model), converters,
                          signature, padding, channels_last, chain, ops, widens)
        if isinstance(padding, str) and padding not in PADDING_KINDS:
            raise TypeError(f"rule `{entry.name}`: padding={padding!r} is none of "
                            f"{PADDING_KINDS}, a Reduces, or a function of the node")
        for op, _ in converters:
            if not isinstance(op, torch._ops.OpOverloadPacket):
                raise TypeError(f"rule `{entry.name}`: aten= takes ATen ops such as "
                                f"torch.ops.aten.linear, not {op!r}")
            if op in _ATEN:
                raise DuplicateRuleError(f"ATen op {op} has two spellings, one of them in "
                                         f"rule `{entry.name}`: declare it on one rule")
        for op, target in keys:
            if not random and op == "call_function" and any(
                    getattr(torch, draw) is target for draw in TORCH_RANDOM_DRAWS):
                raise TypeError(f"rule `{entry.name}`: torch.{target.__name__} draws random "
                                f"numbers (hftc.ir.TORCH_RANDOM_DRAWS): declare it random=True")
            if op == "call_module" or not per_model:
                continue
            try:
                positions = [parameter_position(entry.signature_of(target), p)
                             for p in per_model] if op == "call_function" or (
                                 op == "call_method" and entry.signature) else [None]
            except KeyError as missing:
                positions = [None]
                what = f"has no parameter {missing}"
            else:
                what = "has a per-model parameter only a position can pass"
            if None in positions:
                raise TypeError(f"rule `{entry.name}`: {op} {target_name_of(target)} {what} "
                                f"(per_model={tuple(per_model)})")
        for key in dict.fromkeys(keys):
            if key in RULES:
                raise DuplicateRuleError(
                    f"{key[0]} {target_name_of(key[1])} has two fusion rules, "
                    f"`{RULES[key].name}` and `{entry.name}`: register it with one of them")
            RULES[key] = entry
        _ATEN.update(converters)
        for op in ops:
            declare_differing_op(op, keys, entry.name)
        return body

    return wrap


def aten_spellings() -> Mapping[Any, Converter]:
    """ATen op (overload packet) -> the converter that spells it in the rules' vocabulary,
    as the rules declare them (``@rule(..., aten=...)``), for the export front-end
    (:func:`hftc.frontends.export.export_model`)."""
    return dict(_ATEN)


def target_name_of(target: Any) -> str:
    return getattr(target, "__qualname__", str(target))


def per_model_table() -> PerModelTable:
    """The hyper-parameters that may differ between the models, as the rules declare them
    (``@rule(..., per_model=...)``), and the elementwise ops that may differ per model
    (:mod:`hftc.passes.differing_ops`), for :func:`hftc.match.match_graphs`."""
    modules, arguments, defaults = [], {}, {}
    for (op, target), entry in RULES.items():
        if not entry.per_model:
            continue
        if op == "call_module":
            modules.append((target, entry.per_model))
            continue
        fn = entry.signature_of(target)
        arguments[target] = {parameter_position(fn, name): name for name in entry.per_model}
        defaults[target] = positional_defaults(fn, max(arguments[target]))
    return PerModelTable(tuple(modules), arguments, defaults, elementwise_op=elementwise_op)


def padding_of(node: fx.Node, module: nn.Module | None = None) -> Any:
    """What the op at ``node`` computes over a padded dim, as its rule declares it
    (``@rule(..., padding=...)``): a :data:`PADDING_KINDS` kind, a :class:`Reduces`, or
    None (no rule, or its rule declares nothing: refused over a padded dim)."""
    try:
        entry = lookup(node, module)
    except TypeError:  # an unhashable target
        return None
    fact = None if entry is None else entry.padding
    return fact(node) if callable(fact) and not isinstance(fact, Reduces) else fact


def channels_last_safe(op: nn.Module | fx.Node) -> bool:
    """May a CPU program run channels-last with this module (any subclass of a module key
    that declares ``channels_last=``) or call node, as the rules declare it?"""
    if isinstance(op, nn.Module):
        facts = [entry.channels_last for cls, entry in _module_facts()
                 if entry.channels_last is not True and isinstance(op, cls)]
    elif op.op != "call_function":
        return True
    else:
        # a function declared unsafe by name: its spellings (torch.group_norm, ATen's
        # native_group_norm) with it
        name = getattr(op.target, "__name__", "")
        if any(unsafe in name for unsafe in _unsafe_function_names()):
            return False
        try:
            entry = RULES.get((op.op, op.target))
        except TypeError:  # an unhashable target
            entry = None
        facts = [] if entry is None else [entry.channels_last]
    return all(fact(op) if callable(fact) else fact for fact in facts)


def _unsafe_function_names() -> set[str]:
    return _derived("unsafe functions", lambda: {
        target.__name__ for (kind, target), entry in RULES.items()
        if kind == "call_function" and entry.channels_last is False
        and not isinstance(target, str)})


def _module_facts() -> list[tuple[type, RuleEntry]]:
    """The module keys' classes and rules that declare channels-last or widening facts."""
    return _derived("module facts", lambda: [
        (cls, entry) for (kind, cls), entry in RULES.items() if kind == "call_module"
        and (entry.channels_last is not True or entry.widens is not None)])


def widens_of(module: nn.Module) -> Widens | None:
    """How ``pad_widths=True`` pads ``module`` (an instance of a module key that declares
    ``widens=``), or None: no rule says."""
    return next((entry.widens for cls, entry in _module_facts()
                 if entry.widens is not None and isinstance(module, cls)), None)


def widened_modules() -> list[str]:
    """The module classes ``pad_widths=True`` pads, by name (for its error messages)."""
    return list(dict.fromkeys(f"nn.{cls.__name__}" for (kind, cls), entry in RULES.items()
                              if kind == "call_module" and entry.widens is not None
                              and not cls.__name__.startswith("_")))


def chain_links(role: str) -> list[ChainLink]:
    """The rules' :class:`ChainLink` of ``role`` ("linear" or "relu"), one per rule."""
    return _derived(f"chain links {role}", lambda: list(
        {id(e.chain): e.chain for e in RULES.values()
         if e.chain is not None and e.chain.role == role}.values()))


def runs_one_by_one(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """The body of a rule table entry that declares facts about an op (it draws random
    numbers) but fuses nothing: the op runs as the one-by-one fallback."""
    if group.module is not None:
        raise NotFusable(f"no fusion rule for module {type(group.module).__name__}")
    raise NotFusable(f"no fusion rule for {public_name(target_name(group.node))}")


def is_random(node: fx.Node, module: nn.Module | None = None) -> bool:
    """Does the op at ``node`` draw random numbers (the rule table's ``random``)?"""
    entry = lookup(node, module) if node.op != "call_module" or module is not None else None
    return entry is not None and entry.random


def spellings(name: str, *, torch_fn: bool = True, method: bool = True,
              functional: bool = True, inplace: bool = False) -> list[tuple[str, Any]]:
    """Every way user code calls one op: ``torch.relu``, ``F.relu``, ``x.relu()``, ``x.relu_()``."""
    keys: list[tuple[str, Any]] = []
    # torch.float, torch.long ... are dtypes, not functions: only the method spelling exists.
    if torch_fn and callable(getattr(torch, name, None)):
        keys.append(("call_function", getattr(torch, name)))
    if functional and callable(getattr(torch.nn.functional, name, None)):
        keys.append(("call_function", getattr(torch.nn.functional, name)))
    if method and hasattr(torch.Tensor, name):
        keys.append(("call_method", name))
    if inplace:
        if method and hasattr(torch.Tensor, name + "_"):
            keys.append(("call_method", name + "_"))
        if hasattr(torch.nn.functional, name + "_"):
            keys.append(("call_function", getattr(torch.nn.functional, name + "_")))
        if hasattr(torch, name + "_"):
            keys.append(("call_function", getattr(torch, name + "_")))
    return list(dict.fromkeys(keys))  # F.relu_ is torch.relu_


def lookup(node: fx.Node, module: nn.Module | None) -> RuleEntry | None:
    """The rule for a node: by module class (walking the MRO while ``forward`` is
    inherited unchanged, so a subclass that overrides ``forward`` is not mistaken
    for its base), by function, or by method name."""
    if node.op == "call_module":
        assert module is not None
        if parametrize.is_parametrized(module):
            # Its weight is computed from other tensors on every access (weight_norm,
            # spectral_norm, orthogonal ...), which the fused op would not recompute:
            # the one-by-one fallback runs the module itself.
            return None
        forward = type(module).forward
        for cls in type(module).__mro__:
            if cls is nn.Module:
                break
            entry = RULES.get(("call_module", cls))
            if entry is not None and getattr(cls, "forward", None) is forward:
                return entry
        return None
    entry = RULES.get((node.op, node.target))
    if entry is None and node.op == "call_function":
        entry = RULES.get((node.op, function_name(node.target)))
    return entry


# --------------------------------------------------------------------------- the builder


@dataclass
class GraphBuilder:
    """Emits nodes into the fused graph and remembers which ones carry a model dim."""

    graph: fx.Graph
    num_models: int
    batched: set[fx.Node] = field(default_factory=set)
    #: Set by the driver while a group is being fused: provenance for every node made.
    current: FusionGroup | None = None
    current_rule: str = ""

    def is_batched(self, value: Any) -> bool:
        """Does this (fused) argument, or any node inside it, carry the model dim?"""
        found = []
        fx.node.map_arg(value, lambda n: found.append(n in self.batched) or n)
        return any(found)

    def _record(self, node: fx.Node, batched: bool, example: Any = None) -> fx.Node:
        if batched:
            self.batched.add(node)
        if self.current is not None:
            node.meta[ORIGIN] = list(self.current.nodes)
            node.meta[RULE] = self.current_rule
            node.meta[SOURCE] = describe_node(self.current.node)
        return node

    def call(self, fn: Callable[..., Any], *args: Any, batched: bool = True,
             **kwargs: Any) -> fx.Node:
        """Emit ``fn(*args, **kwargs)``; ``batched`` says whether its result has the model dim."""
        return self._record(self.graph.call_function(fn, args, kwargs), batched)

    def method(self, name: str, *args: Any, batched: bool = True, **kwargs: Any) -> fx.Node:
        return self._record(self.graph.call_method(name, args, kwargs), batched)

    def module(self, target: str, *args: Any, batched: bool = True, **kwargs: Any) -> fx.Node:
        return self._record(self.graph.call_module(target, args, kwargs), batched)

    def attr(self, target: str, *, batched: bool = True) -> fx.Node:
        """A stacked parameter/buffer (batched) or a plain attribute (``training``)."""
        return self._record(self.graph.get_attr(target), batched)

    def module_attr(self, group: FusionGroup, name: str) -> fx.Node | None:
        """The stacked tensor ``name`` of the group's module, or None if it has none."""
        assert group.node.op == "call_module"
        if getattr(group.module, name, None) is None:
            return None
        return self.attr(f"{group.node.target}.{name}")

    def training_flag(self, group: FusionGroup) -> fx.Node:
        """The fused submodule's ``training`` flag, read at run time (``fused.eval()`` works)."""
        return self.attr(f"{group.node.target}.training", batched=False)

    def broadcast(self, value: Any) -> Any:
        """A shared value as a batched one (each model sees the same data)."""
        if self.is_batched(value) or not isinstance(value, fx.Node):
            return value
        return self.call(rt_layout.expand_models, value, self.num_models)

    def copy(self, group: FusionGroup, batched: bool) -> fx.Node:
        """Emit the original op unchanged on the fused arguments."""
        node = group.node
        if node.op == "call_function":
            return self.call(node.target, *group.args, batched=batched, **group.kwargs)
        if node.op == "call_method":
            return self.method(node.target, *group.args, batched=batched, **group.kwargs)
        if node.op == "call_module":
            return self.module(node.target, *group.args, batched=batched, **group.kwargs)
        raise NotFusable(f"cannot copy a {node.op} node")
