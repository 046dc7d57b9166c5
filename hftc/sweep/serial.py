"""The same study one trial at a time with stock Optuna: what a fused sweep is compared
with.

::

    study = optuna.create_study(storage="sqlite:///OUT/serial.db", sampler=TPE(seed),
                                pruner=the spec's pruner, direction=...)
    study.optimize(objective, n_trials)      # objective(trial): the spec's space, a stock
                                             # model and optimizer, an epoch at a time,
                                             # trial.report / trial.should_prune

No hftc in the loop: a stock model, the spec's stock optimizer(s) and scheduler(s),
Optuna's own storage (its defaults), sampler and pruner. The wall clock includes
Optuna's share and the start-up (the storage, the study), as a user's script pays them.
``hftc sweep SPEC --serial`` runs it; ``hftc bench --sweep SPEC`` (``--workloads
sweep``: the demo's spec) runs both sides as processes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from .files import save
from .spec import SweepSpec, plain_params
from .training import build_model, epochs_alone, load_data, make_optimizers

__all__ = ["SerialResult", "run_serial", "stock_sampler", "replay_optuna", "describe", "too_small"]


@dataclass
class SerialResult:
    """What the one-at-a-time study took: its wall clock, the part spent training (the
    epochs themselves), and what it found."""

    study: optuna.Study
    wall_s: float
    train_s: float
    trial_epochs: int

    @property
    def optuna_s(self) -> float:
        """Everything but the epochs: Optuna (ask, report, prune, tell, storage), the
        study's start-up and building the models."""
        return self.wall_s - self.train_s

    @property
    def best_value(self) -> float | None:
        try:
            return self.study.best_value
        except ValueError:
            return None


def _best_so_far(study: optuna.Study, value: float, direction: str) -> bool:
    try:
        best = study.best_value
    except ValueError:
        return True
    return value >= best if direction == "maximize" else value <= best


def stock_sampler(spec: SweepSpec) -> optuna.samplers.BaseSampler:
    """The sampler a one-at-a-time user would make: the spec's, seeded with its seed."""
    s = spec.sampler
    if isinstance(s, optuna.samplers.BaseSampler):
        return copy.deepcopy(s)  # its own state: the sweep's sampler is not touched
    if s in (None, "tpe"):
        return optuna.samplers.TPESampler(seed=spec.seed)
    if s == "random":
        return optuna.samplers.RandomSampler(seed=spec.seed)
    from .storage import make_sampler

    return make_sampler(spec, spec.seed)  # a callable, or the sweep's error for others


class _Diverged(Exception):
    """A trial's metric or weights went NaN / inf: it fails (with ``hftc_fail_reason``), and
    the study goes on, as the fused sweep fails a diverged trial alone."""


def run_serial(spec: SweepSpec, out: str | Path, *, storage: str | None = None,
               data: Any = None, save_best: bool = False,
               enqueue: list[dict[str, Any]] | None = None,
               record: bool = False, study_name: str | None = None) -> SerialResult:
    """Run ``spec``'s study one trial at a time with stock Optuna (``study.optimize``) in
    ``out`` (its SQLite file ``serial.db``, made afresh, unless ``storage``); with
    ``save_best``, the weights of each trial that completes best so far in
    ``out/trials/trial-N.pt`` (as the fused sweep keeps them); with ``enqueue``, these
    parameters first (``study.enqueue_trial``, trial k gets ``enqueue[k]``); with
    ``record``, what the fused sweep records of each trial (the user attributes
    ``hftc_seed``, ``hftc_params``, ``hftc_orders``: ``train_alone`` replays it from them)
    and diverged trials failed with ``hftc_fail_reason`` (the others go on). The study is
    ``<spec.name>-serial``, or ``study_name``: a comparison with a fused study gives its
    name, since a HyperbandPruner's bracket of trial k is hash(study name, k)."""
    from .storage import make_pruner

    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if storage is None:
        (out / "serial.db").unlink(missing_ok=True)
        storage = f"sqlite:///{out / 'serial.db'}"
    data = data if data is not None else load_data(spec)
    trained = {"s": 0.0, "epochs": 0}

    def objective(trial: optuna.Trial) -> float:
        params = spec.space(trial)
        params = dict(trial.params) if params is None else params
        seed = int(params.get("seed", spec.seed + trial.number))
        if record:
            trial.set_user_attr("hftc_seed", seed)
            if params != trial.params:  # what space() returned (best.json gives it)
                if plain_params(params) is not None:
                    trial.set_user_attr("hftc_params", plain_params(params))
        model = build_model(spec, params, seed)
        keys = [spec.seed * 1_000_003 + e for e in range(spec.epochs)]
        value = float("nan")
        t0 = time.perf_counter()
        for epoch, value in enumerate(epochs_alone(spec, params, model, keys, data), 1):
            trained["s"] += time.perf_counter() - t0
            trained["epochs"] += 1
            if record:
                trial.set_user_attr("hftc_orders", keys[:epoch])
                finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
                if not (math.isfinite(value) and finite):
                    weights = "" if finite else ", its weights not finite,"
                    trial.set_user_attr("hftc_fail_reason", f"diverged: {spec.metric_name} is "
                                                            f"{value}{weights} after epoch {epoch}")
                    raise _Diverged(trial.number)
            trial.report(value, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
            t0 = time.perf_counter()
        if save_best and _best_so_far(trial.study, value, spec.direction):
            (out / "trials").mkdir(exist_ok=True)
            save(model.state_dict(), out / "trials" / f"trial-{trial.number}.pt")
        return value

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(storage=storage, sampler=stock_sampler(spec),
                                        pruner=make_pruner(spec), direction=spec.direction,
                                        study_name=study_name or f"{spec.name}-serial",
                                        load_if_exists=False)
            for params in enqueue or ():
                study.enqueue_trial(params)
            study.optimize(objective, n_trials=spec.n_trials, catch=(_Diverged,))
    finally:
        optuna.logging.set_verbosity(verbosity)
    wall = time.perf_counter() - start
    return SerialResult(study, wall, trained["s"], trained["epochs"])


def describe(result: SerialResult) -> str:
    """The one-at-a-time study in a line: wall clock, where it went, what it found."""
    n = len(result.study.get_trials(deepcopy=False))
    pruned = len(result.study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)))
    best = result.best_value
    return (f"one at a time (stock Optuna study.optimize): {result.wall_s:.1f} s wall clock "
            f"for {result.trial_epochs} trial-epochs of {n} trials ({pruned} pruned): "
            f"training {result.train_s:.1f} s, Optuna and the rest {result.optuna_s:.1f} s"
            + (f"; best {best:.4f}" if best is not None else ""))


def replay_optuna(spec: SweepSpec, trials: list, folder: str | Path, sample: int = 12,
                  first_made_s: float = 0.0, study_name: str | None = None
                  ) -> tuple[float, int]:
    """The same study one trial at a time, its Optuna share measured on a sample and its
    trial-epochs counted, without training: ``trials`` (the sweep's) in number order, each
    asked, suggested through the spec's space, a stock model and optimizer built, its
    learning curve reported one epoch at a time with ``should_prune`` after each, told,
    as a one-at-a-time objective does.

    * trial-epochs: every curve through the spec's pruner in an in-memory study: the
      sequential pruning of the same curves (a curve the sweep cut shorter than one at
      a time would ends where the sweep cut it);
    * seconds: the first ``sample`` trials through a stock Optuna study on its own SQLite
      file in ``folder`` (Optuna's defaults, the spec's sampler), timed, scaled to all
      the trials; the study's creation counted once, as the process's first
      (``first_made_s``: the sweep's own, which paid SQLAlchemy's import and made the
      schema; the replay's, second in the process, costs a fraction of it).

    The replay's studies are named ``study_name`` (the sweep's; default ``spec.name``): a
    ``HyperbandPruner`` puts trial k in the bracket of hash(study name, k), so an unnamed
    study (a random name) would prune the curves in other brackets, another count each run.

    Returns (seconds, trial-epochs)."""
    name = study_name or spec.name
    curves = [[t.intermediate_values[s] for s in sorted(t.intermediate_values)]
              for t in sorted(trials, key=lambda t: t.number) if t.intermediate_values]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "replay.db"
    db.unlink(missing_ok=True)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            epochs = _replay(spec, curves, None, optuna.samplers.RandomSampler(seed=0),
                             name)[0]
            start = time.perf_counter()
            _, made_s = _replay(spec, curves[:sample], f"sqlite:///{db}", stock_sampler(spec),
                                name)
            seconds = time.perf_counter() - start
    finally:
        optuna.logging.set_verbosity(verbosity)
        db.unlink(missing_ok=True)
    scale = len(curves) / max(1, min(sample, len(curves)))
    return max(made_s, first_made_s) + (seconds - made_s) * scale, epochs


def _replay(spec: SweepSpec, curves: list[list[float]], storage: str | None,
            sampler: optuna.samplers.BaseSampler, study_name: str) -> tuple[int, float]:
    """:func:`replay_optuna`'s loop: (trial-epochs reported, seconds to make the study)."""
    from .storage import make_pruner

    start = time.perf_counter()
    pruner = make_pruner(spec)
    with contextlib.suppress(Exception):  # a pruner of the user's (one that logs or counts
        pruner = copy.deepcopy(pruner)    # its calls) sees the sweep's decisions, not these
    study = optuna.create_study(storage=storage, sampler=sampler, pruner=pruner,
                                direction=spec.direction, study_name=study_name)
    made_s, epochs = time.perf_counter() - start, 0
    with torch.random.fork_rng(devices=[]):
        for curve in curves:
            trial = study.ask()
            params = spec.space(trial)
            params = dict(trial.params) if params is None else params
            if storage is not None:  # as the objective does (the count needs no model)
                make_optimizers(spec, params, build_model(spec, params, spec.seed))
            pruned = False
            for epoch, value in enumerate(curve, 1):
                epochs += 1
                trial.report(value, epoch)
                if trial.should_prune():
                    pruned = True
                    break
            try:
                if pruned or len(curve) < spec.epochs:
                    study.tell(trial, state=TrialState.PRUNED)
                else:
                    study.tell(trial, curve[-1])
            except RuntimeError as exc:  # a sampler's study.stop() (GridSampler)
                if "Study.stop" not in str(exc):
                    raise
                break
    return epochs, made_s


def too_small(spec: SweepSpec) -> str | None:
    """Why a sweep cannot gain from fusing, in words, or None: its arrays would hold one
    trial each (``per_array`` or ``n_trials`` of 1), so every epoch would pay fusing's
    cost and save nothing."""
    size = min(spec.per_array, spec.n_trials)
    if size < 2:
        return (f"each fused array would hold {size} trial (per_array={spec.per_array}, "
                f"n_trials={spec.n_trials}): fusing saves nothing there")
    return None
