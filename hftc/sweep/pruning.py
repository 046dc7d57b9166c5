"""Pruning inside a fused array: trials that train side by side prune each other as
early as trials run one after another would.

The problem. Optuna's ``MedianPruner`` / ``PercentilePruner`` compare trial k at step e
with the values at e of the COMPLETE trials (and ``n_startup_trials`` counts complete
trials); Ray Tune's ``MedianStoppingRule`` does the same with completed trials (and
pauses a trial, ``min_time_slice``, while there are too few). Run one at a time, trial
k sees the k trials before it finished. Run 16 at a time in one array, the first 16
see nothing complete for their whole training and none is pruned: a 48-trial digits
sweep trained 355 trial-epochs where the one-at-a-time study trained 173.

The rule (the one-at-a-time order, kept). Trial k at step e is compared with the trials
a one-at-a-time study would have finished before it::

    reference(k, e) = every COMPLETE trial
                    + every trial numbered below k that is still RUNNING and has
                      reached step e (its value at e), whichever array or worker runs it

A trial numbered below k was asked no later than k, so one at a time it would be over
by now: complete (here it is still running, and its value at e is known) or pruned
(here it is pruned too, and left out, as Optuna leaves pruned trials out). Decisions are
taken in trial-number order within a round, so a trial pruned at this step is out of
the reference of those after it, as in the sequential study. The pruner itself is
unchanged: the same ``pruner.prune(study, trial)`` call (its percentile,
``n_startup_trials``, ``n_warmup_steps``, ``interval_steps``, ``n_min_trials``), only
the trials it reads as complete are these; so the same pruner prunes about the same
trials at the same epochs as one at a time (measured in docs/SWEEP.md), and refilled
places start new trials at once (the sweep asks as many as it pruned, every round).

Why not the other schemes. A median over every trial that reached step e, running or
not (Ray Tune's and Optuna's rung-based pruners, ``SuccessiveHalvingPruner``,
``HyperbandPruner``, Ray Tune's ASHA, which compare within a rung with every trial that
reached it) is another algorithm with its own budget, and it lets later trials weigh on
earlier ones, which one at a time never happens; those pruners already read running
trials and are passed to Optuna unchanged. The rule above changes nothing for a study
run one at a time (no trial below k is still running then) and is a function of the
trials' numbers and values: a resumed worker decides as the dead one did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import optuna
from optuna.trial import TrialState

__all__ = ["in_sequence", "Reference", "prune_in_sequence"]


def in_sequence(pruner: optuna.pruners.BasePruner) -> bool:
    """Does the rule of this module apply to ``pruner``? (Optuna's pruners that compare
    with complete trials only: ``MedianPruner`` and ``PercentilePruner``, and their
    subclasses, whose ``prune`` reads the study it is given; and a ``PatientPruner``
    wrapping one: ``PatientPruner(MedianPruner())`` checks the trial's own patience, then
    asks the median pruner with the study it was given, so the rule applies to it too.)"""
    if isinstance(pruner, optuna.pruners.PatientPruner):
        wrapped = pruner._wrapped_pruner  # no public accessor; None: patience alone
        return wrapped is not None and in_sequence(wrapped)
    return isinstance(pruner, optuna.pruners.PercentilePruner)


@dataclass
class Reference:
    """What the percentile pruner reads of a trial: its number and its values per step."""

    number: int
    intermediate_values: Mapping[int, float] = field(default_factory=dict)


class _AsSequential:
    """The study as the pruner sees it for one decision: its direction, and the reference
    trials where it asks for the complete ones (any other question goes to the study)."""

    def __init__(self, study: optuna.Study, reference: list):
        self._study, self._reference = study, reference
        self.direction = study.direction

    def __getattr__(self, name: str):
        # A user's pruner (a MedianPruner subclass) may read more of the study than
        # Optuna's does: study.trials, study.directions, study.user_attrs ...
        study = self.__dict__.get("_study")
        if study is None:
            raise AttributeError(name)
        return getattr(study, name)

    def get_trials(self, deepcopy: bool = True, states=None):
        if states is not None and tuple(states) == (TrialState.COMPLETE,):
            return list(self._reference)
        return self._study.get_trials(deepcopy=deepcopy, states=states)


def prune_in_sequence(pruner: optuna.pruners.BasePruner, study: optuna.Study, number: int,
                      trial_id: int, values: Mapping[int, float], complete: Iterable,
                      running: Iterable[Reference]) -> bool:
    """Should trial ``number`` (its ``values`` per step so far) be pruned, compared with
    ``complete`` trials and those of ``running`` numbered below it that reached its
    step (the module docstring)? ``pruner`` is a :func:`in_sequence` pruner."""
    if not values:
        return False
    step = max(values)
    done = [t for t in complete if t.number != number]
    numbers = {t.number for t in done}
    reference = done + [r for r in running if r.number < number and r.number not in numbers
                        and step in r.intermediate_values]
    frozen = optuna.trial.FrozenTrial(
        number=number, state=TrialState.RUNNING, value=None, datetime_start=None,
        datetime_complete=None, params={}, distributions={}, user_attrs={}, system_attrs={},
        trial_id=trial_id, intermediate_values=dict(values))
    return pruner.prune(_AsSequential(study, reference), frozen)
