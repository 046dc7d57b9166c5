"""Optuna-native fused trials, for users with their own training loop.

``study.optimize(objective)`` calls ``objective(trial)`` once per trial; here
``hftc.sweep.optimize(study, objective, array_size=N)`` asks the study for N trials at
a time and calls ``objective(array)`` once per N::

    def objective(array):                                   # array: a TrialArray
        lrs = array.suggest_float("lr", 1e-4, 1e-1, log=True)  # one value per trial
        fused = array.fuse(lambda trial: Net())             # hftc.fuse, one model per trial
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

import contextlib
import gc
import math
import numbers
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import optuna
import torch
from optuna.trial import TrialState
from torch import nn

import hftc

from ..errors import (
    FusionArgumentError,
    FusionError,
    FusionTypeError,
    MismatchError,
    SweepError,
    SweepWarning,
)
from ..training.shrink import check_replaceable
from .arrays import finite_models
from .pruning import Reference, in_sequence, prune_in_sequence
from .sampling import grid_left as _grid_left
from .storage import Heartbeat, one_worker_per_trial

__all__ = ["PerTrial", "TrialArray", "optimize"]


def _per_model(values: Any, objectives: int) -> Any:
    """A tensor as a list, one entry per model: ``[N]`` (or ``[N, 1]``) -> N floats, and
    ``[N, K]`` -> N lists of K for a study of K objectives (a NumPy array too);
    anything else as given."""
    if not isinstance(values, torch.Tensor):
        if not (getattr(values, "ndim", 0) >= 1 and hasattr(values, "tolist")):
            return values
        values = torch.as_tensor(values)  # a NumPy array: its rows, as a tensor's
    values = values.detach()
    if values.dim() == 0:
        return values.item()
    return values.reshape(-1).tolist() if objectives == 1 else values.tolist()


def _as_values(values: Any, n: int, what: str, objectives: int = 1) -> list[Any]:
    """One float per live trial (or, for a study of K objectives, K floats per trial):
    ``tensor([0.3, 0.1])`` -> ``[0.3, 0.1]``; a single number only for an array of one
    trial (it is an Optuna objective's habit, and one value for N trials is a mistake:
    ``losses.mean()`` for ``losses``)."""
    shape = (f" (a tensor of shape {list(values.shape)})"
             if isinstance(values, torch.Tensor) and values.dim() > 1 else "")
    values = _per_model(_by_trial(values, n, objectives), objectives)
    per = "one value" if objectives == 1 else f"{objectives} values (one per direction)"
    if _scalar(values) is not None:
        if n == 1 and objectives == 1:
            return [_scalar(values)]
        raise SweepError(f"{what} got one number ({values!r}) for the array's {n} live "
                         f"trials; give {per} per trial, in the order of array.trials (a "
                         f"list, or a tensor of the models' values: not their .mean())")
    if isinstance(values, Mapping):  # list() would give its keys: trial numbers as values
        raise SweepError(f"{what} got a {type(values).__name__}; give a list in the order of "
                         f"array.trials: [values[t.number] for t in array.trials]")
    values = list(values)
    if objectives > 1 and n == 1 and len(values) == objectives \
            and all(_scalar(v) is not None for v in values):
        values = [values]  # one trial's values, as objective(trial) returns them
    if len(values) != n:
        raise SweepError(f"{what} got {len(values)} values{shape} for the array's {n} live "
                         f"trials; give {per} per model, in the order of array.trials"
                         + (" (reduce each model's values to one: .mean(1))" if shape else ""))
    out = []
    for j, value in enumerate(values):
        value = _per_model(value, objectives) if _scalar(value) is None else value
        if objectives == 1 and _scalar(value) is not None:
            out.append(_scalar(value))
        elif objectives > 1 and isinstance(value, (list, tuple)) and len(value) == objectives \
                and all(_scalar(v) is not None for v in value):
            out.append([_scalar(v) for v in value])
        else:
            raise SweepError(f"{what}: the value for trial {j} is {value!r}; the study has "
                             f"{objectives} objective(s): give {per} per trial")
    return out


def _by_trial(values: Any, n: int, objectives: int) -> Any:
    """A multi-objective study's ``return losses, accuracies``, K per-model ``[N]``
    tensors (one per direction, as ``objective(trial)`` returns ``loss, accuracy``), as
    the ``[N, K]`` tensor of each trial's K values; anything else as given. (Read as one
    row per trial, the K tensors would give trial 0 every model's loss when N == K.)"""
    if objectives == 1 or not isinstance(values, (tuple, list)) or len(values) != objectives:
        return values
    columns = []
    for column in values:
        if not (getattr(column, "ndim", None) == 1 and len(column) == n):
            return values
        columns.append(torch.as_tensor(column).detach().double())
    return torch.stack(columns, dim=1)


def _scalar(value: Any) -> float | None:
    """``value`` as a float if it is one number (a Python or NumPy number, or a tensor /
    array of one element, as ``float()`` and Optuna take it), else ``None``."""
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())  # (a loss with its graph: no autograd warning)
    if hasattr(value, "ndim") and getattr(value, "size", None) == 1:  # a NumPy array
        return float(value.item())  # (NumPy 2 refuses float() of an array of shape [1])
    return None


class PerTrial(list):
    """One value per live trial (``array.suggest_*``, ``array.should_prune()``): a list,
    except that the habits of ``objective(trial)`` raise instead of asking about the list
    (``if array.should_prune():`` is true for any non-empty list; ``if
    array.suggest_categorical("opt", ["Adam", "SGD"]) == "Adam":`` is always false)::

        if array.should_prune(): ...          # SweepError: each trial's, or any() / all()
        for t, prune in zip(array.trials, array.should_prune()): ...   # per trial
    """

    def __init__(self, values: Iterable[Any] = (), what: str = "suggest_*"):  # copyable
        super().__init__(values)
        self.what = what

    def _refuse(self, how: str) -> SweepError:
        return SweepError(
            f"{how} on array.{self.what}, which is one value per live trial ({list(self)}), "
            f"asks about the list, not a trial: take each trial's value (zip(array.trials, "
            f"values)), or any(...) / all(...)"
            + ("; array.report(values, step) drops the trials the pruner prunes itself, "
               "the others go on (raising optuna.TrialPruned prunes them all)"
               if self.what == "should_prune()" else ""))

    def __bool__(self) -> bool:
        raise self._refuse("`if` (bool)")

    def __eq__(self, other: object) -> Any:
        if isinstance(other, (str, bytes, numbers.Number)) or other is None:  # one trial's?
            raise self._refuse(f"`== {other!r}`")
        return list.__eq__(self, other)  # a list's answer (pytest.approx's: its own)

    def __ne__(self, other: object) -> Any:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  (a list's)


class TrialArray:
    """N live ``optuna.Trial`` s trained as one fused module (see the module docstring).

    ``trials[j]`` is model ``j`` of each fused module (``fuse`` may be called once per
    kind of model: a GAN's generators and discriminators), now and after every shrink: a
    pruned trial leaves ``trials`` and the fused modules together."""

    def __init__(self, study: optuna.Study, trials: Sequence[optuna.Trial],
                 asks_left: Callable[[], int] | None = None,
                 asked: Callable[[optuna.Trial], None] | None = None,
                 told: Callable[[optuna.trial.FrozenTrial], None] | None = None):
        self.study = study
        self._told = told  # optimize's callbacks and progress bar, per finished trial
        self.trials: list[optuna.Trial] = list(trials)
        #: The fused modules of this array, in the order ``fuse`` made them.
        self.fused_modules: list[hftc.FusedModule] = []
        #: The positions the last ``report`` dropped, and how many models it saw.
        self._last_drop: tuple[list[int], int] = ([], 0)
        #: The positions the last ``report`` gave to new trials (``refill_with``).
        self.replaced: list[int] = []
        # optimize's trial budget: how many trials may still be asked, and "one asked"
        self._asks_left, self._asked = asks_left, asked
        self._build: Callable[[optuna.Trial], Any] | None = None
        self._epochs: int | None = None  # array.epochs(E): each trial's own epoch count
        self._epoch_of: dict[int, int] = {}
        self._reported = False
        self._told_numbers: set[int] = set()  # the trials this array told (not to fail)
        self._joining: list[optuna.Trial] = []  # asked by a refill, not yet in its place

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

    # One value per live trial, in model order: ``lrs = array.suggest_float("lr", 1e-4,
    # 0.1, log=True)`` is ``[t.suggest_float("lr", 1e-4, 0.1, log=True) for t in
    # array.trials]``.

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> list[float]:
        """``trial.suggest_float(name, low, high, step=step, log=log)`` for every live
        trial: one value per model, in the order of :attr:`trials` (an ``lr=`` list for
        ``hftc.optim``)."""
        return PerTrial((t.suggest_float(name, low, high, step=step, log=log)
                         for t in self.trials), f"suggest_float({name!r}, ...)")

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1,
                    log: bool = False) -> list[int]:
        """``trial.suggest_int(name, low, high, step=step, log=log)`` for every live trial."""
        return PerTrial((t.suggest_int(name, low, high, step=step, log=log)
                         for t in self.trials), f"suggest_int({name!r}, ...)")

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> list[Any]:
        """``trial.suggest_categorical(name, choices)`` for every live trial."""
        return PerTrial((t.suggest_categorical(name, choices) for t in self.trials),
                        f"suggest_categorical({name!r}, ...)")

    def params(self) -> list[dict[str, Any]]:
        """Every live trial's ``trial.params`` (what it suggested so far), in model order."""
        return [dict(t.params) for t in self.trials]

    def should_prune(self) -> list[bool]:
        """``trial.should_prune()`` for every live trial after its last report, as the
        array decides it (each compared with the trials numbered below it, pruning.py);
        it tells and drops nothing (:meth:`report` does both)."""
        self._one_objective("should_prune")
        pruned = set(self._to_prune(list(range(len(self.trials)))))
        return PerTrial((j in pruned for j in range(len(self.trials))), "should_prune()")

    def _one_objective(self, what: str) -> None:
        if len(self.study.directions) > 1:
            raise SweepError(f"TrialArray.{what}: the study has {len(self.study.directions)} "
                             f"objectives, and Optuna reports and prunes single-objective "
                             f"trials only; return each trial's values from the objective "
                             f"instead (or call array.finish(values))")

    def fuse(self, models: Sequence[nn.Module] | Callable[[optuna.Trial], nn.Module],
             **fuse_kwargs: Any) -> hftc.FusedModule:
        """``hftc.fuse(models, **fuse_kwargs)``, model ``j`` being ``trials[j]``'s; the
        array cuts this module, and the ``hftc.optim`` optimizers and schedulers built on
        it, when trials leave.  Call it once per kind of model (a GAN's two nets).
        ``models`` may be a function of a trial: ``array.fuse(lambda t: Net())`` builds
        one model per live trial, in order."""
        if isinstance(models, nn.Module):  # an nn.Sequential iterates over its layers
            raise SweepError(
                f"TrialArray.fuse got one {type(models).__name__}, not one model per trial; "
                f"build one per trial: array.fuse([Net() for _ in array.trials]) or "
                f"array.fuse(lambda trial: Net())")
        if callable(models):
            models = [models(t) for t in self.trials]
        models = list(models)
        if len(models) != len(self.trials):
            raise SweepError(f"TrialArray.fuse got {len(models)} models for {len(self.trials)} "
                             f"trials; build one model per trial, in the order of array.trials")
        try:
            fused = hftc.fuse(models, **fuse_kwargs)
        except MismatchError as exc:  # fuse_groups, its hint, makes several modules: not here
            raise MismatchError(f"TrialArray.fuse: {exc}\n{self._apart_hint()}") from None
        self.fused_modules.append(fused)
        return fused

    def _apart_hint(self) -> str:
        params = "; ".join(f"trial {t.number}: {t.params}" for t in self.trials)
        return (f"The array's trials train as one fused module, so their models must have "
                f"one architecture ({params}). Widths may differ with "
                f"array.fuse(models, pad_widths=True); for other layers, run one "
                f"hftc.sweep.optimize per architecture (a study each, or the choice fixed "
                f"outside the objective), or `hftc sweep`, whose arrays group the trials "
                f"by structure.")

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

    def refill_with(self, build: Callable[[optuna.Trial], Any]) -> None:
        """From now on a place freed by a pruned, failed or (in :meth:`epochs`) completed
        trial is taken by a new trial of the study, while the budget of ``optimize``
        lasts: ``build(trial)`` (suggest on ``trial`` as usual) returns
        ``(model, hyperparameters)``: the new model (or a list, one per ``fuse`` call, in
        that order) and its optimizer hyper-parameters (``{"lr": ...}``, for every
        ``hftc.optim`` optimizer on the array; or ``{optimizer: {...}}``).  The new model
        starts at its own step 0 in the place (:func:`hftc.replace_models`: fresh
        optimizer state, its own epoch count); the loop is :meth:`epochs`'s, in which each
        trial trains its own number of epochs.  Exact only where a trial's data order does
        not depend on the array's epoch (docs/SWEEP.md); refused with a scheduler on the
        optimizers."""
        if not callable(build):
            raise SweepError(f"TrialArray.refill_with takes a function build(trial) -> "
                             f"(model, hyperparameters), got {build!r}")
        if not self.fused_modules:
            raise SweepError("TrialArray.refill_with: call it after array.fuse(...) and "
                             "after building the optimizers")
        for fused in self.fused_modules:
            try:
                check_replaceable(fused)
            except FusionError as exc:
                raise SweepError(f"TrialArray.refill_with: {exc}") from exc
        if self._asks_left is None:
            raise SweepError("TrialArray.refill_with needs the trial budget of "
                             "hftc.sweep.optimize(..., n_trials=...): use the array it gives")
        self._build = build

    def epochs(self, epochs: int) -> Iterator[int]:
        """``for epoch in array.epochs(E)``: each trial trains ``E`` epochs of its own.

        Yields the array's round (0, 1, ...) while trials are live; call
        :meth:`report` once per round (its ``step`` defaults to each trial's own epoch,
        :meth:`epoch_of`).  A trial that reported its ``E``-th epoch is completed with
        that value and leaves (or its place is taken, :meth:`refill_with`); the loop
        ends when no trial is left."""
        if not isinstance(epochs, int) or epochs < 1:
            raise SweepError(f"TrialArray.epochs takes a positive int, got {epochs!r}")
        self._epochs = epochs
        self._epoch_of = {t.number: 0 for t in self.trials}
        round_ = 0
        while self.trials:
            self._reported = False
            yield round_
            if not self._reported and self.trials:
                raise SweepError("TrialArray.epochs: call array.report(values) once in each "
                                 "epoch of the loop (it counts each trial's epochs)")
            round_ += 1

    def epoch_of(self, position: int) -> int:
        """How many epochs the trial at ``position`` has reported (its own epoch now)."""
        return self._epoch_of.get(self.trials[position].number, 0)

    def _fail(self, trial: optuna.Trial, reason: str, notify: bool = True) -> None:
        trial.set_user_attr("hftc_fail_reason", reason)
        self._tell(trial, state=TrialState.FAIL, notify=notify)

    def _tell(self, trial: optuna.Trial, *args: Any, notify: bool = True, **kwargs: Any) -> None:
        """``study.tell``, then (in ``optimize``) study.optimize's log line for the trial
        and ``optimize``'s callbacks with it (not for trials failed by an error that
        optimize raises: study.optimize calls none then)."""
        frozen = self.study.tell(trial, *args, **kwargs)
        self._told_numbers.add(trial.number)
        if self._told is not None:
            _log_told(self.study, frozen)
            if notify:
                self._told(frozen)

    def drop(self, positions: Sequence[int]) -> None:
        """Remove the models at ``positions`` (already told) from the array, the fused
        modules and the optimizers / schedulers built on them; if none is left, raise
        ``optuna.TrialPruned`` (the objective is over)."""
        gone = set(positions)
        keep = [j for j in range(len(self.trials)) if j not in gone]
        self._last_drop = (keep, len(self.trials))
        self.trials = [self.trials[j] for j in keep]
        if not keep:
            if self._epochs is not None:
                return  # array.epochs ends the loop
            raise optuna.TrialPruned("every trial of the array is pruned, failed or complete")
        if gone:
            for fused in self.fused_modules:  # with the optimizers and schedulers built on it
                try:
                    hftc.keep_models(fused, keep)
                except (FusionTypeError, FusionArgumentError) as exc:  # the user's call: report
                    raise type(exc)(f"TrialArray.report, dropping the pruned / failed models "
                                    f"{sorted(gone)} (hftc.keep_models): {exc}") from None

    def report(self, values: Sequence[float] | torch.Tensor, step: int | None = None
               ) -> list[int]:
        """Report ``values[j]`` to ``trials[j]`` at ``step``, ask the pruner, and drop the
        trials it prunes, and those whose value or fused weights are not finite (their
        trial fails with the reason).  Returns the positions (before this call) of the
        models dropped, so the loop can cut its own per-model lists the same way.

        In :meth:`epochs`, ``step`` defaults to each trial's own epoch and a trial at its
        last epoch is completed with its value; with :meth:`refill_with`, freed places
        go to new trials instead of being dropped (:attr:`replaced` lists them)."""
        self._one_objective("report")
        values = _as_values(values, len(self.trials), "TrialArray.report")
        if self._build is not None and self._epochs is None:
            # in range(E), a new trial would report at the array's steps, train the steps
            # left and complete with that value: one no run of it alone gives
            raise SweepError("TrialArray.refill_with needs the loop in array.epochs(E) "
                             "(for _ in array.epochs(E): ... array.report(values)), which "
                             "counts each trial's own epochs, not range(E): a trial that "
                             "joins in a freed place trains its own E epochs")
        if step is None and self._epochs is None:
            raise SweepError("TrialArray.report needs step= (or run the loop in "
                             "array.epochs(E), which counts each trial's epochs)")
        self._reported = True
        finite = [True] * len(values)
        for fused in self.fused_modules:
            finite = [a and b for a, b in zip(finite, finite_models(fused))]
        dropped, last = [], []
        for j, (trial, value) in enumerate(zip(self.trials, values)):
            if not math.isfinite(value) or not finite[j]:
                weights = "" if finite[j] else " and its weights are not finite"
                self._fail(trial, f"diverged: the value reported at step {step} is "
                                  f"{value}{weights}")
                dropped.append(j)
                continue
            own_step = self._epoch_of.get(trial.number, 0) if step is None else step
            trial.report(value, own_step)
            if self._epochs is not None:
                self._epoch_of[trial.number] = self._epoch_of.get(trial.number, 0) + 1
                if self._epoch_of[trial.number] >= self._epochs:
                    last.append(j)
        # Every value reported first, then the pruner, in trial-number order: a trial is
        # compared with those numbered below it still training (hftc.sweep.pruning). The
        # trials at their last epoch are asked too (objective(trial)'s loop asks after
        # every report), and those kept complete with their value.
        pruned = self._to_prune([j for j in range(len(self.trials)) if j not in dropped])
        for j in pruned:
            self._tell(self.trials[j], state=TrialState.PRUNED)
        for j in last:
            if j not in pruned:
                self._tell(self.trials[j], values[j])
        dropped = sorted(set(dropped + pruned + last))
        try:
            self.replaced = self._take_places(dropped)
        except Exception:
            # They are told: out of the array, or optimize would fail them again (Optuna's
            # UpdateFinishedTrialError) and hide this error.
            self.trials = [t for j, t in enumerate(self.trials) if j not in dropped]
            raise
        dropped = [j for j in dropped if j not in self.replaced]
        self.drop(dropped)
        return dropped

    def _to_prune(self, positions: list[int]) -> list[int]:
        """Which of the trials at ``positions`` (reported at this step) the study's
        pruner prunes: for a median / percentile pruner, each compared with the complete
        trials and the running ones numbered below it (one storage read, pruning.py);
        for any other, ``trial.should_prune()``."""
        pruner = self.study.pruner
        if isinstance(pruner, optuna.pruners.NopPruner) or not positions:
            return []
        order = sorted(positions, key=lambda j: self.trials[j].number)
        if not in_sequence(pruner):
            return sorted(j for j in order if self.trials[j].should_prune())
        trials = self.study.get_trials(deepcopy=False,
                                       states=(TrialState.COMPLETE, TrialState.RUNNING))
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        running = {t.number: Reference(t.number, t.intermediate_values)
                   for t in trials if t.state == TrialState.RUNNING}
        pruned = []
        for j in order:
            trial = self.trials[j]
            mine = running.get(trial.number)
            values = mine.intermediate_values if mine is not None else {}
            if prune_in_sequence(pruner, self.study, trial.number, trial._trial_id, values,
                                 complete, running.values()):
                pruned.append(j)
                running.pop(trial.number, None)  # out of the reference of those after it
        return sorted(pruned)

    def _take_places(self, freed: list[int]) -> list[int]:
        """New trials in ``freed`` places while the budget lasts (``refill_with``); the
        places taken."""
        if self._build is None or not freed:
            return []
        places, newcomers = [], []
        free = list(freed)
        while free and self._asks_left() > 0:
            # as study.optimize before each trial: a dead worker's trials fail and their
            # retries come first (one refilled array may run all the study's trials)
            _fail_stale_trials(self.study)
            trial = _ask(self.study)
            self._joining.append(trial)  # the heartbeat's from now on
            self._asked(trial)
            try:
                built = self._build(trial)
            except optuna.TrialPruned:
                # objective(trial)'s habit for a configuration it will not train: that
                # trial is pruned, as study.optimize prunes it, and the place asks again
                self._tell(trial, state=TrialState.PRUNED)
                continue
            except Exception as exc:
                self._fail(trial, f"build(trial) failed: {type(exc).__name__}: {exc}", False)
                raise
            j = free.pop(0)
            try:
                models, hyper = built
                models = list(models) if isinstance(models, (list, tuple)) else [models]
                if len(models) != len(self.fused_modules):
                    raise SweepError(f"build(trial) gave {len(models)} models for the array's "
                                     f"{len(self.fused_modules)} fused modules")
            except Exception as exc:
                self._fail(trial, f"build(trial) failed: {type(exc).__name__}: {exc}", False)
                raise
            places.append(j)
            newcomers.append((trial, models, dict(hyper or {})))
        if not places:
            self._joining.clear()  # (each one told)
            return []
        try:
            for k, fused in enumerate(self.fused_modules):
                hftc.replace_models(fused, {j: new[1][k] for j, new in zip(places, newcomers)},
                                    hyperparameters={j: new[2]
                                                     for j, new in zip(places, newcomers)})
        except Exception as exc:
            for trial, _, _ in newcomers:
                self._fail(trial, f"could not take a freed place: {exc}", False)
            raise SweepError(f"TrialArray: new trials could not take the freed places: "
                             f"{exc}") from exc
        for j, (trial, _, _) in zip(places, newcomers):
            self.trials[j] = trial
            self._epoch_of[trial.number] = 0
        self._joining.clear()  # in their places (the others told)
        return places

    def _holding(self) -> list[int]:
        """The ids of the trials this array holds and has not told: the live ones and
        those a refill asked for and is building (the heartbeat's)."""
        return [t._trial_id for t in list(self.trials) + list(self._joining)
                if t.number not in self._told_numbers]

    def finish(self, values: Sequence[float] | torch.Tensor) -> None:
        """Complete every live trial with its final value (a non-finite one fails it).

        ``values`` has one value per live trial (a multi-objective study's: one list of
        ``len(study.directions)`` values per trial, an ``[N, K]`` tensor, or K ``[N]``
        tensors, one per direction: ``return losses, accuracies``), or one per
        model of the last ``report`` that dropped some (the loop's last values, computed
        before that report): the live trials' are taken."""
        objectives = len(self.study.directions)
        keep, seen = self._last_drop
        if _scalar(values) is None and len(keep) < seen and len(values) == seen:
            values = values[keep] if isinstance(values, torch.Tensor) else [values[j] for j in keep]
        values = _as_values(values, len(self.trials), "TrialArray.finish", objectives)
        for trial, value in zip(self.trials, values):
            if all(map(math.isfinite, value if objectives > 1 else [value])):
                self._tell(trial, value)
            else:
                self._fail(trial, f"diverged: its final value is {value}")
        self.trials = []

    def _fail_all(self, reason: str, notify: bool = True) -> None:
        """Fail every trial the array holds and has not told: the live ones, and a
        refill's new ones (Ctrl-C in build(trial))."""
        for trial in self.trials + self._joining:
            if trial.number not in self._told_numbers:  # told, then a callback raised
                self._fail(trial, reason, notify)
        self.trials, self._joining = [], []


def optimize(
    study: optuna.Study,
    objective: Callable[[TrialArray], Sequence[float] | torch.Tensor | None],
    n_trials: int | None = None,
    *,
    array_size: int = 16,
    timeout: float | None = None,
    n_jobs: int = 1,
    catch: Iterable[type[Exception]] | type[Exception] = (),
    callbacks: Iterable[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] | None = None,
    gc_after_trial: bool = False,
    show_progress_bar: bool = False,
) -> None:
    """``study.optimize`` for fused trials: ask ``array_size`` trials at a time (fewer
    for the last array), call ``objective(array)`` with them as a :class:`TrialArray`,
    and tell each live trial the objective's return (one value per live trial, in the
    order of ``array.trials``), unless ``array.finish(values)`` did already.

    The arguments are ``optuna.Study.optimize``'s, with its meaning (``array_size`` and
    what follows keyword-only: ``optimize(study, objective, 20, 600)``, a timeout in
    ``study.optimize``, is refused, not taken for 600 trials an array): ``n_trials`` trials
    in all (``None``: no limit), no new array (nor refill) once ``timeout`` seconds have
    passed, ``callbacks`` called as ``callback(study, frozen_trial)`` after each trial is
    told (pruned ones within the array too; not those failed by an exception that
    optimize raises, as study.optimize), ``study.stop()`` from the objective or a
    callback ends the loop after the current array, ``gc_after_trial`` runs
    ``gc.collect()`` after each array, ``show_progress_bar`` a tqdm bar of the finished
    trials. ``n_jobs`` must be 1: the array is the parallelism (run several processes on
    one storage for more). An exception in the objective fails the array's live trials
    (the message in their ``hftc_fail_reason`` user attribute) and is raised again,
    unless it is one of ``catch``; ``optuna.TrialPruned`` prunes them.  Any sampler,
    pruner and storage work, several processes on one storage included; a
    multi-objective study takes K values per trial (a list each, an ``[N, K]`` tensor, or
    K per-model ``[N]`` tensors: ``return losses, accuracies``; it has no ``report``)."""
    _check_optimize_args(n_trials, array_size, timeout, n_jobs)
    n_trials, array_size = (None if n_trials is None else int(n_trials)), int(array_size)
    one_worker_per_trial(getattr(study, "_storage", None))  # several processes, one SQLite
    catch = tuple(catch) if isinstance(catch, Iterable) else (catch,)
    callbacks = list(callbacks or [])
    start, asked = time.perf_counter(), 0
    bar = _progress_bar(show_progress_bar, n_trials, timeout)

    def stopped() -> bool:
        out_of_time = timeout is not None and time.perf_counter() - start >= timeout
        return out_of_time or bool(getattr(study, "_stop_flag", False))

    held: list[int] = []  # the numbers of the trials the current array asked

    def budget() -> int:
        if stopped():
            return 0
        left = (n_trials - asked) if n_trials is not None else array_size
        limit = _max_trials_left(study, callbacks, held)  # a MaxTrialsCallback's
        return left if limit is None else min(left, limit)

    def room(asking: list[optuna.Trial]) -> bool:  # before each ask of an array
        limit = _max_trials_left(study, callbacks, [t.number for t in asking])
        return limit is None or limit > 0

    def asks_left() -> int:  # a refill's: none past a GridSampler's grid
        grid = _grid_left(study)
        return budget() if grid is None else min(budget(), grid)

    def one_more(trial: optuna.Trial) -> None:
        nonlocal asked
        asked += 1
        held.append(trial.number)

    def told(frozen: optuna.trial.FrozenTrial) -> None:
        if bar is not None:
            bar.update(1)
        for callback in callbacks:
            callback(study, frozen)

    local = getattr(study, "_thread_local", None)
    if local is not None:  # study.stop() works inside optimize only: here too
        study._stop_flag, local.in_optimize_loop = False, True
    try:
        while budget() > 0:
            # the grid's last points, not an array of repeats: study.optimize stops at the
            # grid (a done grid: one repeat, as study.optimize, whose sampler then stops it)
            grid = _grid_left(study)
            size = min(array_size, budget(), array_size if grid is None else max(grid, 1))
            _fail_stale_trials(study)
            array = TrialArray(study, _ask_array(study, size, room),
                               asks_left=asks_left, asked=one_more, told=told)
            asked += size
            held[:] = array.numbers
            with _beating(study, array):
                _run_array(study, objective, array, catch)
            if gc_after_trial:
                gc.collect()
    finally:
        if local is not None:
            local.in_optimize_loop = False
        if bar is not None:
            bar.close()


#: study.optimize's logger: its "Trial 3 finished with value ..." lines, under Optuna's
#: verbosity (optuna.logging.set_verbosity).
_OPTIMIZE_LOG = optuna.logging.get_logger("optuna.study._optimize")


def _log_told(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
    """The line study.optimize logs for a finished trial: "Trial 3 finished with value:
    0.1 and parameters: {...}. Best is trial 1 ..." (INFO), "Trial 4 pruned." (INFO), or
    "Trial 5 failed with parameters: {...} because of the following error: ..."
    (WARNING, the traceback of the error being handled, if any)."""
    if frozen.state == TrialState.COMPLETE:
        study._log_completed_trial(frozen.values, frozen.number, frozen.params)
    elif frozen.state == TrialState.PRUNED:
        _OPTIMIZE_LOG.info(f"Trial {frozen.number} pruned. ")
    elif frozen.state == TrialState.FAIL:
        reason = frozen.user_attrs.get("hftc_fail_reason", "unknown")
        error = sys.exc_info()
        _OPTIMIZE_LOG.warning(f"Trial {frozen.number} failed with parameters: {frozen.params} "
                              f"because of the following error: {reason}.",
                              exc_info=error if error[0] is not None else None)


def _max_trials_left(study: optuna.Study, callbacks: Sequence[Any], held: Iterable[int]
                     ) -> int | None:
    """How many more trials the ``MaxTrialsCallback`` s among ``callbacks`` let start
    (``None``: there is none): study.optimize asks one trial at a time and the callback
    stops it at the count, but an array asks N at once, so it asks no more than the
    count leaves. ``held``: the numbers of the trials this array asked; those still
    running count as if finished in the callback's states (they will be)."""
    limits = [c for c in callbacks if isinstance(c, optuna.study.MaxTrialsCallback)]
    if not limits:
        return None
    trials = study.get_trials(deepcopy=False)
    running = {t.number for t in trials if t.state == TrialState.RUNNING}
    held_running = running.intersection(held)
    left = []
    for limit in limits:
        counted = {t.number for t in trials
                   if limit._states is None or t.state in limit._states}
        left.append(max(0, limit._n_trials - len(counted | held_running)))
    return min(left)


def _ask(study: optuna.Study) -> optuna.Trial:
    """``study.ask()``, without Optuna's warning that a heartbeat storage is for
    study.optimize: optimize beats as study.optimize does (:func:`_beating`), and a
    first beat now, as its heartbeat starts with the trial: a trial that never beat is
    never stale, and a worker killed before its array's heartbeat starts (asking the
    array's other trials, a refill's build(trial)) would leave it RUNNING for ever."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed")
        trial = study.ask()
    if is_heartbeat_enabled(study._storage):
        study._storage.record_heartbeat(trial._trial_id)
    return trial


def _ask_array(study: optuna.Study, size: int,
               room: Callable[[list[optuna.Trial]], bool]) -> list[optuna.Trial]:
    """``size`` trials of the study, or fewer where ``room(asked so far)`` says no more
    (a MaxTrialsCallback's count, read again before each ask as study.optimize reads it
    after each trial: other workers ask at the same time); if asking one fails (Ctrl-C,
    the storage, the sampler), those asked before it fail with the reason, then the
    error goes on: none is left RUNNING for ever."""
    trials: list[optuna.Trial] = []
    try:
        for _ in range(size):
            if trials and not room(trials):
                break
            trials.append(_ask(study))
    except (Exception, KeyboardInterrupt) as exc:
        for trial in trials:
            with contextlib.suppress(Exception):  # the storage's own error: the first one
                trial.set_user_attr("hftc_fail_reason", f"asking the array's other trials "
                                    f"failed: {type(exc).__name__}: {exc}")
                study.tell(trial, state=TrialState.FAIL)
        raise
    return trials


def _fail_stale_trials(study: optuna.Study) -> None:
    """As study.optimize before each trial: with a heartbeat storage
    (``RDBStorage(heartbeat_interval=...)``), fail the running trials of dead workers
    (and run the storage's failed-trial callback, RetryFailedTrialCallback)."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    if is_heartbeat_enabled(study._storage):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)


@contextlib.contextmanager
def _beating(study: optuna.Study, array: TrialArray) -> Iterator[None]:
    """Optuna's heartbeat for every live trial of ``array``, refilled ones too, while the
    objective runs (one thread, :class:`~hftc.sweep.storage.Heartbeat`, as study.optimize
    runs one per trial), so another worker's ``fail_stale_trials`` fails them if this
    process dies, and leaves them alone while it runs."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    if not is_heartbeat_enabled(study._storage):
        yield
        return
    beat = Heartbeat(study._storage, study._storage.get_heartbeat_interval(),
                     live=array._holding)
    beat.start()
    try:
        yield
    finally:
        beat.stop()
        beat.join()


def _check_optimize_args(n_trials: Any, array_size: Any, timeout: Any, n_jobs: Any) -> None:
    # (0 runs no trial, as study.optimize: a resumed script's `total - len(study.trials)`)
    if n_trials is not None and (not _an_int(n_trials) or n_trials < 0):
        raise SweepError(f"optimize: n_trials must be an int >= 0 or None, got {n_trials!r}")
    if not _an_int(array_size) or array_size < 1:
        raise SweepError(f"optimize: array_size must be a positive int, got {array_size!r}")
    if timeout is not None and not (isinstance(timeout, numbers.Real) and timeout >= 0):
        raise SweepError(f"optimize: timeout must be seconds (>= 0) or None, got {timeout!r}")
    if n_jobs != 1:
        raise SweepError(f"optimize: n_jobs={n_jobs!r}: the array trains its trials at once "
                         f"in one process; raise array_size, or run more processes on one "
                         f"storage")


def _an_int(value: Any) -> bool:
    """An int as study.optimize takes it: a NumPy integer too, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _progress_bar(show: bool, n_trials: int | None, timeout: float | None) -> Any:
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=n_trials, desc="trials", unit="trial",
                postfix=None if timeout is None else f"timeout {timeout:g} s")


def _run_array(study: optuna.Study, objective: Callable, array: TrialArray,
               catch: tuple[type[Exception], ...]) -> None:
    """One array: the objective, then its live trials told (pruned, failed or valued)."""
    try:
        values = objective(array)
    except optuna.TrialPruned as exc:
        _warn_pruned_all(array, exc)
        for trial in list(array.trials):
            array._tell(trial, state=TrialState.PRUNED)
        array.trials = []
        return
    except (Exception, KeyboardInterrupt) as exc:  # Ctrl-C fails them too, as in Optuna
        array._fail_all(f"{type(exc).__name__}: {exc}", notify=isinstance(exc, catch))
        if isinstance(exc, catch):
            return
        raise
    if not array.trials:
        return
    where = _where(objective)
    if values is None:
        numbers = array.numbers
        array._fail_all("the objective returned None and did not call array.finish", False)
        raise SweepError(
            f"optimize: the objective{where} returned None for trials {numbers}; "
            f"return one value per live trial (in the order of array.trials) or "
            f"call array.finish(values)")
    try:
        array.finish(values)
    except SweepError as exc:  # a return of the wrong shape: no trial left RUNNING
        array._fail_all(f"the objective's return: {exc}", notify=False)
        raise SweepError(f"optimize: the value the objective{where} returned: {exc}") from None
    except Exception as exc:  # a callback's error: the trials not told yet fail
        array._fail_all(f"{type(exc).__name__}: {exc}", notify=False)
        raise


def _warn_pruned_all(array: TrialArray, exc: BaseException) -> None:
    """``if trial.should_prune(): raise optuna.TrialPruned()`` per trial, the habit of
    ``objective(trial)``, prunes every live trial of the array, those the pruner keeps
    too: say so at the raise (``report``'s own raise leaves no trial live)."""
    if len(array.trials) < 2:
        return
    try:
        kept = [t.number for t, prune in zip(array.trials, array.should_prune()) if not prune]
    except Exception:  # noqa: BLE001  (a multi-objective study, a pruner's error: no advice)
        return
    if not kept:
        return
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    warnings.warn(SweepWarning(
        f"optuna.TrialPruned raised at {frame.filename}:{frame.lineno} prunes all "
        f"{len(array.trials)} live trials of the array {array.numbers}, trials {kept} too, "
        f"which the pruner keeps; call array.report(values, step) instead: it drops each "
        f"pruned trial and the others go on"), stacklevel=2)


def _where(objective: Callable) -> str:
    """`` objective (train.py:12)``: where the user's function is, for an error about
    what it returned (its line is no longer in the traceback)."""
    code = getattr(objective, "__code__", None)
    if code is None:
        return ""
    name = getattr(objective, "__name__", "objective")
    return f" {name} ({code.co_filename}:{code.co_firstlineno})"
