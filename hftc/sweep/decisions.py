"""A sweep's decisions after each round: report each trial's new metrics, then complete,
prune (pruning.py) or keep it, and record what a resumed worker needs to decide alike."""

from __future__ import annotations

from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from .arrays import LiveTrial
from .files import append_line, save
from .pruning import Reference, in_sequence, prune_in_sequence
from .training import is_finite

__all__ = ["Decisions", "KEPT_AT", "KEPT_FILE", "kept_decisions"]

#: The system attribute in which sweeps before the worker's decisions file recorded "the
#: pruner kept trial K at epoch E", as [K, E] (a retry inherits the system attributes of
#: the trial it retries, hence K): read when resuming such a sweep.
KEPT_AT = "hftc_kept_at_epoch"

#: The worker folder's record of "the pruner kept the trial of this id at this epoch", a
#: line ``TRIAL_ID EPOCH`` each, appended as it is decided: a resumed worker does not ask
#: the pruner again for that epoch (it would see the trials told since, and a pruner that
#: counts or samples would answer anew). A file beside the checkpoints it goes with, not
#: a storage write (a commit) per trial and epoch.
KEPT_FILE = "kept.txt"


def kept_decisions(folder: Path) -> set[tuple[int, int]]:
    """The ``(trial id, epoch)`` pairs a worker's folder records as kept (KEPT_FILE); a
    line a crash cut short is not one."""
    try:
        text = (folder / KEPT_FILE).read_text()
    except OSError:
        return set()
    kept = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            kept.add((int(parts[0]), int(parts[1])))
    return kept


class Decisions:
    """The decisions part of :class:`hftc.sweep.Sweep` (a mixin)."""

    # ------------------------------------------------------------------ decisions

    def _model_state(self, run: LiveTrial) -> dict[str, torch.Tensor]:
        if run.array is not None:
            return run.array.fused.model_state_dict(run.slot)
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v  # (extra state)
                for k, v in run.module.state_dict().items()}

    def _decide(self, runs: list[LiveTrial]) -> None:
        """Report each trial's new metrics, then complete, prune or keep it."""
        done: list[LiveTrial] = []
        # The complete and running trials, read once per round (other workers finish some
        # too); the trials this round prunes or fails are out of the later ones' reference.
        self._view, self._out_now = None, set()
        runs = sorted(runs, key=lambda r: r.number)
        self._report_all(runs)
        for run in runs:
            trial = run.trial
            try:
                for step in range(run.reported + 1, run.epoch + 1):
                    trial.report(run.history[step - 1], step)
                run.reported = run.epoch
                value = run.history[-1]
                if not is_finite(value) or not run.weights_finite:
                    # (a model whose weights went NaN can still score an accuracy: argmax)
                    weights = "" if run.weights_finite else ", its weights not finite,"
                    self._record(run)
                    self._fail(trial, f"diverged: {self.spec.metric_name} is {value}{weights} "
                                      f"after epoch {run.epoch}")
                    self._out_now.add(run.number)
                    done.append(run)
                    self.log(f"trial {run.number} failed (diverged) at epoch {run.epoch}")
                elif self._should_prune(run):
                    # (at the last epoch too: Optuna's loop asks after every report, and
                    # a trial pruned there is not one of the complete trials)
                    self._record(run)
                    self._tell(trial, state=TrialState.PRUNED)
                    self._out_now.add(run.number)
                    done.append(run)
                    self.log(f"trial {run.number} pruned at epoch {run.epoch}: {value:.6g}")
                elif run.epoch >= self.spec.epochs:
                    self._save_if_best(run, value)
                    self._record(run)
                    self._tell(trial, value)
                    done.append(run)
                    self.log(f"trial {run.number} complete: {value:.6g}")
                else:  # kept: recorded, for a resumed worker (see KEPT_FILE)
                    append_line(self.dir / KEPT_FILE, f"{run.trial_id} {run.epoch}\n")
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as exc:
                state = self.storage.get_trial(run.trial_id).state
                if state == TrialState.RUNNING:
                    raise
                # Finished elsewhere: our heartbeat lapsed and another worker took it over.
                self.log(f"trial {run.number} was {state.name} in the storage ({exc}); dropped")
                done.append(run)
        for run in done:
            self.heartbeat.discard(run.trial_id)
            self.live.remove(run)

    def _report_all(self, runs: list[LiveTrial]) -> None:
        """The round's ``trial.report`` of every trial, in one storage transaction (see
        OwnTrialsCache.set_trial_intermediate_values); committed before any decision, so a
        worker killed after it resumes with the reports in the storage and decides anew
        (recovery.py), as one killed between a report and its decision did. Should a
        trial be finished elsewhere, nothing is written here, and _decide's own
        ``trial.report`` per trial says which (the reports it finds made are skipped)."""
        storage = self.study._storage
        batched = getattr(storage, "set_trial_intermediate_values", None)
        if batched is None or len(self.study.directions) > 1:
            return  # (Trial.report refuses multi-objective studies: left to say so)
        writes: list[tuple[LiveTrial, int, float]] = []
        for run in runs:
            known = run.trial._cached_frozen_trial.intermediate_values
            # Trial.report's conversions and checks, as it would make them
            writes += [(run, step, float(run.history[step - 1]))
                       for step in range(run.reported + 1, run.epoch + 1) if step not in known]
        try:
            batched([(run.trial_id, step, value) for run, step, value in writes])
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            return
        for run, step, value in writes:
            run.trial._cached_frozen_trial.intermediate_values[step] = value
        for run in runs:
            run.reported = max(run.reported, run.epoch)

    def _should_prune(self, run: LiveTrial) -> bool:
        """``trial.should_prune()``; for the pruners that compare with complete trials
        (median, percentile), against the trials a one-at-a-time study would have
        finished before this one (pruning.py: the complete ones, and those numbered
        below it still training, here or elsewhere), with one storage read per round."""
        pruner = self.study.pruner
        if isinstance(pruner, optuna.pruners.NopPruner):
            return False
        if not in_sequence(pruner):
            return run.trial.should_prune()
        if self._view is None:
            trials = self.study.get_trials(deepcopy=False,
                                           states=(TrialState.COMPLETE, TrialState.RUNNING))
            mine = {r.trial_id for r in self.live}
            self._view = ([t for t in trials if t.state == TrialState.COMPLETE],
                          [Reference(t.number, t.intermediate_values) for t in trials
                           if t.state == TrialState.RUNNING and t._trial_id not in mine])
        complete, elsewhere = self._view
        here = [Reference(r.number, {k + 1: v for k, v in enumerate(r.history)})
                for r in self.live if r.number not in self._out_now and r is not run]
        return prune_in_sequence(pruner, self.study, run.number, run.trial_id,
                                 {k + 1: v for k, v in enumerate(run.history)},
                                 complete, here + elsewhere)

    def _record(self, run: LiveTrial) -> None:
        """What it takes to retrain the trial alone: the data order keys of its epochs."""
        run.trial.set_user_attr("hftc_orders", run.orders)
        run.trial.set_user_attr("hftc_worker", self.worker_id)

    def _save_if_best(self, run: LiveTrial, value: float) -> None:
        try:
            best = self.study.best_value
        except ValueError:
            best = None
        better = best is None or (value >= best if self.spec.direction == "maximize"
                                  else value <= best)
        if better:
            save(self._model_state(run), self.out / "trials" / f"trial-{run.number}.pt")

