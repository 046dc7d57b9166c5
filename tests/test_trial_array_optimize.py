"""hftc.sweep.optimize takes what optuna.Study.optimize takes, with its meaning; TrialArray's
one-liners equal the list comprehensions over array.trials they stand for."""

from __future__ import annotations

import gc

import optuna
import pytest
import torch
from optuna.trial import TrialState
from torch import nn

import hftc
import hftc.sweep as hs
from hftc.errors import SweepError

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(seed=0, pruner=None):
    return optuna.create_study(direction="maximize",
                               sampler=optuna.samplers.RandomSampler(seed=seed),
                               pruner=pruner or optuna.pruners.NopPruner())


def _values(array):
    return [float(t.number) for t in array.trials]


def test_suggestions_are_one_value_per_trial_as_the_comprehension():
    seen = {}

    def objective(array):
        seen["lr"] = array.suggest_float("lr", 1e-4, 1e-1, log=True)
        seen["width"] = array.suggest_int("width", 4, 32, step=4)
        seen["act"] = array.suggest_categorical("act", ["relu", "tanh"])
        seen["q"] = array.suggest_float("q", 0.0, 1.0, step=0.25)
        seen["params"] = array.params()
        return _values(array)

    a, b = _study(3), _study(3)
    hs.optimize(a, objective, n_trials=4, array_size=4)

    def by_hand(array):
        lrs = [t.suggest_float("lr", 1e-4, 1e-1, log=True) for t in array.trials]
        widths = [t.suggest_int("width", 4, 32, step=4) for t in array.trials]
        acts = [t.suggest_categorical("act", ["relu", "tanh"]) for t in array.trials]
        qs = [t.suggest_float("q", 0.0, 1.0, step=0.25) for t in array.trials]
        assert (lrs, widths, acts, qs) == (seen["lr"], seen["width"], seen["act"], seen["q"])
        return _values(array)

    hs.optimize(b, by_hand, n_trials=4, array_size=4)
    assert len(seen["lr"]) == 4 and all(w % 4 == 0 for w in seen["width"])
    assert seen["params"] == [t.params for t in a.get_trials()]


def test_fuse_takes_a_function_of_the_trial():
    def objective(array):
        widths = array.suggest_int("width", 2, 2)
        fused = array.fuse(lambda t: nn.Linear(3, t.params["width"]))
        assert isinstance(fused, hftc.FusedModule) and fused.num_models == len(widths) == 3
        return _values(array)

    hs.optimize(_study(), objective, n_trials=3, array_size=3)


def test_should_prune_answers_per_trial_without_dropping():
    study = _study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    scores = [0.9, 0.8, 0.1, 0.95]
    answers = {}

    def objective(array):
        for t in array.trials:
            t.report(scores[t.number], 0)
        answers["prune"] = array.should_prune()
        assert len(array) == 4  # nothing dropped
        return [scores[t.number] for t in array.trials]

    hs.optimize(study, objective, n_trials=4, array_size=4)
    assert answers["prune"] == [False, False, True, False]


def test_callbacks_see_every_finished_trial_pruned_ones_included():
    study = _study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0))
    finished = []

    def objective(array):
        array.report([1.0 - 0.1 * t.number for t in array.trials], 0)
        return [1.0 - 0.1 * t.number for t in array.trials]

    hs.optimize(study, objective, n_trials=6, array_size=3,
                callbacks=[lambda s, ft: finished.append((ft.number, ft.state))])
    assert sorted(n for n, _ in finished) == list(range(6))
    states = dict(finished)
    assert states == {t.number: t.state for t in study.get_trials()}
    assert TrialState.PRUNED in states.values()


def test_study_stop_in_a_callback_ends_after_the_array():
    study = _study()

    def stop_at_4(s, frozen):
        if frozen.number == 4:
            s.stop()

    hs.optimize(study, _values, n_trials=None, array_size=3, callbacks=[stop_at_4])
    assert len(study.trials) == 6  # the array of trials 3-5 finishes, no other starts


def test_timeout_starts_no_new_array():
    study = _study()
    hs.optimize(study, _values, n_trials=None, array_size=2, timeout=0.0)
    assert len(study.trials) == 0  # as Optuna's optimize: the clock is read before a trial
    reference = _study()
    reference.optimize(lambda t: 0.0, n_trials=None, timeout=0.0)
    assert len(reference.trials) == 0

    def slow(array):
        import time

        time.sleep(0.3)
        return _values(array)

    study = _study()
    hs.optimize(study, slow, n_trials=None, array_size=2, timeout=0.2)
    assert len(study.trials) == 2  # the first array ran out the clock: no second


def test_n_trials_none_with_timeout_and_gc(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    study = _study()
    hs.optimize(study, _values, n_trials=5, array_size=2, gc_after_trial=True)
    assert len(study.trials) == 5 and len(collected) == 3  # arrays of 2, 2, 1


def test_catch_fails_and_continues_others_raise():
    study = _study()

    def objective(array):
        if array.trials[0].number == 0:
            raise ValueError("bad array")
        return _values(array)

    hs.optimize(study, objective, n_trials=4, array_size=2, catch=ValueError)
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL] * 2 + [TrialState.COMPLETE] * 2
    with pytest.raises(ValueError, match="bad array"):
        hs.optimize(_study(), objective, n_trials=4, array_size=2, catch=(KeyError,))


def test_progress_bar_and_bad_arguments(capsys):
    hs.optimize(_study(), _values, n_trials=2, array_size=2, show_progress_bar=True)
    with pytest.raises(SweepError, match="n_jobs"):
        hs.optimize(_study(), _values, n_trials=2, array_size=2, n_jobs=2)
    with pytest.raises(SweepError, match="timeout"):
        hs.optimize(_study(), _values, n_trials=2, array_size=2, timeout=-1)
    with pytest.raises(SweepError, match="n_trials"):
        hs.optimize(_study(), _values, n_trials=-1, array_size=2)


def test_report_takes_a_tensor():
    def objective(array):
        array.report(torch.tensor([0.5] * len(array)), 0)
        return torch.tensor([0.5] * len(array))

    study = _study()
    hs.optimize(study, objective, n_trials=2, array_size=2)
    assert [t.value for t in study.get_trials()] == [0.5, 0.5]


def test_a_return_of_the_wrong_shape_fails_the_trials_and_names_the_objective():
    """``return losses.mean()`` for N trials: a SweepError naming the objective's file and
    line, and the array's trials FAIL (they were left RUNNING in storage)."""
    def objective(array):
        return torch.tensor([1.0, 2.0]).mean()

    study = _study()
    with pytest.raises(SweepError, match=r"objective objective \(.*test_trial_array_optimize"
                                         r"\.py:\d+\) returned.*one number.*not their \.mean"):
        hs.optimize(study, objective, n_trials=2, array_size=2)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL] * 2
    assert "one number" in study.trials[0].user_attrs["hftc_fail_reason"]
    with pytest.raises(SweepError, match=r"one number \(0\.5\) for the array's 2"):
        hs.optimize(_study(), lambda array: array.report(0.5, 0), n_trials=2, array_size=2)
    with pytest.raises(SweepError, match=r"got 6 values \(a tensor of shape \[2, 3\]\) for "
                                         r"the array's 2 live trials.*\.mean\(1\)"):
        hs.optimize(_study(), lambda array: torch.zeros(2, 3), n_trials=2, array_size=2)
    with pytest.raises(SweepError, match=r"got a dict; give a list in the order of array"):
        hs.optimize(_study(), lambda array: array.report({n: 0.5 for n in array.numbers}, 0),
                    n_trials=2, array_size=2)  # list(dict) reported the trial numbers


def test_an_array_of_one_takes_a_plain_number_as_objective_trial_returns():
    def objective(array):
        array.report(float(array.trials[0].number), 0)
        return float(array.trials[0].number)

    study = _study()
    hs.optimize(study, objective, n_trials=3, array_size=1)
    assert [t.value for t in study.get_trials()] == [0.0, 1.0, 2.0]
    assert [t.intermediate_values for t in study.get_trials()] == [{0: 0.0}, {0: 1.0}, {0: 2.0}]


def test_a_multi_objective_study_takes_each_trials_values():
    """``directions=[...]``: each trial's values, a list of K per trial or an [N, K]
    tensor; report, which Optuna refuses for several objectives, says so."""
    def as_lists(array):
        return [[float(n), -float(n)] for n in array.numbers]

    def as_tensor(array):
        n = torch.tensor(array.numbers, dtype=torch.float64)
        return torch.stack([n, -n], 1)

    for objective in (as_lists, as_tensor):
        study = optuna.create_study(directions=["minimize", "maximize"])
        hs.optimize(study, objective, n_trials=3, array_size=2)
        assert [t.values for t in study.get_trials()] == [[0.0, -0.0], [1.0, -1.0], [2.0, -2.0]]
    study = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(SweepError, match="2 objectives.*return each trial's values"):
        hs.optimize(study, lambda array: array.report([0.0] * len(array), 0), n_trials=2)
    with pytest.raises(SweepError, match="should_prune: the study has 2 objectives"):
        hs.optimize(optuna.create_study(directions=["minimize", "maximize"]),
                    lambda array: array.should_prune(), n_trials=2)
    with pytest.raises(SweepError, match=r"the value for trial 0 is 1\.0.*2 values"):
        hs.optimize(optuna.create_study(directions=["minimize", "maximize"]),
                    lambda array: [1.0, 2.0, 3.0], n_trials=3, array_size=3)


def test_ctrl_c_fails_the_arrays_trials_as_optuna_does():
    def objective(array):
        raise KeyboardInterrupt

    study = _study()
    with pytest.raises(KeyboardInterrupt):
        hs.optimize(study, objective, n_trials=2, array_size=2)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL] * 2


def test_trials_of_other_architectures_are_refused_with_what_to_do_in_an_array():
    """``suggest_int("n_layers")`` per trial: the MismatchError names each trial's params
    and the array's ways out (pad_widths, one optimize per architecture), not
    fuse_groups, which cannot make one module of them."""
    def objective(array):
        layers = array.suggest_int("n_layers", 1, 2)
        array.fuse([nn.Sequential(*[nn.Linear(4, 4) for _ in range(k)]) for k in layers])
        return _values(array)

    study = _study(seed=1)
    for params in ({"n_layers": 1}, {"n_layers": 2}):
        study.enqueue_trial(params)
    with pytest.raises(hftc.errors.MismatchError) as info:
        hs.optimize(study, objective, n_trials=2, array_size=2)
    text = str(info.value)
    assert "trial 0: {'n_layers': 1}; trial 1: {'n_layers': 2}" in text
    assert "pad_widths=True" in text and "one hftc.sweep.optimize per architecture" in text
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL] * 2


def test_values_may_be_one_element_tensors_or_numpy_numbers_as_float_takes_them():
    import numpy as np

    def objective(array):
        array.report([torch.tensor([float(n)]) for n in array.numbers], 0)
        array.report(np.array(array.numbers, dtype=np.float32), 1)
        return [np.float64(n) for n in array.numbers]

    study = _study()
    hs.optimize(study, objective, n_trials=2, array_size=2)
    assert [t.intermediate_values for t in study.get_trials()] == [{0: 0.0, 1: 0.0},
                                                                   {0: 1.0, 1: 1.0}]
    assert [t.value for t in study.get_trials()] == [0.0, 1.0]


def test_a_callbacks_error_comes_out_and_no_trial_is_told_twice_or_left_running():
    """A callback raising on a pruned trial within ``report`` (and on a completed one):
    its error comes out as study.optimize lets it (not Optuna's UpdateFinishedTrialError,
    optimize failing the told trial again), the told trial keeps its state and the
    others FAIL."""
    class PruneTrial0(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 0

    def callback(study, frozen):
        raise RuntimeError(f"callback on trial {frozen.number}")

    def objective(array):
        array.report(_values(array), 0)
        return _values(array)

    for pruner, first in ((PruneTrial0(), TrialState.PRUNED), (None, TrialState.COMPLETE)):
        study = _study(pruner=pruner)
        with pytest.raises(RuntimeError, match="callback on trial 0"):
            hs.optimize(study, objective, n_trials=3, array_size=3, callbacks=[callback])
        assert [t.state for t in study.get_trials()] == [first] + [TrialState.FAIL] * 2


def test_if_and_equality_on_per_trial_values_raise_instead_of_asking_the_list():
    """``if array.should_prune(): raise optuna.TrialPruned()`` (a non-empty list is true:
    every trial pruned at the first report) and ``array.suggest_categorical(...) == "Adam"``
    (always false: every trial built the other way while its params say Adam) were
    silent; they raise a SweepError saying to take each trial's value."""
    def objective(array):
        array.report(_values(array), 0)
        if array.should_prune():
            raise optuna.TrialPruned()
        return _values(array)

    study = _study()
    with pytest.raises(SweepError, match=r"`if` \(bool\) on array.should_prune\(\).*"
                                         r"zip\(array.trials, values\).*report.*drops"):
        hs.optimize(study, objective, n_trials=2, array_size=2)

    def by_name(array):
        if array.suggest_categorical("optimizer", ["Adam", "SGD"]) == "Adam":
            pass
        return _values(array)

    with pytest.raises(SweepError, match=r"`== 'Adam'` on array.suggest_categorical"
                                         r"\('optimizer', \.\.\.\)"):
        hs.optimize(_study(), by_name, n_trials=2, array_size=2)

    def per_trial(array):  # what the message says: each trial's own value
        names = array.suggest_categorical("optimizer", ["Adam", "SGD"])
        assert names == [t.params["optimizer"] for t in array.trials] and len(names) == 2
        assert [n == "Adam" for n in names] == [t.params["optimizer"] == "Adam"
                                                 for t in array.trials]
        assert not any(array.should_prune())
        lrs = array.suggest_float("lr", 0.1, 0.1)  # a list's comparisons still answer
        assert lrs == pytest.approx([0.1, 0.1]) and lrs != [0.2, 0.2] and lrs != (0.1, 0.1)
        return _values(array)

    hs.optimize(_study(), per_trial, n_trials=2, array_size=2)


def test_a_stock_optimizer_is_refused_at_the_first_drop_naming_report():
    """The stock optimizer stepped, then report drops trial 0: the FusionTypeError says
    it comes from TrialArray.report dropping it, with hftc.optim.SGD to use."""
    class PruneTrial0(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 0

    def objective(array):
        fused = array.fuse([nn.Linear(2, 1) for _ in array.trials])
        opt = torch.optim.SGD(fused.parameters(), lr=0.1)
        fused(torch.ones(3, 2)).sum().backward()
        opt.step()
        array.report(_values(array), 0)

    study = _study(pruner=PruneTrial0())
    with pytest.raises(hftc.errors.FusionTypeError,
                       match=r"TrialArray.report, dropping the pruned / failed models \[0\] "
                             r"\(hftc.keep_models\): .*stock torch.optim.SGD.*hftc.optim.SGD"):
        hs.optimize(study, objective, n_trials=2, array_size=2)
    assert [t.state for t in study.get_trials()] == [TrialState.PRUNED, TrialState.FAIL]


def test_raising_trial_pruned_per_trial_warns_that_it_prunes_the_kept_trials_too():
    """``t.report(v, step); if t.should_prune(): raise optuna.TrialPruned()`` per trial
    prunes the whole array: a SweepWarning at the raise names the trials the pruner
    keeps and array.report (what drops the pruned one only)."""
    class PruneTrial0(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 0

    def objective(array):
        for t in array.trials:
            t.report(float(t.number), 0)
            if t.should_prune():
                raise optuna.TrialPruned()
        return _values(array)

    study = _study(pruner=PruneTrial0())
    with pytest.warns(hftc.errors.SweepWarning,
                      match=r"TrialPruned raised at .*test_trial_array_optimize.py:\d+ prunes "
                            r"all 2 live trials of the array \[0, 1\], trials \[1\] too.*"
                            r"array.report\(values, step\)"):
        hs.optimize(study, objective, n_trials=2, array_size=2)
    assert [t.state for t in study.get_trials()] == [TrialState.PRUNED] * 2  # as documented


def test_a_grid_sampler_runs_its_grid_as_study_optimize_does_no_repeats():
    """A grid of 3 with arrays of 4: one array of the 3 points (it asked a 4th, a repeat
    of a running point), then the grid's study.stop() ends the loop, as study.optimize."""
    import warnings

    def objective(array):
        return [t.suggest_float("lr", 1e-4, 1.0) for t in array.trials]

    def grid_study():
        return optuna.create_study(
            sampler=optuna.samplers.GridSampler({"lr": [0.1, 0.01, 0.001]}, seed=0))

    fused, one_at_a_time = grid_study(), grid_study()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna warns when it re-evaluates a grid point
        hs.optimize(fused, objective, n_trials=10, array_size=4)
    one_at_a_time.optimize(lambda t: t.suggest_float("lr", 1e-4, 1.0), n_trials=10)
    assert sorted(t.params["lr"] for t in fused.trials) == [0.001, 0.01, 0.1]
    assert len(fused.trials) == len(one_at_a_time.trials) == 3


def test_fuse_of_one_sequential_is_refused_not_fused_layer_by_layer():
    """``array.fuse(nn.Sequential(a, b))`` with 2 trials fused the two layers as the two
    trials' models (a Sequential iterates over its layers); it is refused."""
    def objective(array):
        array.fuse(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        return _values(array)

    study = _study()
    with pytest.raises(SweepError, match=r"fuse got one Sequential, not one model per trial.*"
                                         r"lambda trial: Net\(\)"):
        hs.optimize(study, objective, n_trials=2, array_size=2)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL] * 2


def test_a_heartbeat_storage_beats_for_the_arrays_trials_and_fails_stale_ones(tmp_path):
    """``RDBStorage(heartbeat_interval=...)``: as study.optimize, optimize fails a dead
    worker's stale trials before asking, and records a heartbeat for each live trial of
    the array while it trains (it recorded none: a crashed worker's trials stayed RUNNING
    for ever, where docs/SWEEP.md said Optuna's heartbeat applies)."""
    import time
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental heartbeat; the ask below warns
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'hb.db'}",
                                             heartbeat_interval=60, grace_period=120)
        study = optuna.create_study(storage=storage)
        dead = study.ask()  # a worker that died with its trial running (Optuna warns)
    storage._get_stale_trial_ids = lambda study_id: [dead._trial_id]  # as if 120 s passed
    beats = set()
    record = storage.record_heartbeat
    storage.record_heartbeat = lambda trial_id: (record(trial_id), beats.add(trial_id))

    def objective(array):
        storage._get_stale_trial_ids = lambda study_id: []
        ids = {t._trial_id for t in array.trials}
        for _ in range(300):  # the heartbeat thread's first beat (it beats at once)
            if ids <= beats:
                break
            time.sleep(0.1)
        assert ids <= beats, (ids, beats)
        return _values(array)

    hs.optimize(study, objective, n_trials=2, array_size=2)
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
