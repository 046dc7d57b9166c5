"""The choice between the fused program and the N models one by one.

The two compute the same answers but round differently (a batched GEMM against N
GEMMs), so a choice made by timing would make the bits of a training run depend on the
machine's load and on what the disk cache holds.  Hence, as ``torch.backends.cudnn.
benchmark`` is off by default:

- ``strategy="auto"`` (the default) decides without timing: the fused program where the
  first-call check finds it computes the models' answers, else the models one by one
  (the check's fallback).  The same script gives the same bits every run.
- ``strategy="timed"`` runs each new program (per mode and input signature) whichever
  way is faster on this machine, chosen after the first-call check in one of two ways
  (below); ``fused.plan`` then says that the choice, and so the bits, may differ
  between runs.  Under ``torch.use_deterministic_algorithms(True)`` nothing is timed:
  the program runs as with ``"auto"``, and ``fused.plan`` says why.

Programs that draw no random numbers are timed on the user's own calls, at no extra
step: both ways compute the models' answers on the same tensors, so the first calls
alternate them (:class:`CallTiming`), and what is timed is each call's whole period,
from its start to the next call's (the user's backward and optimizer step included)::

    compile:   the loop's forward once on copies, buffers and RNG kept (it runs, it
               returns tensors, it draws no random numbers; else see below)
    calls:     fused, loop (warm-up: not counted), then cycles of fused, loop, loop,
               fused (a pattern of the user's calls of period 1 or 2, two micro-batches
               a step, hits both ways alike); an interval that another program's call
               interrupts is not counted, and the call runs the same way again
               (with two calls a step, the backward of both calls falls in one interval
               and only the forwards differ: what is compared is then the forwards)
    choice:    after _MIN_CYCLES or more whole cycles once the counted intervals add up
               to _BUDGET_S, or after _MAX_CYCLES: the loop if median(loop / fused per
               cycle) < 1 - timing.MARGIN, else fused; no extra step, only the trial calls
               that ran the slower way cost (``plan.seconds`` estimates it)

Programs that draw random numbers (dropout) would give other draws fused than one by
one, so that a run whose choice comes from the cache would not repeat a run that timed:
they are timed on extra steps whose draws and buffer updates are undone::

    warm-up:   fused step, loop step                     (a loop that fails: fused)
    rounds:    fused, loop | loop, fused | fused, loop ...  (order alternates: drift
               hits both), at least _MIN_ROUNDS, then until _BUDGET_S (counted from
               the warm-up) is spent or _MAX_ROUNDS: the choice costs about
               max(_BUDGET_S, 6 steps)
    choice:    the loop if median(loop / fused per round) < 1 - timing.MARGIN, else fused

Either way the choice is stored on disk (autotune's file) per device, threads, torch,
program, input shapes, N and mode: the next process times nothing.  Both ways compute
the models' answers (the loop exactly, the fused program as the check found), the
parameters, their gradients, the buffers and the optimizer state are the same tensors
either way; the extra steps are not seen: buffers (batch norm's statistics) and the RNG
are restored (:func:`~hftc.lowering.check.preserved_state`), gradients are taken with
``autograd.grad``, never into ``.grad``.

``strategy="fused"`` or ``"model_loop"`` forces one (``HFTC_STRATEGY`` sets the
default; the test suite sets ``fused``, so it tests the fused kernels and times
nothing).  ``autotune=True`` times the loop among its whole-forward candidates
(:func:`~hftc.lowering.autotune.choose_program`) instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError
from .autotune import ProgramChoice, rng_state, run_program, run_tuning_step
from .check import input_copies, preserved_state
from .runtime.one_by_one import plain_output
from .timing import (
    cache_path,
    choose,
    describe_values,
    device_key,
    lookup_entry,
    measure,
    medians,
    ratios,
    store_entry,
    synchronize,
    timing_allowed,
)

#: The strategies ``hftc.fuse(strategy=...)`` accepts; "model_loop" is the public spelling
#: of one by one (the N models each run by itself), kept as ``fused.plan.chosen`` too.
STRATEGIES = ("auto", "fused", "model_loop", "timed")
#: The environment variable that sets the default strategy (``fuse(strategy=None)``).
STRATEGY_ENV = "HFTC_STRATEGY"
#: Seconds the choice may spend, its warm-up included; at least ``_MIN_ROUNDS`` timed
#: rounds run however long a step is (two: one in each order, so drift hits both ways).
_BUDGET_S = 1.0
_MIN_ROUNDS = 2
_MAX_ROUNDS = 15
#: Timing on the user's calls (:class:`CallTiming`): one cycle of counted intervals, and
#: at most this many cycles.
_CYCLE = ("fused", "model_loop", "model_loop", "fused")
_MIN_CYCLES = 2
_MAX_CYCLES = 6
#: Calls of a program after which a timing that other programs' calls kept interrupting
#: gives up (the fused program stays, untimed).
_MAX_TRIAL_CALLS = 64
#: ``plan.reason`` while the first calls are being timed.
TIMING_CALLS = "timing the first calls"
#: ``plan.reason`` of the default, which times nothing, where the first-call check
#: compared the program with the models' own forward ...
NOT_TIMED = "checked; not timed, the same program every run"
#: ... and where it did not (``check=False``, or skipped: ``report.check`` says why).
NOT_TIMED_UNCHECKED = "not checked; not timed, the same program every run"
#: ``plan.reason`` of strategy="timed" under ``torch.use_deterministic_algorithms(True)``.
DETERMINISTIC = "not timed: torch.use_deterministic_algorithms(True)"
#: The reasons of a choice that timing made (on this run or an earlier one, the cache's).
TIMED_REASONS = ("timed", "timed on the first calls", TIMING_CALLS, "cache", "autotune")


def resolve_strategy(strategy: str | None, autotune: bool = False) -> str:
    """``strategy`` as given, or ``$HFTC_STRATEGY``, or ``"auto"``; anything else is
    refused.  With ``autotune`` (which times the loop among its candidates), ``None`` is
    ``"auto"`` whatever the environment says."""
    source = "strategy"
    if strategy is None and autotune:
        strategy = "auto"
    if strategy is None:
        strategy = os.environ.get(STRATEGY_ENV, "").strip() or "auto"
        source = f"${STRATEGY_ENV}"
    if strategy not in STRATEGIES:
        raise FusionArgumentError(
            f"{source} must be 'auto' (the fused program where the first-call check finds "
            f"it exact, else the models one by one: the same bits every run), 'timed' "
            f"(time the fused program against the models one by one on the first calls, "
            f"keep the faster), 'fused' or 'model_loop'; got {strategy!r}")
    return strategy


@dataclass
class StrategyChoice:
    """How a program runs its forward, and why (``fused.plan``)."""

    #: "fused" (the fused program) or "model_loop" (the N models one by one)
    chosen: str
    #: :data:`NOT_TIMED` (the default), :data:`DETERMINISTIC`,
    #: "timed" (extra steps), "timed on the first calls" (:class:`CallTiming`),
    #: "timing the first calls" (not decided yet: the calls alternate the two ways),
    #: "cache" (an earlier process timed it), "forced" (strategy=...),
    #: "check" (the first-call check found the fused program wrong for these inputs),
    #: "autotune" (autotune=True's whole-forward choice), "loop failed" (the models
    #: cannot run one by one: the fused program, untimed)
    reason: str
    #: candidate -> median seconds of one forward (+ backward)
    times: dict[str, float] = field(default_factory=dict)
    #: median of the per-round (per-cycle) ratios loop / fused
    ratio: float | None = None
    #: timed rounds (extra steps) or cycles of four calls (timed on the user's calls)
    rounds: int = 0
    #: seconds the choice cost: its extra steps (warm-up and timed rounds), or, timed on
    #: the user's calls, the loop's check run plus what the calls that ran the slower way
    #: took over the faster's median
    seconds: float = 0.0
    backward: bool = False

    def __str__(self) -> str:
        what = {"fused": "the fused program", "model_loop": "the models one by one"}
        if self.reason == TIMING_CALLS:
            return (f"alternates the fused program and the models one by one ({self.reason}"
                    f"; then runs the faster; chosen by timing: the bits may differ between "
                    f"runs)")
        text = f"runs {what.get(self.chosen, self.chosen)} ({self.reason}"
        if self.times:
            step = "forward + backward" if self.backward else "forward"
            text += (f": {step} fused {self.times.get('fused', float('nan')) * 1e3:.3g} ms, "
                     f"one by one {self.times.get('model_loop', float('nan')) * 1e3:.3g} ms")
            if self.ratio is not None:
                unit = "cycles" if self.reason == "timed on the first calls" else "rounds"
                text += f", median ratio {self.ratio:.3f} over {self.rounds} {unit}"
            if self.seconds:
                text += f", choice cost {self.seconds:.2f} s"
        if self.reason in TIMED_REASONS:
            text += ("; chosen by timing: the two round differently, so the bits may "
                     "differ between runs (strategy='auto' for the same bits every run)")
        return text + ")"


class CallTiming:
    """strategy="auto" timed on the user's own calls of one program (see the module
    docstring): :meth:`way` says how each call runs until the choice is made, then sets
    the program's ``how`` and ``plan`` and stores the choice."""

    def __init__(self, one_by_one_way: ProgramChoice, key: str, path: Path, backward: bool,
                 budget_s: float, setup_s: float, device: torch.device):
        self.ways: dict[str, ProgramChoice | None] = {"fused": None, "model_loop": one_by_one_way}
        self.device = device
        self.key, self.path, self.backward = key, path, backward
        self.budget_s, self.setup_s = budget_s, setup_s
        #: (way, seconds from the start of its call to the next call's), in order; the
        #: first two are the warm-ups
        self.intervals: list[tuple[str, float]] = []
        #: the call in progress: (way, its start, the fused module's call number)
        self.last: tuple[str, float, int] | None = None
        self.calls = 0

    def way(self, program: Any, call_number: int) -> ProgramChoice | None:
        """How this call (the fused module's ``call_number``-th) runs: None for the fused
        program.  The interval of the previous call counts if it was this program's and
        the call just before this one (on a GPU, once its kernels have run)."""
        synchronize(self.device)
        now = time.perf_counter()
        if self.last is not None and self.last[2] == call_number - 1:
            self.intervals.append((self.last[0], now - self.last[1]))
        self.last = None
        self.calls += 1
        if _cycles_done(self.intervals[2:], self.budget_s):
            self._decide(program)
            return program.how
        if self.calls > _MAX_TRIAL_CALLS:
            program.plan = program.report.strategy = StrategyChoice(
                "fused", "not timed: other programs' calls came between this one's",
                backward=self.backward)
            program.trial = None
            return None
        count = len(self.intervals)
        name = ("fused", "model_loop")[count] if count < 2 else \
            _CYCLE[(count - 2) % len(_CYCLE)]
        self.last = (name, now, call_number)
        return self.ways[name]

    def _decide(self, program: Any) -> None:
        timed = self.intervals[2:]
        per_cycle = _per_cycle(timed)  # a cycle's two calls of each way: one round
        chosen = choose(per_cycle, "fused")
        ratio = ratios(per_cycle, "fused")["model_loop"]
        times = medians({name: [t for n, t in timed if n == name]
                         for name in ("fused", "model_loop")})
        slower_cost = sum(max(0.0, t - times[chosen]) for n, t in self.intervals
                          if n != chosen)
        store_entry(self.key, {"chosen": chosen, "times": times, "ratio": ratio}, self.path)
        program.how = self.ways[chosen]
        program.plan = program.report.strategy = StrategyChoice(
            chosen, "timed on the first calls", times, ratio, len(timed) // len(_CYCLE),
            self.setup_s + slower_cost, self.backward)
        program.trial = None


#: :class:`StepOrder`'s way for the models one by one (forward, loss and backward each);
#: ``"in_order"`` is its public spelling (``step.order.chosen``).
ONE_BY_ONE = "in_order"


@dataclass
class StepOrder:
    """How ``hftc.compile_step`` runs an eager step for one input signature, and why
    (``step.order``): ``chosen`` is "fused" (the fused module's forward of all N models,
    one backward) or "in_order" (each model's forward, loss and backward in turn,
    :meth:`~hftc.lowering.runtime.one_by_one.OneByOne.forward_backward`).  Nothing is
    timed: the step runs the models one by one exactly where the fused module does."""

    chosen: str
    #: "the fused module runs the models one by one" (its strategy chose or forces the
    #: models one by one: the step's is the same, in the serial loop's order), "hooks on the fused
    #: parameters", or "the fused module's choice: ..." (its fused program)
    reason: str

    def __str__(self) -> str:
        what = {"fused": "the fused step", ONE_BY_ONE: "the models in order"}
        return f"runs {what[self.chosen]} ({self.reason})"


def _cycles_done(timed: Sequence[tuple[str, float]], budget_s: float) -> bool:
    """Whether ``timed`` (after the warm-ups) ends a cycle of :data:`_CYCLE` and is enough:
    _MIN_CYCLES or more that add up to ``budget_s``, or _MAX_CYCLES."""
    cycles = len(timed) // len(_CYCLE)
    return len(timed) % len(_CYCLE) == 0 and cycles >= _MIN_CYCLES and (
        sum(t for _, t in timed) >= budget_s or cycles >= _MAX_CYCLES)


def _per_cycle(timed: Sequence[tuple[str, float]]) -> dict[str, list[float]]:
    """Each way's seconds per whole cycle of ``timed`` (its calls in the cycle summed)."""
    cycles = [timed[i:i + len(_CYCLE)] for i in range(0, len(timed), len(_CYCLE))]
    return {way: [sum(t for name, t in c if name == way) for c in cycles]
            for way in ("fused", "model_loop")}


def strategy_key(fused: torch.nn.Module, values: Sequence[Any], batched: Sequence[bool],
                 backward: bool, key_source: str) -> str:
    """The disk cache's key: the device (threads, torch version), the program (its
    generated code), the inputs' shapes, strides and dtypes, N, the parameters' shapes and
    whether a backward is timed (training or eval)."""
    device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
    return json.dumps([device_key(device), "strategy-1", fused.num_models,
                       hashlib.sha1(key_source.encode()).hexdigest(),
                       describe_values([v for v in values if isinstance(v, Tensor)]),
                       list(batched), backward, [list(p.shape) for p in fused.parameters()]])


def choose_strategy(fused: torch.nn.Module, program_forward: Callable[..., Any],
                    loop: Callable[[], Any], values: Sequence[Any], batched: Sequence[bool],
                    *, backward: bool, key_source: str, path: Path | None = None,
                    budget_s: float = _BUDGET_S, on_calls: bool = True,
                    ) -> tuple[ProgramChoice | None, StrategyChoice, CallTiming | None]:
    """The fused program or the models one by one (``loop()`` makes it), as the disk cache
    says, or to be timed on the user's calls (the :class:`CallTiming` returned; where
    ``on_calls`` and the models draw no random numbers), or as timed now on copies of
    ``values`` (see the module docstring); ``None`` for the fused program."""
    start = time.perf_counter()
    path = path or cache_path()
    key = strategy_key(fused, values, batched, backward, key_source)
    entry = lookup_entry(key, path)
    if entry is not None and entry.get("chosen") in ("fused", "model_loop"):
        ratio = entry.get("ratio")
        choice = StrategyChoice(entry["chosen"], "cache", dict(entry["times"]),
                                ratio if isinstance(ratio, float) else None, backward=backward)
        if choice.chosen == "fused":
            return None, choice, None
        try:
            return ProgramChoice(loop()), choice, None
        except Exception:  # noqa: BLE001 - a loop that cannot be built: time again
            pass
    device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
    if on_calls:
        try:
            one_by_one_way = ProgramChoice(loop())
            with preserved_state(fused), torch.no_grad():
                rng = rng_state(device)
                out = run_program(fused, program_forward, one_by_one_way, input_copies(values),
                                  batched)
                draws = not torch.equal(rng, rng_state(device))
        except Exception:  # noqa: BLE001 - models that cannot run one by one keep fused
            return None, StrategyChoice("fused", "loop failed", backward=backward), None
        if not plain_output(out):  # what the loop cannot stack as the fused program does
            return None, StrategyChoice("fused", "outputs not only tensors: not timed",
                                        backward=backward), None
        if not draws:
            timing = CallTiming(one_by_one_way, key, path, backward, budget_s,
                                time.perf_counter() - start, device)
            return None, StrategyChoice("fused", TIMING_CALLS, backward=backward), timing
    copies = input_copies(values)
    fused_way = ProgramChoice()
    warm_from = time.perf_counter()
    with preserved_state(fused):
        out, _ = run_tuning_step(fused, program_forward, fused_way, copies, batched, backward)
        if not plain_output(out):  # what the loop cannot stack as the fused program does
            return None, StrategyChoice("fused", "outputs not only tensors: not timed",
                                        backward=backward), None
        del out
        try:
            one_by_one_way = ProgramChoice(loop())
            run_tuning_step(fused, program_forward, one_by_one_way, input_copies(values), batched,
                            backward)
        except Exception:  # noqa: BLE001 - models that cannot run one by one keep fused
            return None, StrategyChoice("fused", "loop failed", backward=backward), None
        ways = {name: functools.partial(run_tuning_step, fused, program_forward, way, copies,
                                        batched, backward)
                for name, way in (("fused", fused_way), ("model_loop", one_by_one_way))}
        times = measure(ways, device, rounds=_MAX_ROUNDS, min_rounds=_MIN_ROUNDS,
                        budget_s=max(0.0, budget_s - (time.perf_counter() - warm_from)))
    ratio = ratios(times, "fused")["model_loop"]
    chosen = choose(times, "fused")
    seconds = medians(times)
    store_entry(key, {"chosen": chosen, "times": seconds, "ratio": ratio}, path)
    choice = StrategyChoice(chosen, "timed", seconds, ratio, len(times["fused"]),
                            time.perf_counter() - start, backward)
    return (one_by_one_way if chosen == "model_loop" else None), choice, None


__all__ = ["DETERMINISTIC", "ONE_BY_ONE", "NOT_TIMED", "NOT_TIMED_UNCHECKED", "STRATEGIES",
           "STRATEGY_ENV", "TIMED_REASONS", "TIMING_CALLS", "CallTiming", "StepOrder",
           "StrategyChoice", "choose_strategy", "resolve_strategy", "strategy_key",
           "timing_allowed"]
