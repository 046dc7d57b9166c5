"""Optuna-native fused trials, for users with their own training loop.

``study.optimize(objective)`` calls ``objective(trial)`` once per trial; here
``hftc.sweep.optimize(study, objective, array_size=N)`` asks the study for N trials at
a time and calls ``objective(array)`` once per N::

    def objective(array):                                   # array: a TrialArray
        lrs = [t.suggest_float("lr", 1e-4, 1e-1, log=True) for t in array.trials]
        fused = array.fuse([Net() for _ in array.trials])   # hftc.fuse, remembered
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)   # both cut with fused
        for epoch in range(epochs):
            ... the user's own loop on fused (losses summed over the models) ...
            array.report(per_model_accuracy, epoch)         # prunes; survivors go on
        return per_model_accuracy                           # each live trial's value

``array.report`` reports each model's value to its trial and asks the study's pruner;
pruned trials (and models whose value or weights are not finite: their trial fails)
leave the array, and :func:`hftc.keep_models` cuts the fused module(s) and every
``hftc.optim`` optimizer and LR scheduler built on them (found: nothing to register) to
the survivors in place: the loop goes on with them, each exactly as if trained alone.
When no trial is left, ``report`` raises ``optuna.TrialPruned``, which ends the
objective (``optimize`` catches it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import optuna
import torch
from optuna.trial import TrialState
from torch import nn

import hftc

from ..errors import SweepError
from .engine import _finite_models

__all__ = ["TrialArray", "optimize"]


def _as_values(values: Any, n: int, what: str) -> list[float]:
    if isinstance(values, torch.Tensor):
        values = values.detach().reshape(-1).tolist()
    values = [float(v) for v in values]
    if len(values) != n:
        raise SweepError(f"{what} got {len(values)} values for the array's {n} live trials; "
                         f"give one per model, in the order of array.trials")
    return values


class TrialArray:
    """N live ``optuna.Trial`` s trained as one fused module (see the module docstring).

    ``trials[j]`` is model ``j`` of each fused module (``fuse`` may be called once per
    kind of model: a GAN's generators and discriminators), now and after every shrink: a
    pruned trial leaves ``trials`` and the fused modules together."""

    def __init__(self, study: optuna.Study, trials: Sequence[optuna.Trial]):
        self.study = study
        self.trials: list[optuna.Trial] = list(trials)
        #: The fused modules of this array, in the order ``fuse`` made them.
        self.fused_modules: list[hftc.FusedModule] = []
        #: The positions the last ``report`` dropped, and how many models it saw.
        self._last_drop: tuple[list[int], int] = ([], 0)

    def __len__(self) -> int:
        return len(self.trials)

    @property
    def numbers(self) -> list[int]:
        """The live trials' numbers, in model order."""
        return [t.number for t in self.trials]

    @property
    def fused(self) -> hftc.FusedModule | None:
        """The fused module ``fuse`` made last (``None`` before)."""
        return self.fused_modules[-1] if self.fused_modules else None

    def fuse(self, models: Sequence[nn.Module], **fuse_kwargs: Any) -> hftc.FusedModule:
        """``hftc.fuse(models, **fuse_kwargs)``, model ``j`` being ``trials[j]``'s; the
        array cuts this module, and the ``hftc.optim`` optimizers and schedulers built on
        it, when trials leave.  Call it once per kind of model (a GAN's two nets)."""
        models = list(models)
        if len(models) != len(self.trials):
            raise SweepError(f"TrialArray.fuse got {len(models)} models for {len(self.trials)} "
                             f"trials; build one model per trial, in the order of array.trials")
        fused = hftc.fuse(models, **fuse_kwargs)
        self.fused_modules.append(fused)
        return fused

    def track(self, *objects: Any) -> Any:
        """Check that ``objects`` are ``hftc.optim`` optimizers or LR schedulers, which the
        array finds and cuts anyway (this only fails early, with what to change, for a
        stock ``torch.optim`` optimizer); returns what it was given (one object, or a
        tuple)."""
        if not objects:
            raise SweepError("TrialArray.track() needs the optimizers / schedulers to track")
        for k, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(
                    obj, hftc.optim.FusedOptimizer):
                name = type(obj).__name__
                raise SweepError(
                    f"TrialArray.track: objects[{k}] is a stock torch.optim.{name}, whose "
                    f"state for all models cannot be cut when trials leave; build it as "
                    f"hftc.optim.{name}(fused.parameters(), ...)")
        return objects[0] if len(objects) == 1 else objects

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        trial.set_user_attr("hftc_fail_reason", reason)
        self.study.tell(trial, state=TrialState.FAIL)

    def drop(self, positions: Sequence[int]) -> None:
        """Remove the models at ``positions`` (already told) from the array, the fused
        modules and the optimizers / schedulers built on them; if none is left, raise
        ``optuna.TrialPruned`` (the objective is over)."""
        gone = set(positions)
        keep = [j for j in range(len(self.trials)) if j not in gone]
        self._last_drop = (keep, len(self.trials))
        self.trials = [self.trials[j] for j in keep]
        if not keep:
            raise optuna.TrialPruned("every trial of the array is pruned, failed or complete")
        if gone:
            for fused in self.fused_modules:  # with the optimizers and schedulers built on it
                hftc.keep_models(fused, keep)

    def report(self, values: Sequence[float] | torch.Tensor, step: int) -> list[int]:
        """Report ``values[j]`` to ``trials[j]`` at ``step``, ask the pruner, and drop the
        trials it prunes, and those whose value or fused weights are not finite (their
        trial fails with the reason).  Returns the positions (before this call) of the
        models dropped, so the loop can cut its own per-model lists the same way."""
        values = _as_values(values, len(self.trials), "TrialArray.report")
        finite = [True] * len(values)
        for fused in self.fused_modules:
            finite = [a and b for a, b in zip(finite, _finite_models(fused))]
        dropped = []
        for j, (trial, value) in enumerate(zip(self.trials, values)):
            if not math.isfinite(value) or not finite[j]:
                weights = "" if finite[j] else " and its weights are not finite"
                self._fail(trial, f"diverged: the value reported at step {step} is "
                                  f"{value}{weights}")
                dropped.append(j)
                continue
            trial.report(value, step)
            if trial.should_prune():
                self.study.tell(trial, state=TrialState.PRUNED)
                dropped.append(j)
        self.drop(dropped)
        return dropped

    def finish(self, values: Sequence[float] | torch.Tensor) -> None:
        """Complete every live trial with its final value (a non-finite one fails it).

        ``values`` has one value per live trial, or one per model of the last ``report``
        that dropped some (the loop's last values, computed before that report): the
        live trials' are taken."""
        values = (values.detach().reshape(-1).tolist() if isinstance(values, torch.Tensor)
                  else list(values))
        keep, seen = self._last_drop
        if len(keep) < seen and len(values) == seen:
            values = [values[j] for j in keep]
        values = _as_values(values, len(self.trials), "TrialArray.finish")
        for trial, value in zip(self.trials, values):
            if math.isfinite(value):
                self.study.tell(trial, value)
            else:
                self._fail(trial, f"diverged: its final value is {value}")
        self.trials = []

    def _fail_all(self, reason: str) -> None:
        for trial in self.trials:
            self._fail(trial, reason)
        self.trials = []


def optimize(
    study: optuna.Study,
    objective: Callable[[TrialArray], Sequence[float] | torch.Tensor | None],
    n_trials: int,
    array_size: int,
    *,
    catch: tuple[type[Exception], ...] = (),
) -> None:
    """``study.optimize`` for fused trials: ask ``array_size`` trials at a time (fewer
    for the last array), call ``objective(array)`` with them as a :class:`TrialArray`,
    and tell each live trial the objective's return (one value per live trial, in the
    order of ``array.trials``), unless ``array.finish(values)`` did already.

    An exception in the objective fails the array's live trials (the message in their
    ``hftc_fail_reason`` user attribute) and is raised again, unless it is one of
    ``catch``; ``optuna.TrialPruned`` prunes them.  Any sampler, pruner and storage
    work, several processes on one storage included (each asks its own trials)."""
    if not isinstance(n_trials, int) or n_trials < 1:
        raise SweepError(f"optimize: n_trials must be a positive int, got {n_trials!r}")
    if not isinstance(array_size, int) or array_size < 1:
        raise SweepError(f"optimize: array_size must be a positive int, got {array_size!r}")
    asked = 0
    while asked < n_trials:
        size = min(array_size, n_trials - asked)
        array = TrialArray(study, [study.ask() for _ in range(size)])
        asked += size
        try:
            values = objective(array)
        except optuna.TrialPruned:
            for trial in array.trials:
                study.tell(trial, state=TrialState.PRUNED)
            continue
        except Exception as exc:
            array._fail_all(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, catch):
                continue
            raise
        if array.trials:
            if values is None:
                numbers = array.numbers
                array._fail_all("the objective returned None and did not call array.finish")
                raise SweepError(
                    f"optimize: the objective returned None for trials {numbers}; "
                    f"return one value per live trial (in the order of array.trials) or "
                    f"call array.finish(values)")
            array.finish(values)
