"""A round's reports in one storage transaction (decisions.Decisions._report_all,
storage.OwnTrialsCache.set_trial_intermediate_values): the same rows as one
``trial.report`` each, all of them in the storage when the round's decisions begin, none
lost by a kill between the reports and the decisions, and the sweep's trials those of the
path that reports one trial at a time, bit for bit."""

from __future__ import annotations

import math
import os
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from test_sweep_resume_exact import (  # the same small TPE + median-pruner sweep
    _in_a_fork,
    _outcome,
    _sweep,
)
from test_sweep_resume_exact import spec as spec  # noqa: F401 - the fixture
from test_sweep_resume_exact import uninterrupted as uninterrupted  # noqa: F401

from hftc.sweep import engine
from hftc.sweep.storage import OwnTrialsCache, make_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(tmp_path: Path, name: str) -> optuna.Study:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    return optuna.create_study(study_name=name, storage=OwnTrialsCache(make_storage(url)))


def _stored(study: optuna.Study) -> list[tuple]:
    """What a fresh process reads: another storage object, no cache."""
    fresh = optuna.load_study(study_name=study.study_name, storage=study._storage._backend.url)
    return [(t.number, t.state, t.intermediate_values) for t in fresh.trials]


def test_one_transaction_writes_what_a_report_each_writes(tmp_path):
    values = [0.5, float("inf"), float("-inf"), 1e-300, 2.0]
    batched, one_each = _study(tmp_path, "batched"), _study(tmp_path, "one_each")
    for study in (batched, one_each):
        trials = [study.ask() for _ in range(3)]
        if study is batched:
            study._storage.set_trial_intermediate_values(
                [(t._trial_id, step, v * (k + 1)) for k, t in enumerate(trials)
                 for step, v in enumerate(values)])
        else:
            for k, t in enumerate(trials):
                for step, v in enumerate(values):
                    t.report(v * (k + 1), step)
        # a rewrite of a stored step replaces it (a retried trial's), as Optuna's does
        study._storage.set_trial_intermediate_value(trials[0]._trial_id, 0, 7.0)
    assert _stored(batched) == _stored(one_each)
    assert _stored(batched)[0][2][0] == 7.0 and _stored(batched)[1][2][1] == math.inf
    # the cache reads the trials it wrote anew
    assert [t.intermediate_values for t in batched.trials] == [s[2] for s in _stored(batched)]


def test_a_finished_trial_in_the_batch_writes_none(tmp_path):
    study = _study(tmp_path, "s")
    a, b = study.ask(), study.ask()
    study.tell(b, 1.0)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        study._storage.set_trial_intermediate_values([(a._trial_id, 1, 0.5),
                                                      (b._trial_id, 1, 0.5)])
    assert [s[2] for s in _stored(study)] == [{}, {}]
    with pytest.raises(KeyError):
        study._storage.set_trial_intermediate_values([(a._trial_id + 99, 1, 0.5)])


def test_every_report_is_in_the_storage_when_the_decisions_begin(spec, uninterrupted,  # noqa: F811
                                                                 tmp_path, monkeypatch):
    seen: list[bool] = []
    report_all = engine.Sweep._report_all

    def checked(self, runs):
        report_all(self, runs)
        fresh = {t._trial_id: t for t in optuna.load_study(
            study_name=self.study.study_name, storage=self.storage.url).trials}
        for run in runs:
            stored = fresh[run.trial_id].intermediate_values
            seen.append(stored == {k + 1: v for k, v in enumerate(run.history)})
    monkeypatch.setattr(engine.Sweep, "_report_all", checked)
    result = _sweep(spec, tmp_path / "out", resume=False)
    assert len(seen) > 10 and all(seen)
    assert _outcome(result.study.trials) == uninterrupted


def test_the_sweep_equals_the_one_report_at_a_time_path(spec, uninterrupted,  # noqa: F811
                                                        tmp_path, monkeypatch):
    monkeypatch.setattr(engine.Sweep, "_report_all", lambda self, runs: None)
    result = _sweep(spec, tmp_path / "out", resume=False)
    assert _outcome(result.study.trials) == uninterrupted


@pytest.mark.parametrize("nth", [1, 3, 5])
def test_a_kill_after_the_reports_before_the_decisions_loses_no_decision(
        spec, uninterrupted, tmp_path, nth):  # noqa: F811
    """SIGKILL right after the round's reports are committed, none of its trials told,
    pruned or kept: the storage has the round's reports, and the resumed sweep decides
    that round as the one that never stopped did."""
    import signal

    out = tmp_path / "out"

    def killed_run() -> None:
        passes = 0
        report_all = engine.Sweep._report_all

        def hooked(self, runs):
            nonlocal passes
            report_all(self, runs)
            passes += 1
            if passes == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        engine.Sweep._report_all = hooked
        _sweep(spec, out, resume=False)

    assert _in_a_fork(killed_run) == "killed"
    url = f"sqlite:///{out / 'study.db'}"
    (name,) = optuna.get_all_study_names(url)
    left = optuna.load_study(study_name=name, storage=url).trials
    running = [t for t in left if t.state == TrialState.RUNNING]
    assert running and all(t.intermediate_values for t in running)
    assert _in_a_fork(lambda: _sweep(spec, out, resume=True)) == "finished"
    result = _sweep(spec, out, resume=True)
    assert _outcome(result.study.trials) == uninterrupted


@pytest.mark.skipif(not os.environ.get("HFTC_TEST_POSTGRES_URL"),
                    reason="needs HFTC_TEST_POSTGRES_URL (a PostgreSQL server)")
def test_the_batch_on_postgresql_is_all_or_none_and_read_by_a_fresh_study():
    import uuid

    url = os.environ["HFTC_TEST_POSTGRES_URL"]
    study = optuna.create_study(study_name=f"hunt6-{uuid.uuid4().hex}",
                                storage=OwnTrialsCache(make_storage(url)))
    try:
        a, b, c = study.ask(), study.ask(), study.ask()
        study._storage.set_trial_intermediate_values(
            [(a._trial_id, 1, 0.25), (b._trial_id, 1, float("nan")), (b._trial_id, 2, 1.0)])
        study.tell(c, 1.0)
        with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
            study._storage.set_trial_intermediate_values([(a._trial_id, 2, 0.5),
                                                          (c._trial_id, 1, 0.5)])
        stored = [s[2] for s in _stored(study)]
        assert stored[0] == {1: 0.25} and stored[2] == {}
        assert math.isnan(stored[1][1]) and stored[1][2] == 1.0
    finally:
        optuna.delete_study(study_name=study.study_name, storage=url)
