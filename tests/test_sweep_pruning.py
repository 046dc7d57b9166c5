"""Pruning inside a fused array (hftc.sweep.pruning): trials that train side by side prune
each other as trials run one after another would, not only once some complete."""

from __future__ import annotations

import optuna
import torch
from optuna.trial import TrialState
from torch import nn

import hftc.sweep as hs
from hftc.sweep.pruning import Reference, in_sequence, prune_in_sequence


def _study(pruner):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(direction="maximize", pruner=pruner)


def test_running_trials_below_count_those_above_do_not():
    """Trial 5 at step 2 is compared with the running trials 0..4 (one at a time they
    would be over); trial 5 is not in trial 2's reference."""
    pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0)
    study = _study(pruner)
    running = [Reference(k, {1: 0.5, 2: 0.9}) for k in range(5)]
    assert prune_in_sequence(pruner, study, 5, 5, {1: 0.4, 2: 0.5}, [], running)
    assert not prune_in_sequence(pruner, study, 5, 5, {1: 0.4, 2: 0.95}, [], running)
    # below n_startup_trials: trial 2 sees 0 and 1 only (not 3 and 4, numbered above it)
    assert not prune_in_sequence(pruner, study, 2, 2, {1: 0.1, 2: 0.1}, [], running)
    # a reference that has not reached the step does not count
    behind = [Reference(k, {1: 0.9}) for k in range(5)]
    assert not prune_in_sequence(pruner, study, 5, 5, {1: 0.4, 2: 0.1}, [], behind)


def test_rule_is_for_percentile_pruners_only():
    assert in_sequence(optuna.pruners.MedianPruner())
    assert in_sequence(optuna.pruners.PercentilePruner(25.0))
    assert not in_sequence(optuna.pruners.SuccessiveHalvingPruner())
    assert not in_sequence(optuna.pruners.NopPruner())



def test_a_patient_pruner_wrapping_a_median_one_prunes_as_one_at_a_time():
    """``PatientPruner(MedianPruner())``: the trial's own patience, then the median
    against the complete trials and the running ones numbered below (it compared with
    the complete ones only, so an array whose trials start together pruned none)."""
    import warnings

    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    scores = {0: [1.0, 1.0, 1.0], 1: [0.9, 0.5, 0.4], 2: [1.1, 1.2, 1.3]}  # 1 gets worse

    def pruner():
        return optuna.pruners.PatientPruner(optuna.pruners.MedianPruner(n_startup_trials=1),
                                            patience=0)

    def alone(trial):
        for step, value in enumerate(scores[trial.number]):
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    def objective(array):
        for step in range(3):
            array.report([scores[n][step] for n in array.numbers], step)
        return [scores[n][2] for n in array.numbers]

    one_at_a_time, fused = _study(pruner()), _study(pruner())
    one_at_a_time.optimize(alone, n_trials=3)
    hs.optimize(fused, objective, n_trials=3, array_size=3)
    states = [(t.state, t.last_step) for t in fused.get_trials()]
    assert states == [(t.state, t.last_step) for t in one_at_a_time.get_trials()]
    assert states[1] == (TrialState.PRUNED, 1)
    assert in_sequence(pruner()) and not in_sequence(optuna.pruners.PatientPruner(None, 1))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(1)
    return (x[:128], y[:128]), (x[128:], y[128:])


def _spec(**kw):
    def space(trial):
        return {"lr": trial.suggest_float("lr", 1e-4, 1.0, log=True)}

    return hs.SweepSpec(name="prune", space=space, model=lambda p: _Net(), data=_data,
                        metric="accuracy", direction="maximize", epochs=5, batch_size=32,
                        n_trials=8, per_array=8, pruner="median", **kw)


def test_one_array_prunes_before_any_trial_completes(tmp_path):
    """8 trials in one array, none complete before epoch 5: the median pruner (4 startup
    trials, 2 warm-up steps) still prunes trials from epoch 2, as one at a time it would."""
    result = hs.run(_spec(), out=tmp_path / "s", progress=False)
    trials = result.study.get_trials()
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert pruned, [(t.state.name, len(t.intermediate_values)) for t in trials]
    assert all(t.number >= 4 for t in pruned)  # the startup trials are never pruned
    assert min(len(t.intermediate_values) for t in pruned) < 5
    assert result.trial_epochs < 8 * 5


def test_trial_array_prunes_within_the_array(tmp_path):
    """hftc.sweep.optimize: an array of 6 whose trials all start together prunes the
    worse ones at the first step after warm-up, against the trials numbered below."""
    study = optuna.create_study(
        direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    scores = [0.9, 0.8, 0.1, 0.95, 0.2, 0.85]  # the value every step of trial k

    def objective(array):
        for step in range(3):
            array.report([scores[t.number] for t in array.trials], step)
        return [scores[t.number] for t in array.trials]

    hs.optimize(study, objective, n_trials=6, array_size=6)
    states = {t.number: t.state for t in study.get_trials()}
    # 2 vs {0, 1}: below their median, pruned; 3 kept; 4 vs {0, 1, 3}: pruned; 5 vs
    # {0, 1, 3}: median 0.9 > 0.85, pruned: as one at a time (0 and 1 complete first)
    assert states == {0: TrialState.COMPLETE, 1: TrialState.COMPLETE, 2: TrialState.PRUNED,
                      3: TrialState.COMPLETE, 4: TrialState.PRUNED, 5: TrialState.PRUNED}


def test_the_leaderboard_shows_a_huge_loss_in_a_few_digits():
    """A trial whose loss grew to 1e172 (finite: it completes) made the leaderboard's metric
    column 180 characters wide (f"{v:.4f}")."""
    from hftc.sweep.report import leaderboard

    study = optuna.create_study(direction="minimize")
    for value in (0.5, 1.1786207461281906e172):
        study.add_trial(optuna.trial.create_trial(value=value, params={}, distributions={},
                                                  intermediate_values={1: value}))
    board = leaderboard(study, "loss")
    assert "0.5000" in board and "1.179e+172" in board
    assert max(len(line) for line in board.splitlines()) < 60
