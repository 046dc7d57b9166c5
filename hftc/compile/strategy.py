"""The first-call choice between the fused program and the N models one by one.

``hftc.fuse(models)`` (``strategy="auto"``, the default): when a program is compiled
(the first call per mode and input signature), after the first-call check, the fused
forward (+ backward in training mode) is timed against the whole-model loop
(:mod:`hftc.runtime.model_loop`, what the serial loop runs, on the fused module's own
stacked tensors), and the faster is kept::

    warm-up:   fused step, loop step                     (a loop that fails: fused)
    rounds:    fused, loop | loop, fused | fused, loop ...  (order alternates: drift
               hits both), at least _MIN_ROUNDS, then until _BUDGET_S (counted from
               the warm-up) is spent or _MAX_ROUNDS: the choice costs about
               max(_BUDGET_S, 6 steps)
    choice:    the loop if median(loop / fused per round) < 1 - _MARGIN, else fused
    cache:     the choice on disk (autotune's file) per device, threads, torch,
               program, input shapes, N and mode: the next process times nothing

Both ways compute the models' answers (the loop exactly, the fused program as the check
found), the parameters, their gradients, the buffers and the optimizer state are the
same tensors either way; what the timing runs is not seen: buffers (batch norm's
statistics) and the RNG are restored (:func:`~hftc.compile.check.preserved_state`),
gradients are taken with ``autograd.grad``, never into ``.grad``.

``strategy="fused"`` or ``"model_loop"`` forces one (``HFTC_STRATEGY`` sets the
default; the test suite sets ``fused``, so it tests the fused kernels and times
nothing).  ``autotune=True`` times the loop among its whole-forward candidates
(:func:`~hftc.compile.autotune.choose_program`) instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError
from ..runtime.model_loop import plain_output
from .autotune import (
    ProgramChoice,
    _describe,
    _lookup,
    _run_step,
    _store,
    _sync,
    cache_path,
    device_key,
)
from .check import input_copies, preserved_state

STRATEGIES = ("auto", "fused", "model_loop")
#: The environment variable that sets the default strategy (``fuse(strategy=None)``).
STRATEGY_ENV = "HFTC_STRATEGY"
#: Seconds the choice may spend, its warm-up included; at least ``_MIN_ROUNDS`` timed
#: rounds run however long a step is (two: one in each order, so drift hits both ways).
_BUDGET_S = 1.0
_MIN_ROUNDS = 2
_MAX_ROUNDS = 15
#: How much faster (a fraction, median of the per-round ratios) the loop must be to be
#: taken: between ties the fused program stays, so the choice does not flip with noise.
_MARGIN = 0.03


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
            f"{source} must be 'auto' (time the fused program against the models one by "
            f"one on the first call, keep the faster), 'fused' or 'model_loop'; got "
            f"{strategy!r}")
    return strategy


@dataclass
class StrategyChoice:
    """How a program runs its forward, and why (``fused.plan``)."""

    #: "fused" (the fused program) or "model_loop" (the N models one by one)
    chosen: str
    #: "timed", "cache" (an earlier process timed it), "forced" (strategy=...),
    #: "check" (the first-call check found the fused program wrong for these inputs),
    #: "autotune" (autotune=True's whole-forward choice), "loop failed" (the models
    #: cannot run one by one: the fused program, untimed)
    reason: str
    #: candidate -> median seconds of one forward (+ backward)
    times: dict[str, float] = field(default_factory=dict)
    #: median of the per-round ratios loop / fused
    ratio: float | None = None
    rounds: int = 0
    #: seconds the choice took (warm-up and timed rounds)
    seconds: float = 0.0
    backward: bool = False

    def __str__(self) -> str:
        what = {"fused": "the fused program", "model_loop": "the models one by one"}
        text = f"runs {what.get(self.chosen, self.chosen)} ({self.reason}"
        if self.times:
            step = "forward + backward" if self.backward else "forward"
            text += (f": {step} fused {self.times.get('fused', float('nan')) * 1e3:.3g} ms, "
                     f"one by one {self.times.get('model_loop', float('nan')) * 1e3:.3g} ms")
            if self.ratio is not None:
                text += f", median ratio {self.ratio:.3f} over {self.rounds} rounds"
            if self.seconds:
                text += f", decided in {self.seconds:.2f} s"
        return text + ")"


def strategy_key(fused: torch.nn.Module, values: Sequence[Any], batched: Sequence[bool],
                 backward: bool, key_source: str) -> str:
    """The disk cache's key: the device (threads, torch version), the program (its
    generated code), the inputs' shapes, strides and dtypes, N, the parameters' shapes and
    whether a backward is timed (training or eval)."""
    device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
    return json.dumps([device_key(device), "strategy-1", fused.num_models,
                       hashlib.sha1(key_source.encode()).hexdigest(),
                       _describe([v for v in values if isinstance(v, Tensor)]),
                       list(batched), backward, [list(p.shape) for p in fused.parameters()]])


def choose_strategy(fused: torch.nn.Module, program_forward: Callable[..., Any],
                    loop: Callable[[], Any], values: Sequence[Any], batched: Sequence[bool],
                    *, backward: bool, key_source: str, path: Path | None = None,
                    budget_s: float = _BUDGET_S,
                    ) -> tuple[ProgramChoice | None, StrategyChoice]:
    """Time the fused program against the whole-model loop (``loop()`` makes it) on
    copies of ``values`` (see the module docstring); ``None`` for the fused program."""
    start = time.perf_counter()
    path = path or cache_path()
    key = strategy_key(fused, values, batched, backward, key_source)
    entry = _lookup(key, path)
    if entry is not None and entry.get("chosen") in ("fused", "model_loop"):
        ratio = entry.get("ratio")
        choice = StrategyChoice(entry["chosen"], "cache", dict(entry["times"]),
                                ratio if isinstance(ratio, float) else None, backward=backward)
        if choice.chosen == "fused":
            return None, choice
        try:
            return ProgramChoice(loop()), choice
        except Exception:  # noqa: BLE001 - a loop that cannot be built: time again
            pass
    device = next((v.device for v in values if isinstance(v, Tensor)), torch.device("cpu"))
    copies = input_copies(values)
    fused_way = ProgramChoice()
    warm_from = time.perf_counter()
    with preserved_state(fused):
        out, _ = _run_step(fused, program_forward, fused_way, copies, batched, backward)
        if not plain_output(out):  # what the loop cannot stack as the fused program does
            return None, StrategyChoice("fused", "outputs not only tensors: not timed",
                                        backward=backward)
        del out
        try:
            loop_way = ProgramChoice(loop())
            _run_step(fused, program_forward, loop_way, input_copies(values), batched, backward)
        except Exception:  # noqa: BLE001 - models that cannot run one by one keep fused
            return None, StrategyChoice("fused", "loop failed", backward=backward)
        times: dict[str, list[float]] = {"fused": [], "model_loop": []}
        ratios: list[float] = []
        for round_ in range(_MAX_ROUNDS):
            order = ((("fused", fused_way), ("model_loop", loop_way)) if round_ % 2 == 0
                     else (("model_loop", loop_way), ("fused", fused_way)))
            for name, way in order:
                _sync(device)
                begin = time.perf_counter()
                _run_step(fused, program_forward, way, copies, batched, backward)
                _sync(device)
                times[name].append(time.perf_counter() - begin)
            ratios.append(times["model_loop"][-1] / max(times["fused"][-1], 1e-12))
            if len(ratios) >= _MIN_ROUNDS and time.perf_counter() - warm_from >= budget_s:
                break
    ratio = statistics.median(ratios)
    chosen = "model_loop" if ratio < 1 - _MARGIN else "fused"
    medians = {name: statistics.median(t) for name, t in times.items()}
    _store(key, {"chosen": chosen, "times": medians, "ratio": ratio}, path)
    choice = StrategyChoice(chosen, "timed", medians, ratio, len(ratios),
                            time.perf_counter() - start, backward)
    return (loop_way if chosen == "model_loop" else None), choice


__all__ = ["STRATEGIES", "STRATEGY_ENV", "StrategyChoice", "choose_strategy",
           "resolve_strategy", "strategy_key"]
