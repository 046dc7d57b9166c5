"""Autotuning: time each fused op's lowerings on the real shapes, on the real device.

``hftc.fuse(models, autotune=True)``: when the fused forward is compiled (first
call per mode and input signature), :func:`autotune_graph` walks the fused graph
on the real inputs and, at each node that calls a tunable kernel::

    candidates = kernel's lowerings(args)        conv: grouped, grouped_channels_last,
                                                 pointwise_bmm, shared_im2col, loop ...
    for each: forward (+ backward when training) on the node's real inputs,
              interleaved round by round, median time
    drop a candidate whose output differs from the cost model's choice
    node.kwargs["lowering"] = the fastest, if it beats the cost model's
                              choice by timing.MARGIN, else the cost model's

``loop`` (N separate calls, what the serial loop runs) is always a candidate,
so a tuned op is never slower than the N ops it replaces, as timed (within the
margin).  Without autotune each kernel takes its cost model's choice (the first
of its lowerings).

Choices are cached in memory and in a JSON file (``$HFTC_CACHE_DIR/autotune.json``,
else ``$XDG_CACHE_HOME/hftc/``, else ``~/.cache/hftc/``), keyed by the device,
the torch version and thread count, the kernel, every argument's shape, strides
and dtype and whether a backward was timed: a second process (the next trial
of a sweep) with the same shapes times nothing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import operator
import time
import warnings
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils import _pytree as pytree

from .. import ir
from . import layout, timing
from .check import gradient_tolerance, input_copies, lowering_tolerance, preserved_state
from .runtime.memory import peak_memory
from .runtime.one_by_one import OneByOne, plain_output
from .runtime.tuning import lowerings_of
from .timing import (
    cache_path,
    choose,
    describe_values,
    device_key,
    lookup_entry,
    measure,
    medians,
    store_entry,
    synchronize,
)

#: Seconds of work per timed measurement (repeats are added until it is reached).
_TARGET_S = 0.004
#: The whole-forward candidates get up to this many times ``ROUNDS`` rounds while the
#: fastest two are closer than ``_CLOSE``: a whole step is long, and a noisy machine moves
#: single rounds far more than the margin.
_MORE_ROUNDS = 3
_CLOSE = 0.05
#: After each block of ``ROUNDS`` rounds, a whole-forward candidate this much (a
#: fraction) slower than the fastest median is timed no more: it cannot be chosen, and six
#: candidates of a long step timed to the end took minutes (docs/DESIGN_NOTES.md).
_DROP = 0.10


@dataclass
class LoweringChoice:
    """What autotune chose for one fused node, and the medians it chose from."""

    node: str
    kernel: str
    chosen: str
    default: str
    #: lowering -> median seconds of one forward (+ backward) call
    times: dict[str, float] = field(default_factory=dict)
    cached: bool = False
    rejected: list[str] = field(default_factory=list)
    #: the whole forward's candidates: name -> peak MiB allocated over one forward
    #: (+ backward), where it could be measured
    peaks: dict[str, float] = field(default_factory=dict)
    #: the lowering this op's timing alone chose, where the whole forward then ran
    #: faster with the cost model's lowerings (``chosen`` is then the cost model's)
    overruled: str | None = None

    def __str__(self) -> str:
        timings = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in self.times.items())
        if self.peaks:
            timings += "; peak " + ", ".join(f"{k} {v:.4g} MiB" for k, v in self.peaks.items())
        source = "cache" if self.cached else timings
        note = (f"; rejected (failed, or outputs or gradients differ): {self.rejected}"
                if self.rejected else "")
        if self.overruled is not None:
            note += (f"; {self.overruled} alone, but the whole forward ran faster with the "
                     f"cost model's lowerings")
        return (f"{self.node:<24} {self.kernel:<15} {self.chosen:<22} "
                f"(cost model: {self.default}; {source}{note})")


# --------------------------------------------------------------------------- timing


def _same(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return False
    scale = b.abs().max().item() + 1.0 if b.numel() else 1.0
    return b.numel() == 0 or (a - b).abs().max().item() <= lowering_tolerance(b) * scale


class _Candidate:
    """One lowering of one node, runnable on that node's inputs."""

    def __init__(self, kernel: Callable[..., Tensor], name: str, args: Sequence[Any],
                 kwargs: dict[str, Any], grad_flags: Sequence[bool], grad_out: Tensor | None):
        self.kernel, self.name = kernel, name
        self.args, self.kwargs = args, {**kwargs, "lowering": name}
        self.grad_flags, self.grad_out = grad_flags, grad_out
        self.repeats = 1

    def run(self) -> Tensor:
        return self.run_with_gradients()[0]

    def run_with_gradients(self) -> tuple[Tensor, list[Tensor | None]]:
        """The output and (given ``grad_out``) the gradients of the flagged arguments."""
        if self.grad_out is None:
            with torch.no_grad():
                return self.kernel(*self.args, **self.kwargs), []
        leaves = [a.detach().requires_grad_() if flag else a
                  for a, flag in zip(self.args, self.grad_flags)]
        with torch.enable_grad():
            y = self.kernel(*leaves, **self.kwargs)
            y.backward(self.grad_out)
        return y.detach(), [a.grad for a, flag in zip(leaves, self.grad_flags) if flag]


def tune_call(kernel: Callable[..., Tensor], args: Sequence[Any], kwargs: dict[str, Any],
              grad_flags: Sequence[bool], *, node: str = "?",
              path: Path | None = None) -> LoweringChoice:
    """Time ``kernel``'s lowerings on these arguments and return the fastest, or the
    cost model's choice unless another beats it by ``timing.MARGIN`` (cached)."""
    names = lowerings_of(kernel)(*args, **kwargs)
    backward = any(grad_flags)
    device = next(a.device for a in args if isinstance(a, Tensor))
    # "op-2": before ``grouped`` converted a channels-last map to NCHW (conv.conv).
    key = json.dumps([device_key(device), "op-2", kernel.__name__, describe_values(list(args)),
                      {k: describe_values(v) for k, v in sorted(kwargs.items())},
                      [bool(f) for f in grad_flags], names])
    path = path or cache_path()
    choice = LoweringChoice(node, kernel.__name__, names[0], names[0])
    if len(names) == 1:
        return choice
    entry = lookup_entry(key, path)
    if entry is not None and entry["chosen"] in names and set(entry["times"]) <= set(names):
        choice.times, choice.cached = entry["times"], True
        choice.chosen = _pick(choice.times, names[0]) if names[0] in choice.times \
            else entry["chosen"]
        return choice

    grad_out = None
    reference = _Candidate(kernel, names[0], args, kwargs, grad_flags, None).run()
    if backward:
        generator = torch.Generator(device=device).manual_seed(0)
        grad_out = torch.randn(reference.shape, dtype=reference.dtype, device=device,
                               generator=generator)
    candidates, reference_grads = [], None
    for name in names:
        candidate = _Candidate(kernel, name, args, kwargs, grad_flags, grad_out)
        synchronize(device)
        start = time.perf_counter()
        # The warm-up run, checked against the cost model's output and gradients.
        out, grads = candidate.run_with_gradients()
        synchronize(device)
        elapsed = time.perf_counter() - start
        if reference_grads is None:
            reference_grads = grads
        if not (_same(out, reference) and _same_gradients(grads, reference_grads)):
            choice.rejected.append(name)
            warnings.warn(f"hftc autotune: lowering {name!r} of node {node} ({kernel.__name__}) "
                          f"gave other outputs or gradients than {names[0]!r}; it is not "
                          f"used", stacklevel=2)
            continue
        candidate.repeats = max(1, min(50, int(_TARGET_S / max(elapsed, 1e-7))))
        candidates.append(candidate)
    times = measure({c.name: c.run for c in candidates}, device, rounds=timing.ROUNDS,
                    repeats={c.name: c.repeats for c in candidates})
    choice.times = medians(times)
    choice.chosen = _pick(choice.times, names[0])
    store_entry(key, {"chosen": choice.chosen, "times": choice.times}, path)
    return choice


def _pick(times: dict[str, float], default: str) -> str:
    """An op's lowering from its median times: :func:`~hftc.lowering.timing.choose`'s
    rule, the cost model's choice the default."""
    return choose(times, default)


# --------------------------------------------------------------------------- the graph



def autotune_graph(graph: fx.Graph, module: torch.nn.Module, inputs: Sequence[Any], *,
                   backward: bool, path: Path | None = None) -> list[LoweringChoice]:
    """Run ``graph`` once on ``inputs`` (no autograd) and set each tunable node's lowering.

    ``module`` is what the generated code calls ``self`` (the FusedModule).  Values
    are freed after their last use, so tuning needs the memory of one inference
    forward.  ``backward`` times forward + backward (training), else forward only.
    Returns the choices in graph order.
    """
    last_use: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for source in node.all_input_nodes:
            last_use[source] = node
    env: dict[fx.Node, Any] = {}
    needs_grad: set[fx.Node] = set()
    placeholders = iter(inputs)
    choices = []

    def load(arg: Any) -> Any:
        return fx.node.map_arg(arg, lambda n: env[n])

    with torch.no_grad():
        for node in graph.nodes:
            if node.op == "output":
                break
            if node.op == "placeholder":
                value = next(placeholders)
                flag = isinstance(value, Tensor) and value.requires_grad
            elif node.op == "get_attr":
                value = operator.attrgetter(node.target)(module)
                flag = isinstance(value, Tensor) and value.requires_grad
            else:
                args, kwargs = load(node.args), load(node.kwargs)
                flag = backward and any(n in needs_grad for n in node.all_input_nodes)
                if node.op == "call_function" and lowerings_of(node.target) \
                        and node.kwargs.get("lowering") is None:
                    flags = [backward and isinstance(a, fx.Node) and a in needs_grad
                             for a in node.args]
                    choice = tune_call(node.target, args, kwargs, flags, node=node.name,
                                       path=path)
                    node.kwargs = {**node.kwargs, "lowering": choice.chosen}
                    kwargs = {**kwargs, "lowering": choice.chosen}
                    choices.append(choice)
                if node.op == "call_function":
                    value = node.target(*args, **kwargs)
                elif node.op == "call_method":
                    value = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    value = module.get_submodule(node.target)(*args, **kwargs)
            env[node] = value
            if flag:
                needs_grad.add(node)
            for source in node.all_input_nodes:
                if last_use.get(source) is node:
                    del env[source]
    return choices


# --------------------------------------------------------------------------- the whole model


def rng_state(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.random.get_rng_state()


@dataclass
class ProgramChoice:
    """How the whole forward runs: the fused program (with autotune's per-op lowerings,
    or with the cost model's: ``forward``) or the models one by one, and in which input
    layout (``None``: as given; ``"channels_last"``: :mod:`.layout`).

    ``layout_shapes``: the feature maps' per-sample shapes the layout was tuned and
    checked on; inputs of other shapes run as given (model code that calls ``.view()``
    on a map can work on channels-last maps of one size and not of another)."""

    one_by_one: OneByOne | None = None
    layout: str | None = None
    layout_shapes: tuple | None = None
    #: peak bytes of one forward (+ backward) (:func:`.heap.peak_memory`)
    peak: int | None = None
    #: the fused program to run instead of the one with autotune's per-op choices: the
    #: same graph with the cost model's lowerings (:func:`cost_model_graph`)
    forward: Callable[..., Any] | None = None

    @property
    def name(self) -> str:
        # "model_loop": one by one's public spelling (fused.plan, the disk cache)
        run = ("model_loop" if self.one_by_one is not None
               else "cost_model" if self.forward is not None else "fused")
        return run if self.layout is None else f"{run}+{self.layout}"


def cost_model_graph(graph: fx.Graph, choices: Sequence[LoweringChoice]) -> fx.Graph | None:
    """A copy of ``graph`` with the cost model's lowering at each node where autotune's
    timing of the op alone chose another (``None`` if it chose none)::

        graph:       conv(..., lowering='loop')     conv_1(..., lowering='grouped_channels_last')
        the copy:    conv(..., lowering='grouped')  conv_1(..., lowering='grouped')

    An op timed alone is not the op in its program: what its output's layout costs the
    next op is not in its time, and choices that each win alone can lose together.
    ResNet-18 at N = 4 on one CPU core: two channels-last convs, three one-by-one fallbacks
    and an im2col stem, each faster alone, made the step 1.39-1.55 s where the cost
    model's took 1.16-1.27 s.  :func:`choose_program` times this program beside
    autotune's, so tuning ends at most ``timing.MARGIN`` slower than not tuning, as timed
    (the cost model's program must win by that margin to replace autotune's)."""
    defaults = {c.node: c.default for c in choices if c.chosen != c.default}
    if not defaults:
        return None
    copy = deepcopy(graph)
    for node in copy.nodes:
        if node.name in defaults:
            node.kwargs = {**node.kwargs, "lowering": defaults[node.name]}
    return copy


def run_program(fused: torch.nn.Module, program_forward: Callable[..., Any],
                how: ProgramChoice, values: Sequence[Any], batched: Sequence[bool]) -> Any:
    """One forward of the fused module as ``how`` says."""
    relayout = how.layout is not None and layout.sample_shapes(values, batched) == \
        how.layout_shapes
    if relayout:
        values = layout.to_layout(values, batched)
    if how.one_by_one is not None:
        out = how.one_by_one(fused, values, batched)
    else:
        out = (how.forward or program_forward)(fused, *values)
    return layout.contiguous_outputs(out) if relayout else out


def program_candidates(fused: torch.nn.Module, program_forward: Callable[..., Any],
                       values: Sequence[Any], batched: Sequence[bool], *, backward: bool,
                       channels_last: bool = True,
                       cost_model: Callable[..., Any] | None = None,
                       one_by_one: bool = True,
                       ) -> tuple[dict[str, ProgramChoice], list[str]]:
    """The ways to run the whole forward on these inputs whose outputs (and parameter
    gradients) equal the fused program's (the fused program as given first), and the
    names of those that failed or differed::

        fused program | with the cost model's lowerings (``cost_model``, if given)
                      | the models one by one (:mod:`.one_by_one`)
          x  inputs as given | feature maps channels-last (:mod:`.layout`)

    Channels-last only where ``channels_last`` (:func:`.layout.safe`); where not, no
    models one by one on inputs the caller laid out channels-last either.  Not one by
    one at all without ``one_by_one`` (``strategy="fused"``).
    Each runs once, forward (+ parameter gradients when ``backward``), and its peak
    memory is measured (``ProgramChoice.peak``); the caller keeps buffers and the RNG
    (:func:`preserved_state`)."""
    default = ProgramChoice()
    device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
    rng = rng_state(device)
    # Each candidate on its own copy of the inputs: a forward may write into them.
    (fused_out, fused_grads), default.peak = peak_memory(
        lambda: run_tuning_step(fused, program_forward, default, input_copies(values), batched,
                          backward), device)
    # A program that draws random numbers (dropout) gives the others other draws:
    # then only the shapes can be compared.
    random = not torch.equal(rng, rng_state(device))
    if not plain_output(fused_out):
        return {default.name: default}, []
    try:
        # The loop runs the models' own modules, which on inputs the caller laid out
        # channels-last meet what ``channels_last`` rules out (hftc's kernels do not).
        loop = OneByOne(fused) if one_by_one and (
            channels_last or not layout.given(values, batched)) else None
    except Exception:  # noqa: BLE001 - a model the loop cannot run keeps the fused program
        loop = None
    shapes = layout.sample_shapes(values, batched)
    layouts = [None] + ([ir.CHANNELS_LAST]
                        if channels_last and layout.applies(values, batched) else [])
    valid, rejected = {default.name: default}, []
    fused_leaves = pytree.tree_leaves(fused_out)
    runs = [(None, None)] + ([(None, cost_model)] if cost_model is not None else []) \
        + ([(loop, None)] if loop is not None else [])
    for run, forward in runs:
        for lay in layouts:
            how = ProgramChoice(run, lay, shapes if lay is not None else None, forward=forward)
            if how.name in valid:
                continue
            try:
                (out, grads), how.peak = peak_memory(
                    lambda how=how: run_tuning_step(fused, program_forward, how,
                                              input_copies(values), batched, backward), device)
                leaves = pytree.tree_leaves(out)
            except Exception:  # noqa: BLE001 - e.g. model code that .view()s a channels-last map
                rejected.append(how.name)
                continue
            # Gradients too: torch's CPU norms computed some wrong for channels-last
            # gradients with odd strides (layout.canonical_grad), outputs right.
            if len(leaves) == len(fused_leaves) and all(
                    isinstance(a, Tensor) and a.shape == b.shape and a.dtype == b.dtype
                    and (random or _same(a.detach(), b.detach()))
                    for a, b in zip(leaves, fused_leaves)) and (
                    random or _close_gradients(grads, fused_grads)):
                valid[how.name] = how
            else:
                rejected.append(how.name)
    return valid, rejected


def run_tuning_step(fused: torch.nn.Module, program_forward: Callable[..., Any], how: ProgramChoice,
              values: Sequence[Any], batched: Sequence[bool], backward: bool,
              ) -> tuple[Any, tuple[Tensor | None, ...]]:
    """A forward as ``how`` says, and the parameters' gradients when ``backward`` (else
    none)."""
    params = [p for p in fused.parameters() if p.requires_grad]
    grads: tuple[Tensor | None, ...] = ()
    with torch.enable_grad() if backward and params else torch.no_grad():
        with ir.modes_restored_on_error():  # a candidate may fail (and be dropped)
            out = run_program(fused, program_forward, how, values, batched)
        if backward and params:
            leaves = [t for t in pytree.tree_leaves(out)
                      if isinstance(t, Tensor) and t.requires_grad]
            if leaves:
                grads = torch.autograd.grad(leaves, params, _output_gradients(leaves),
                                            allow_unused=True)
    return out, grads


def _output_gradients(leaves: Sequence[Tensor]) -> list[Tensor]:
    """Random gradients for a forward's outputs, the same at every call (seeded).

    Not the gradient of the outputs' sum: through a training-mode batch norm that one is
    constant over the batch, and the norm's backward cancels it to rounding noise.  On
    ResNet-18 (N = 2, float32) the fused program's and the loop's parameter gradients of
    the sum then differed by up to 10% of their largest element, and both were as far
    from float64's, where with the real loss or random output gradients they agree.
    Every whole-forward candidate was rejected for a difference that was noise."""
    generator = torch.Generator(device=leaves[0].device).manual_seed(0)
    return [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=generator)
            for t in leaves]


def _same_gradients(grads: Sequence[Tensor | None], want: Sequence[Tensor | None]) -> bool:
    return len(grads) == len(want) and all(
        (a is None) == (b is None) and (a is None or _same(a, b)) for a, b in zip(grads, want))


def _close_gradients(grads: Sequence[Tensor | None], want: Sequence[Tensor | None]) -> bool:
    """Whole-forward candidates' parameter gradients against the fused program's: each
    within :func:`~hftc.lowering.check.gradient_tolerance` of it in norm, relative to its norm.

    Not element by element, as for one op (:func:`_same_gradients`): two equal programs
    that round differently drift apart through a deep network, and most of all in the
    elements a training-mode batch norm's backward cancels.  ResNet-18 at N = 2 in
    float32: the fused program's and the one-by-one weight gradients differed by
    up to 1% of their largest element (each was 0.5% from float64's with the real loss),
    and by at most 0.2% in norm.  The bugs this check is for (a kernel's wrong gradient
    for some memory layout) are off by far more than that."""
    def close(a: Tensor, b: Tensor) -> bool:
        if a.shape != b.shape:
            return False
        diff, norm = (a - b).double().norm().item(), b.double().norm().item()
        return diff <= gradient_tolerance(b) * norm or diff == 0.0

    return len(grads) == len(want) and all(
        (a is None) == (b is None) and (a is None or close(a, b)) for a, b in zip(grads, want))


def choose_program(fused: torch.nn.Module, program_forward: Callable[..., Any],
                   values: Sequence[Any], batched: Sequence[bool], *, backward: bool,
                   key_source: str, path: Path | None = None, channels_last: bool = True,
                   cost_model: Callable[..., Any] | None = None, one_by_one: bool = True,
                   ) -> tuple[ProgramChoice, LoweringChoice]:
    """Time the whole forward's :func:`program_candidates` on the real inputs, forward
    (+ backward), interleaved over rounds (more while the fastest two are close; after
    each block of rounds a candidate ``_DROP`` behind the fastest is timed no more).  A
    candidate other than the fused program as given is taken only if it is faster by
    ``timing.MARGIN`` (:func:`~hftc.lowering.timing.choose`).  ``key_source`` (the
    generated code) identifies the program in the disk cache.  ``channels_last``: whether
    the inputs may be laid out channels-last (:func:`.layout.safe`).  ``cost_model``: the
    program compiled from :func:`cost_model_graph`, a candidate too (the chosen
    ``ProgramChoice.forward`` is then it).  ``one_by_one=False`` (``strategy="fused"``, or
    ``checkpoint=``: the fused program is what is checkpointed): the N models one by one
    are no candidate."""
    choice = LoweringChoice("<whole model>", "forward", "fused", "fused")
    device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
    # "program-5": before the cost model's program was a candidate.  "program-4": before
    # the candidates' gradients were checked for random output gradients
    # (_output_gradients).  "program-3": choices cached before the whole
    # forward was timed with freed memory
    # kept (fused.py), when a fused program paid page faults its steps do not, before
    # ties went to the smaller peak, and before the parameters' shapes were in the key
    # (the generated code does not name them: models with 1x1 and 3x3 convolutions
    # shared a choice), are retimed.
    key = json.dumps([device_key(device), "program-5", fused.num_models,
                      hashlib.sha1(key_source.encode()).hexdigest(),
                      describe_values([v for v in values if isinstance(v, Tensor)]), list(batched),
                      backward, [list(p.shape) for p in fused.parameters()]]
                     + ([] if one_by_one else ["no model_loop"]))  # (the key as cached)
    path = path or cache_path()
    entry = lookup_entry(key, path)
    wanted = entry.get("chosen") if entry is not None else None
    run, _, lay = wanted.partition("+") if isinstance(wanted, str) else ("", "", "")
    if run == "fused" or (run == "model_loop" and one_by_one) or (
            run == "cost_model" and cost_model is not None):
        if (lay == "" and (run != "model_loop" or channels_last
                           or not layout.given(values, batched))
                or (lay == ir.CHANNELS_LAST and channels_last)):
            with contextlib.suppress(Exception):  # a model the loop cannot run: tune again
                how = ProgramChoice(OneByOne(fused) if run == "model_loop" else None,
                                    lay or None, layout.sample_shapes(values, batched),
                                    forward=cost_model if run == "cost_model" else None)
                choice.chosen, choice.times, choice.cached = wanted, entry["times"], True
                return how, choice

    with preserved_state(fused):
        valid, choice.rejected = program_candidates(fused, program_forward, values, batched,
                                                    backward=backward,
                                                    channels_last=channels_last,
                                                    cost_model=cost_model,
                                                    one_by_one=one_by_one)
        if len(valid) == 1:
            return ProgramChoice(), choice
        times: dict[str, list[float]] = {name: [] for name in valid}
        if device.type == "cpu":
            # One untimed round: measuring the peaks handed the heap's free memory
            # back, and the first timed round would fault it in again.
            for how in valid.values():
                run_tuning_step(fused, program_forward, how, values, batched, backward)
        timed = list(valid)
        for _extra in range(_MORE_ROUNDS):
            measure({name: functools.partial(run_tuning_step, fused, program_forward,
                                             valid[name], values, batched, backward)
                     for name in timed}, device, rounds=timing.ROUNDS, times=times)
            now = medians({name: times[name] for name in timed})
            fastest = min(now.values())
            timed = [name for name in timed if now[name] <= (1 + _DROP) * fastest]
            close = sorted(now[name] for name in timed)
            if len(close) < 2 or close[1] > (1 + _CLOSE) * close[0]:
                break  # a clear winner
    choice.times = medians(times)
    choice.peaks = {k: how.peak / 2**20 for k, how in valid.items() if how.peak is not None}
    choice.chosen = _pick_program(choice.times, {k: how.peak for k, how in valid.items()})
    store_entry(key, {"chosen": choice.chosen, "times": choice.times, "peaks": choice.peaks}, path)
    return valid[choice.chosen], choice


def _pick_program(times: dict[str, float], peaks: dict[str, int | None]) -> str:
    """The whole forward's program from its candidates' median times and peak bytes:
    :func:`~hftc.lowering.timing.choose`'s rule (the fused program as given the default;
    a tie on time to the smaller footprint)."""
    return choose(times, "fused", peaks)


__all__ = ["LoweringChoice", "ProgramChoice", "autotune_graph", "cache_path",
           "choose_program", "cost_model_graph", "device_key", "lookup_entry", "store_entry",
           "synchronize",
           "program_candidates", "run_program", "tune_call"]
