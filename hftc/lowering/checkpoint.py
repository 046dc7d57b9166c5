"""Activation checkpointing of the fused forward: ``hftc.fuse(models, checkpoint=k)``.

The fused graph (all N models at once) is cut into ``k`` consecutive segments; each runs
under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, so only the
values that cross a cut stay alive for backward and each segment's own activations are
recomputed when backward reaches it (Chen et al.'s sqrt(n) schedule for
``checkpoint=True``)::

    before:  forward(self, x):  a = f1(x); b = f2(a); c = f3(b); d = f4(c); return d
    after:   forward(self, x):  (b,) = checkpoint(segment_0, self, x)     # f1, f2
                                (d,) = checkpoint(segment_1, self, b)     # f3, f4
                                return d

What keeps the recomputation exact:

- random draws (dropout): the checkpoint restores the RNG state it saw (its default
  ``preserve_rng_state=True``; hftc draws from torch's global generators), so the
  recomputed masks are the forward's;
- buffers a segment changes in place (BatchNorm's running statistics and its
  ``num_batches_tracked``): the recomputation runs on the values the forward saw and puts
  back the values it found, so no statistic moves twice;
- no cut is placed where a later segment would change, in place, a value an earlier
  segment made (``relu_``, ``inplace=True``): the recomputation would read it changed.
  A segment that changes one of its inputs in place all the same (inside an op hftc
  cannot see into) is refused on the forward that does it (``FusionArgumentError``).

Where the program runs the N models one by one (the first-call check's fallback,
autotune's models one by one) nothing is checkpointed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from ..errors import FusionArgumentError
from ..ir import INPLACE_OPERATORS
from .codegen import compile_graph

_COMPUTE = ("call_function", "call_method", "call_module")

def check_option(checkpoint_option: Any) -> int | bool:
    """``checkpoint=`` of ``hftc.fuse``: False, True (sqrt(ops) segments) or a count >= 1."""
    if isinstance(checkpoint_option, bool):
        return checkpoint_option
    if isinstance(checkpoint_option, int) and checkpoint_option >= 1:
        return checkpoint_option
    raise FusionArgumentError(
        f"checkpoint must be False, True (about sqrt(#ops) segments) or the number of "
        f"segments to recompute in backward (an int >= 1), got {checkpoint_option!r}")


def _mutated_argument(node: fx.Node) -> fx.Node | None:
    """The value ``node`` changes in place, where its op says so (else None)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):  # torch.export's ATen ops: the schema says
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, fx.Node):
                    return value
        return None
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    inplace = (node.kwargs.get("inplace") is True
               or (node.op in ("call_method", "call_function") and name.endswith("_")
                   and not name.startswith("_"))
               or target in INPLACE_OPERATORS)
    if isinstance(node.kwargs.get("out"), fx.Node):
        return node.kwargs["out"]
    first = node.args[0] if node.args else node.kwargs.get("input")
    return first if inplace and isinstance(first, fx.Node) else None


def plan_segments(graph: fx.Graph, segments: int | bool) -> list[list[fx.Node]]:
    """The graph's compute nodes in consecutive segments: ``segments`` of about equal op
    count (``True``: round(sqrt(ops))), each cut moved forward past any op that changes
    in place a value made before the cut."""
    compute = [n for n in graph.nodes if n.op in _COMPUTE]
    if not compute:
        return []
    count = max(1, round(math.sqrt(len(compute)))) if segments is True else int(segments)
    count = min(count, len(compute))
    position = {n: i for i, n in enumerate(compute)}
    # A cut at index c (between compute[c - 1] and compute[c]) is unsafe where an op at or
    # after c changes in place a value made before c (or a placeholder: before 0).
    unsafe = set()
    for n in compute:
        mutated = _mutated_argument(n)
        if mutated is None or mutated.op == "get_attr":  # buffers: restored (see module doc)
            continue
        made = position.get(mutated, -1)
        unsafe.update(range(made + 1, position[n] + 1))
    cuts: list[int] = []
    for s in range(1, count):
        c = round(s * len(compute) / count)
        while c in unsafe and c < len(compute):
            c += 1
        if 0 < c < len(compute) and (not cuts or c > cuts[-1]):
            cuts.append(c)
    bounds = [0, *cuts, len(compute)]
    return [compute[a:b] for a, b in zip(bounds, bounds[1:])]


def _buffers_used(nodes: Sequence[fx.Node], buffer_names: set[str]) -> tuple[list[str], list[str]]:
    """The buffers ``nodes`` may change in place (restored after a recomputation) and the
    others they read (watched: a change the first list missed is refused).

    ATen's batch norm writes its running statistics without bumping their version
    counter, so what may change is read off the graph: a buffer an op changes in place
    (``add_``, ``out=``), or one given to a submodule or to one of hftc's runtime
    functions (its batch norm updates the statistics)."""
    restored: dict[str, None] = {}
    read: dict[str, None] = {}
    for n in nodes:
        mutated = _mutated_argument(n)
        hftc_function = n.op == "call_function" and getattr(
            n.target, "__module__", "").startswith("hftc.")
        if n.op == "call_module":
            prefix = f"{n.target}."
            restored.update(dict.fromkeys(b for b in buffer_names if b.startswith(prefix)))
        for v in n.all_input_nodes:
            if v.op == "get_attr" and v.target in buffer_names:
                (restored if hftc_function or v is mutated else read)[v.target] = None
    return list(restored), [b for b in read if b not in restored]


class Segment:
    """One segment as a function ``run(self, *live_in) -> tuple(live_out)`` of its own."""

    def __init__(self, index: int, nodes: Sequence[fx.Node], live_in: Sequence[fx.Node],
                 live_out: Sequence[fx.Node], buffer_names: set[str]):
        self.index = index
        self.live_in = list(live_in)
        self.live_out = list(live_out)
        #: The fused graph's nodes it runs.
        self.nodes = list(nodes)
        self.ops = [n.name for n in nodes]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for v in self.live_in:
            env[v] = graph.placeholder(v.name)
        for n in nodes:
            for used in n.all_input_nodes:
                if used not in env and used.op == "get_attr":
                    env[used] = graph.node_copy(used)
            env[n] = graph.node_copy(n, lambda v: env[v])
        graph.output(tuple(env[v] for v in self.live_out))
        self.forward, self.source = compile_graph(graph, f"checkpoint segment {index}")
        self.restored_buffers, self.watched_buffers = _buffers_used(nodes, buffer_names)

    def call(self, module: torch.nn.Module, values: Sequence[Any]) -> tuple:
        """Run the segment under ``checkpoint`` (its activations recomputed in backward)."""
        restored = [module.get_buffer(k) for k in self.restored_buffers]
        before = [b.detach().clone() for b in restored]
        watched = [module.get_buffer(k) for k in self.watched_buffers]
        watched_versions = [b._version for b in watched]
        input_versions = [v._version if isinstance(v, torch.Tensor) else None for v in values]
        forward_done = False

        def run(*args: Any) -> tuple:
            if not forward_done:
                return self.forward(module, *args)
            # The recomputation: on the buffers as the forward saw them, which it then
            # puts back as it found them.
            found = [b.detach().clone() for b in restored]
            try:
                with torch.no_grad():
                    for b, value in zip(restored, before):
                        b.copy_(value)
                return self.forward(module, *args)
            finally:
                with torch.no_grad():
                    for b, value in zip(restored, found):
                        b.copy_(value)

        out = checkpoint(run, *values, use_reentrant=False)
        forward_done = True
        changed = [n.name for n, v, seen in zip(self.live_in, values, input_versions)
                   if seen is not None and v._version != seen]
        changed += [f"buffer {k}" for k, b, seen in zip(self.watched_buffers, watched,
                                                         watched_versions) if b._version != seen]
        if changed:
            raise FusionArgumentError(
                f"checkpoint segment {self.index} (nodes {self.ops[0]} ... {self.ops[-1]}) "
                f"changes `{changed[0]}` in place, so its recomputation in backward would "
                f"read the changed value; fuse with another number of segments "
                f"(checkpoint=k) or without checkpoint")
        return out


class CheckpointedForward:
    """``forward(self, *inputs)`` of a fused graph, its segments each under ``checkpoint``.

    Without gradients (``torch.no_grad``, inference) the segments run directly."""

    def __init__(self, graph: fx.Graph, segments: int | bool, buffer_names: set[str]):
        plan = plan_segments(graph, segments)
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in graph.nodes if n.op == "output")
        segment_of = {n: i for i, nodes in enumerate(plan) for n in nodes}
        self.segments: list[Segment] = []
        for i, nodes in enumerate(plan):
            inside = set(nodes)
            live_in = list(dict.fromkeys(
                v for n in nodes for v in n.all_input_nodes
                if v not in inside and v.op != "get_attr"))
            live_out = [n for n in nodes
                        if any(u is output or segment_of.get(u, i) > i for u in n.users)]
            self.segments.append(Segment(i, nodes, live_in, live_out, buffer_names))
        self.output_args = output.args[0]
        # get_attr values the output returns as they are (a buffer, a parameter).
        self.output_attrs = [n for n in output.all_input_nodes if n.op == "get_attr"]

    @property
    def source(self) -> str:
        return "\n".join(f"# checkpoint segment {s.index}: in {[v.name for v in s.live_in]}, "
                         f"out {[v.name for v in s.live_out]}\n{s.source}"
                         for s in self.segments)

    def __call__(self, module: torch.nn.Module, *inputs: Any) -> Any:
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, inputs))
        for n in self.output_attrs:
            env[n] = _get_path(module, n.target)
        grad = torch.is_grad_enabled()
        for segment in self.segments:
            values = [env[v] for v in segment.live_in]
            out = (segment.call(module, values) if grad
                   else segment.forward(module, *values))
            env.update(zip(segment.live_out, out))
        return fx.node.map_arg(self.output_args, lambda v: env[v])


def _get_path(module: torch.nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def checkpointed_forward(graph: fx.Graph, segments: int | bool, module: torch.nn.Module
                         ) -> tuple[Callable[..., Any], str]:
    """The fused graph's forward with its segments checkpointed, and its source
    (``module``: the fused module it runs on, whose buffers it restores)."""
    forward = CheckpointedForward(graph, segments, {k for k, _ in module.named_buffers()})
    return forward, forward.source


__all__ = ["CheckpointedForward", "check_option", "checkpointed_forward", "plan_segments"]
