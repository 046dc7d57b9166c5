"""Stage 3: rewrite model 0's graph, node by node, into the fused graph.

Walks model 0's graph in order.  For each node, with its N matched counterparts:

1. ``placeholder``: a fused input, batched (``in_dims`` not None) or shared.
2. ``get_attr`` of a parameter/buffer: the stacked ``[N, ...]`` tensor (batched).
3. No argument carries the model dim, the op has no state and draws no random
   numbers: the op runs once, unchanged, and its result stays shared
   (``x.size(0)``, arithmetic on shapes, a pooling of the shared input).
4. A rule in the registry: the rule emits the fused op(s).
5. No rule, or the rule raised :class:`NotFusable`: the one-by-one fallback inside the
   fused graph (exact, slow, reported as a fallback).

Before and after, with N = 3::

    x -> conv1 -> relu -> flatten -> fc            (model 0; models 1, 2 alike)

    x -> conv(x, conv1.weight[3,...]) -> relu -> reshape(3, B, -1) -> linear(fc.weight[3,...])
         (one conv with 3*Cout channels)          (one baddbmm)

The output's tensor leaves all get the model dim (shared ones are expanded).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

from .. import ir
from ..errors import FusionError, UnsupportedOperatorError, plain_message
from ..ir import DIFFERING_OPS, EXAMPLE_VALUE, node_writes_in_place
from ..lowering.runtime import differing_ops as rt_differing_ops
from ..lowering.runtime import fallback as rt_fallback
from ..lowering.runtime import layout as rt_layout
from ..match import describe_node, module_path, public_name, target_name
from .differing_ops import describe_ops
from .registry import FusionGroup, GraphBuilder, NotFusable, RuleEntry, lookup
from .report_text import report_lines, shape_text

#: The fused module's name for a constant tensor every model holds equal (one copy, shared;
#: other constants are stacked ``[N, ...]``).  It starts like every constant's name.
SHARED_CONSTANT_PREFIX = "_hftc_constant_shared_"

@dataclass
class FusionRecord:
    """What became of one node of model 0 (and its N counterparts)."""

    node: str
    source: str
    #: "loop": the op runs one by one (the fallback); "per_model": a differing op (the
    #: models' ops differ, an activation), each runs on its slice (docs/ARCHITECTURE.md's
    #: "Words": these spellings are public, kept)
    kind: str  # "fused" | "shared" | "loop" | "per_model" | "input" | "parameter"
    rule: str = ""
    fused_nodes: list[str] = field(default_factory=list)
    reason: str = ""
    originals: list[str] = field(default_factory=list)
    #: The fused node that holds this node's value (``[N, ...]`` unless ``kind`` is
    #: "shared"), for :func:`hftc.lowering.check.locate_difference`.
    value: str = ""
    #: The fused value's shape as the report prints it, ``[N, 2, 6, 28, 28]``
    #: (:func:`~hftc.passes.report_text.shape_text`; a shared value's has no ``N``).
    shape: str = ""


@dataclass
class FusionReport:
    """Which operators fused into what, and what fell back to running one by one."""

    num_models: int
    records: list[FusionRecord]
    match_method: str = "trace order"
    #: The lowerings ``autotune=True`` chose (hftc.lowering.autotune.LoweringChoice).
    lowerings: list[Any] = field(default_factory=list)
    #: The first-call check against the models' own forward (hftc.lowering.check.CheckResult).
    check: Any = None
    #: Fused or the models one by one, and why (hftc.lowering.strategy.StrategyChoice).
    strategy: Any = None
    #: pad_widths=True: how the models were padded and what it costs (hftc.module.padding).
    padding: str | None = None
    #: frontend='export' where not every input dim could be kept symbolic: how the sizes
    #: were exported and why ("with static shapes (the example inputs' sizes): ...").
    exported: str | None = None

    @property
    def fallbacks(self) -> list[FusionRecord]:
        return [r for r in self.records if r.kind == "loop"]

    @property
    def fused(self) -> list[FusionRecord]:
        return [r for r in self.records if r.kind == "fused"]

    @property
    def per_model(self) -> list[FusionRecord]:
        """The differing ops: the nodes whose op differs per model (ReLU in one, GELU in
        another), run on each model's slice of the fused tensor."""
        return [r for r in self.records if r.kind == "per_model"]

    def rule_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            if r.kind in ("fused", "loop", "per_model"):
                counts[r.rule] = counts.get(r.rule, 0) + 1
        return counts

    def __str__(self) -> str:
        """One row per op, the user's names (hftc.passes.report_text's docstring shows it)."""
        return "\n".join(report_lines(self, "hftc fusion report"))


def _has_state(module: nn.Module | None) -> bool:
    if module is None:
        return False
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _contains_tensor(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))


def _leaf_flags(builder: GraphBuilder, args: Any, kwargs: Any) -> Any:
    """``(args, kwargs)`` with each value replaced by whether it carries the model dim.

    The flags follow the argument containers written in the graph, not the values the
    nodes hold at run time: a node's value is one entry however it is built (a
    ``torch.Size`` from ``x.shape``, another op's returned tuple)."""
    return fx.node.map_aggregate(
        (args, kwargs), lambda a: isinstance(a, fx.Node) and a in builder.batched)


def _emit_loop(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """Emit the one-by-one fallback for a node no rule fuses."""
    node = group.node
    flags = _leaf_flags(builder, group.args, group.kwargs)
    batched_out = _contains_tensor(group.example)
    if node.op == "call_module":
        container = builder.attr(node.target, batched=False)
        # Each model runs with its own hyper-parameters (dropout p, eps ...) set on the template.
        overrides = tuple(
            tuple((k, values[i]) for k, values in group.per_model.items())
            for i in range(builder.num_models)
        ) if group.per_model else None
        return builder.call(
            rt_fallback.loop_module, container, builder.num_models, flags, group.args, group.kwargs,
            batched=batched_out, overrides=overrides,
        )
    fn = node.target if node.op == "call_function" else rt_fallback.call_method(node.target)
    # Model i's own scalar arguments, as plain tuples the generated code can spell.
    per_model_args = tuple((key.position, tuple(values)) for key, values in
                           group.per_model.items() if key.keyword is None) or None
    per_model_kwargs = tuple((key.keyword, tuple(values)) for key, values in
                             group.per_model.items() if key.keyword is not None) or None
    return builder.call(
        ir.bind(rt_fallback.loop_over_models, fn), builder.num_models, flags, group.args,
        group.kwargs, per_model_args, per_model_kwargs, batched=batched_out,
    )


def fuse_graph(
    graph_module: fx.GraphModule,
    originals: Sequence[dict[str, str]],
    match_method: str,
    num_models: int,
    input_batched: Sequence[bool],
    attr_targets: dict[str, str],
) -> tuple[fx.Graph, FusionReport]:
    """Rewrite model 0's annotated graph into the fused graph (see the module docstring).

    ``graph_module`` is model 0's traced graph rooted at its meta template (every
    node carries ``meta["example_value"]``); ``originals[i]`` maps each node name of
    model 0 onto model i's matched node; ``input_batched[k]`` says whether the
    k-th input carries the model dim; ``attr_targets`` maps a get_attr target of
    model 0 onto the fused module's attribute holding the stacked values.
    """
    fusion = _Fusion(graph_module, num_models, input_batched, attr_targets)
    for node in graph_module.graph.nodes:
        names = [m[node.name] for m in originals]
        if node.op == "placeholder":
            fusion.placeholder(node, names)
        elif node.op == "output":
            fusion.output(node)
        elif node.op == "get_attr":
            fusion.get_attr(node, names)
        else:
            fusion.operator(node, names)
    if fusion.unsupported:
        raise UnsupportedOperatorError(
            f"{len(fusion.unsupported)} operator(s) cannot be fused:\n  "
            + "\n  ".join(fusion.unsupported), fusion.unsupported,
        )
    fusion.builder.graph.lint()
    return fusion.builder.graph, FusionReport(num_models, fusion.records, match_method)


class _Fusion:
    """The state of one :func:`fuse_graph` walk, one method per kind of node."""

    def __init__(self, graph_module: fx.GraphModule, num_models: int,
                 input_batched: Sequence[bool], attr_targets: dict[str, str]) -> None:
        self.graph_module = graph_module
        self.builder = GraphBuilder(fx.Graph(), num_models)
        self.input_batched = input_batched
        self.attr_targets = attr_targets
        self.env: dict[fx.Node, Any] = {}  # model 0's node -> its fused value
        self.records: list[FusionRecord] = []
        self.unsupported: list[str] = []
        self.placeholders = 0
        self.position = {node: i for i, node in enumerate(graph_module.graph.nodes)}

    def placeholder(self, node: fx.Node, names: list[str]) -> None:
        """A fused input: batched (its ``in_dims`` is not None) or shared."""
        k = self.placeholders
        batched = self.input_batched[k] if k < len(self.input_batched) else False
        self.placeholders += 1
        default = node.args[0] if node.args else inspect.Signature.empty
        new = self.builder.graph.placeholder(node.target, default_value=default)
        new.meta.update(node.meta)
        if batched:
            self.builder.batched.add(new)
        self.env[node] = new
        self.records.append(FusionRecord(node.name, "input", "input", "", [new.name], "", names))

    def output(self, node: fx.Node) -> None:
        """The outputs, every tensor leaf with the model dim (shared ones expanded)."""
        builder = self.builder
        out = fx.node.map_arg(node.args[0], lambda a: self.env[a])
        examples = fx.node.map_arg(node.args[0], lambda a: a.meta.get(EXAMPLE_VALUE))
        builder.current = None

        def finish(value: Any, example: Any) -> Any:
            if isinstance(value, fx.Node) and value not in builder.batched \
                    and _contains_tensor(example):
                return builder.call(rt_layout.expand_models, value, builder.num_models)
            return value

        builder.graph.output(_map_pair(out, examples, finish))

    def get_attr(self, node: fx.Node, names: list[str]) -> None:
        """A parameter, buffer or constant: the stacked ``[N, ...]`` one (or the shared copy)."""
        target = self.attr_targets.get(node.target, node.target)
        value = node.meta.get(EXAMPLE_VALUE)
        shared = target.startswith(SHARED_CONSTANT_PREFIX)
        new = self.builder.attr(target, batched=isinstance(value, torch.Tensor) and not shared)
        new.meta[EXAMPLE_VALUE] = value
        self.env[node] = new
        self.records.append(FusionRecord(node.name, describe_node(node), "parameter", "",
                                         [new.name], "", names))

    def operator(self, node: fx.Node, names: list[str]) -> None:
        """A call: run once (shared), draw per model, refuse, apply its rule, or loop."""
        builder, env = self.builder, self.env
        module = self.graph_module.get_submodule(node.target) \
            if node.op == "call_module" else None
        group = FusionGroup(
            node=node, nodes=names, args=fx.node.map_arg(node.args, lambda a: env[a]),
            kwargs=fx.node.map_arg(node.kwargs, lambda a: env[a]), module=module,
        )
        builder.current = group
        first_new = len(builder.graph.nodes)
        entry = lookup(node, module)
        any_batched = builder.is_batched((group.args, group.kwargs))
        random = entry is not None and entry.random
        kind, rule_name, reason = "fused", entry.name if entry else "", ""
        writes_shared = _inplace_on_shared(node, group, builder)
        if writes_shared and (any_batched or group.per_model) and not random \
                and _fresh_and_unaliased(node, self.position):
            # A per-model write into a tensor forward made and nothing else sees yet
            # (``y = torch.zeros_like(x); y[idx] = self.c``, HF's label shifting): each
            # model writes into its own copy, which later reads of the tensor see.
            own = _per_model_copy(node, group, builder, env)
            group = FusionGroup(node, names, (own, *group.args[1:]), group.kwargs, module)
            builder.current, writes_shared = group, False
        differing_ops = node.meta.get(ir.DIFFERING_OPS)
        if differing_ops:
            # ReLU in some models, GELU in others: each model's op on its slice.
            why_not = check_differing_op(node)
            writes = any(map(rt_differing_ops.writes_in_place, differing_ops))
            if why_not is None and not any_batched and writes:
                why_not = "some models' op writes in place into a value all models share"
            builder.current_rule = rule_name = "per_model_op"
            kind, reason = "per_model", f"the op differs per model: {describe_ops(differing_ops)}"
            if why_not is not None:
                self.unsupported.append(
                    f"{describe_node(node, self.graph_module)}: the models run different ops here "
                    f"({describe_ops(differing_ops)}), which hftc runs on each model's slice, "
                    f"but {why_not}; use the out-of-place form (inplace=False)")
                kind = "refused"
            new = fuse_differing_op(group, builder)
        elif not any_batched and not _has_state(module) and not random and not group.per_model:
            builder.current_rule = "shared"
            new, kind, rule_name = builder.copy(group, batched=False), "shared", "shared"
        elif random and writes_shared:
            # A draw into a shared tensor (``torch.empty(shape).normal_()``, as
            # torch.distributions' rsample draws; ``torch.empty_like(x).uniform_()``):
            # each model draws its own, into its own copy, which later reads of the
            # tensor see too.
            builder.current_rule = rule_name = "per_model_draw"
            new, reason = _draw_into_own_copy(entry, group, builder, env)
            if new is None:
                self.unsupported.append(f"{describe_node(node)}: {reason}")
                new, kind = builder.copy(group, batched=False), "refused"
        elif writes_shared:
            self.unsupported.append(
                f"{describe_node(node)}: in-place `{node.target}` writes a value shared by "
                f"all models ({module_path(node)}) with a per-model operand; use the "
                f"out-of-place form"
            )
            new, kind, rule_name = builder.copy(group, batched=False), "refused", "refused"
        else:
            new, reason = _apply_rule(entry, group, builder)
            if new is None:
                builder.current_rule = "loop"
                new = _emit_loop(group, builder)
                kind, rule_name = "loop", "loop"
        made = [m for m in list(builder.graph.nodes)[first_new:] if m.op != "get_attr"]
        new.meta[EXAMPLE_VALUE] = node.meta.get(EXAMPLE_VALUE)
        env[node] = new
        self.records.append(FusionRecord(
            node.name, describe_node(node, self.graph_module), kind, rule_name,
            [m.name for m in made], reason, names, new.name if isinstance(new, fx.Node) else "",
            shape_text(node.meta.get(EXAMPLE_VALUE), kind != "shared")))


def _draw_into_own_copy(entry: RuleEntry | None, group: FusionGroup, builder: GraphBuilder,
                        env: dict[fx.Node, Any]) -> tuple[fx.Node | None, str]:
    """A draw into a shared tensor, into each model's own copy::

        t.normal_()         -> own = t expanded to [N, ...], cloned; own.normal_()
        t.bernoulli_(p_n)   -> the rule's draw into own, each model at its own p_n

    A per-model argument goes to the op's rule: the plain method would draw every model
    at model 0's value."""
    node = group.node
    own = _per_model_copy(node, group, builder, env)
    if not group.per_model:
        return builder.method(node.target, own, *group.args[1:], **group.kwargs), ""
    return _apply_rule(entry, FusionGroup(node, group.nodes, (own, *group.args[1:]),
                                          group.kwargs, group.module), builder)


def _apply_rule(entry: RuleEntry | None, group: FusionGroup,
                builder: GraphBuilder) -> tuple[fx.Node | None, str]:
    """The node's rule applied: its fused node, or None and why it is not fused."""
    node, module = group.node, group.module
    if entry is None:
        reason = f"no fusion rule for {public_name(target_name(node))}"
        if node.op == "call_module":
            reason = f"no fusion rule for module {type(module).__name__}"
            if parametrize.is_parametrized(module):
                reason = (f"module {type(module).__name__} is parametrized "
                          f"(torch.nn.utils.parametrize: its "
                          f"{', '.join(module.parametrizations)} computed on every access)")
        return None, reason
    builder.current_rule = entry.name
    try:
        return entry.rule(group, builder), ""
    except NotFusable as exc:
        return None, str(exc)
    except FusionError:
        raise
    except Exception as exc:  # a bug in a rule must still name the user's node
        raise FusionError(
            f"internal error in fusion rule `{entry.name}` at {describe_node(node)}: "
            f"{plain_message(exc)}. Please report this with the model."
        ) from exc


def _inplace_on_shared(node: fx.Node, group: FusionGroup, builder: GraphBuilder) -> bool:
    """An in-place write into a value all models share (the caller decides whether a
    per-model operand makes that a problem)."""
    if not node_writes_in_place(node) or not group.args:
        return False
    written = node.args[0]
    return isinstance(written, fx.Node) and isinstance(
        written.meta.get(EXAMPLE_VALUE), torch.Tensor) and not builder.is_batched(group.args[0])


def _per_model_copy(node: fx.Node, group: FusionGroup, builder: GraphBuilder,
                    env: dict[fx.Node, Any]) -> fx.Node:
    """Each model's own copy of the shared tensor ``node`` writes into, ``[N, ...]``; later
    reads of that tensor (through ``env``) read the copy."""
    own = builder.method("clone", builder.broadcast(group.args[0]),
                         memory_format=torch.contiguous_format)
    env[node.args[0]] = own
    return own


#: Ops whose result is a new tensor, aliasing nothing: a per-model write into one can go
#: into a per-model copy.
_FRESH_FUNCTIONS = {torch.zeros, torch.ones, torch.full, torch.empty, torch.zeros_like,
                    torch.ones_like, torch.full_like, torch.empty_like, torch.arange,
                    torch.tensor, torch.eye, torch.clone}
_FRESH_METHODS = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "clone"}


def _fresh_and_unaliased(node: fx.Node, position: dict[fx.Node, int]) -> bool:
    """Is ``node``'s written tensor one forward created (:data:`_FRESH_FUNCTIONS`) that no
    earlier node could hold a view of (its earlier users are writes whose results go
    unused)?  Then a per-model copy of it stands for it exactly; a view of an input or
    a weight written in place would have to change what it views, too."""
    written = node.args[0]
    fresh = (written.op == "call_function" and written.target in _FRESH_FUNCTIONS) or (
        written.op == "call_method" and written.target in _FRESH_METHODS)
    if not fresh:
        return False
    return all(position[user] > position[node] or (
        node_writes_in_place(user) and user.args[0] is written and not user.users)
        for user in written.users if user is not node)


def _map_pair(value: Any, example: Any, fn: Any) -> Any:
    """Map ``fn(leaf, example_leaf)`` over the output structure (tuples, lists, dicts)."""
    if isinstance(value, (tuple, list)) and isinstance(example, (tuple, list)) \
            and len(value) == len(example):
        return type(value)(_map_pair(v, e, fn) for v, e in zip(value, example))
    if isinstance(value, dict) and isinstance(example, dict):
        return {k: _map_pair(v, example.get(k), fn) for k, v in value.items()}
    return fn(value, example)


# ------------------------------------------------------------------------------ differing ops

def fuse_differing_op(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """The node whose op differs per model (``meta[DIFFERING_OPS]``): each model's own op on
    its slice (:func:`~hftc.lowering.runtime.differing_ops.differing_elementwise`); a shared input
    is expanded first, so that each model applies its op to the values it sees."""
    node = group.node
    ops = tuple(node.meta[DIFFERING_OPS])
    x = group.args[0] if group.args else group.kwargs["input"]
    x = builder.broadcast(x)
    training = builder.training_flag(group) if node.op == "call_module" else True
    return builder.call(rt_differing_ops.differing_elementwise, x, ops, training)


def _aliases_written_later(node: fx.Node) -> bool:
    """Does anything write in place into ``node``'s value, or a view of it, later in the
    graph (``y = act(x); y.mul_(2)``)?"""
    views = {"view", "reshape", "flatten", "unsqueeze", "squeeze", "transpose", "permute",
             "narrow", "expand", "view_as", "unflatten", "t", "contiguous"}
    stack, seen = [node], set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        for user in value.users:
            if node_writes_in_place(user) and user.args and user.args[0] is value:
                return True
            name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
            if name in views or name == "getitem":
                stack.append(user)
    return False


def check_differing_op(node: fx.Node) -> str | None:
    """Why the differing op at ``node`` cannot run exactly, or None.  Where some models'
    op writes in place and others' does not, the fused result is a new tensor for all:
    exact unless forward later writes in place into that result (which, in the in-place
    models, would write into their input too)."""
    ops = node.meta[DIFFERING_OPS]
    inplace = [rt_differing_ops.writes_in_place(op) for op in ops]
    if any(inplace) and not all(inplace) and _aliases_written_later(node):
        return ("some models' op writes in place into its input and others' does not, and "
                "forward writes in place into the result later")
    example = node.meta.get(EXAMPLE_VALUE)
    if not isinstance(example, torch.Tensor):
        return "its result is not a tensor"
    return None
