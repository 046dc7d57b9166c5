"""hftc.sweep.storage.OwnTrialsCache: what each read returns is what a fresh read of the
database returns, whoever wrote it, and a sweep through it asks and prunes what it does
through Optuna's own cache."""

from __future__ import annotations

import random

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.storages._cached_storage import _CachedStorage
from optuna.trial import TrialState

from hftc.sweep import engine
from hftc.sweep.storage import OwnTrialsCache, make_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _same_as_database(cache: OwnTrialsCache, fresh: optuna.storages.RDBStorage,
                      study_id: int) -> None:
    want = fresh.get_all_trials(study_id, deepcopy=False)
    assert cache.get_all_trials(study_id, deepcopy=False) == want
    for t in want:
        assert cache.get_trial(t._trial_id) == t
    for states in ((TrialState.WAITING,), (TrialState.COMPLETE, TrialState.PRUNED)):
        assert cache.get_all_trials(study_id, states=states) == [
            t for t in want if t.state in states]


def _writes(storage, trial_id: int, rng: random.Random, step: int) -> None:
    """One write of a running trial, picked by ``rng``."""
    what = rng.randrange(4)
    if what == 0:
        storage.set_trial_param(trial_id, f"p{step}", rng.random(), FloatDistribution(0, 1))
    elif what == 1:
        storage.set_trial_intermediate_value(trial_id, step, rng.random())
    elif what == 2:
        storage.set_trial_user_attr(trial_id, f"u{step}", step)
    else:
        storage.set_trial_system_attr(trial_id, f"s{step}", step)


@pytest.mark.parametrize("seed", range(4))
def test_every_read_is_the_databases(tmp_path, seed):
    """Random writes by the cache's own process and by another worker (another storage
    object on the same file): new trials, params, values, attributes, finished trials, an
    enqueued trial the cache pops; after each, every read equals a fresh one."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    cache = OwnTrialsCache(make_storage(url))
    other = optuna.storages.RDBStorage(url)
    fresh = optuna.storages.RDBStorage(url)
    study_id = cache.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s")
    rng = random.Random(seed)
    running = {"own": [], "other": []}
    for step in range(60):
        who = rng.choice(["own", "other"])
        storage = cache if who == "own" else other
        action = rng.random()
        if action < 0.2 or not running[who]:
            running[who].append(storage.create_new_trial(study_id))
        elif action < 0.3:
            tid = running[who].pop(rng.randrange(len(running[who])))
            state = rng.choice([TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL])
            storage.set_trial_state_values(
                tid, state, [rng.random()] if state == TrialState.COMPLETE else None)
        elif action < 0.35:
            # another worker enqueues a trial; this one pops it (sets it RUNNING)
            waiting = other.create_new_trial(
                study_id, optuna.trial.create_trial(state=TrialState.WAITING))
            _same_as_database(cache, fresh, study_id)
            assert cache.set_trial_state_values(waiting, TrialState.RUNNING)
            running["own"].append(waiting)
        else:
            _writes(storage, rng.choice(running[who]), rng, step)
        _same_as_database(cache, fresh, study_id)


def test_reads_only_what_changed(tmp_path, monkeypatch):
    """Sixteen running trials of its own: a read after one of them is written reads that
    one (Optuna's cache reads all sixteen)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    backend = make_storage(url)
    cache = OwnTrialsCache(backend)
    study_id = cache.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s")
    trials = [cache.create_new_trial(study_id) for _ in range(16)]
    cache.get_all_trials(study_id)
    read = []
    real = type(backend)._get_trials

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        read.extend(t._trial_id for t in out)
        return out

    monkeypatch.setattr(type(backend), "_get_trials", counted)
    cache.set_trial_intermediate_value(trials[3], 1, 0.5)
    assert cache.get_all_trials(study_id)[3].intermediate_values == {1: 0.5}
    assert read == [trials[3]]
    read.clear()
    cache.get_all_trials(study_id)
    assert read == []


def test_a_sweep_asks_and_prunes_as_through_optunas_cache(tmp_path, monkeypatch):
    """The demo's spec, small, through OwnTrialsCache and through Optuna's _CachedStorage:
    the same trials, parameters, pruned epochs and values."""
    from hftc.sweep import run
    from hftc.sweep.digits import __name__ as digits

    def results(folder, cache_class):
        monkeypatch.setattr(engine, "OwnTrialsCache", cache_class)
        result = run(digits, n_trials=12, per_array=6, epochs=3, out=tmp_path / folder,
                     estimate=False, progress=False)
        return [(t.number, t.state, t.params, t.intermediate_values, t.value)
                for t in sorted(result.study.trials, key=lambda t: t.number)]

    mine = results("own", OwnTrialsCache)
    optunas = results("optuna", _CachedStorage)
    assert mine == optunas
    assert any(t[1] == TrialState.PRUNED for t in mine)
