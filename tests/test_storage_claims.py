"""Workers asking one SQLite study at the same moment never get the same trial.

Optuna pops an enqueued (or retried) trial with ``SELECT ... FOR UPDATE``, which SQLite
ignores: without ``hftc.sweep.storage.one_worker_per_trial`` two processes asking at
once both read a trial WAITING and both train it (reproduced: 20 asks by 4 processes
gave 14 to 17 distinct trials).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from hftc.sweep.storage import make_storage, one_worker_per_trial

ROOT = Path(__file__).resolve().parents[1]

# One worker: load the study, wait for the common start, ask `asks` trials, print their ids.
WORKER = """
import json, sys, time, warnings
import optuna
sys.path.insert(0, {root!r})
from hftc.sweep.storage import make_storage, one_worker_per_trial
optuna.logging.set_verbosity(optuna.logging.ERROR)
warnings.simplefilter("ignore")
if {hftc_storage!r}:
    storage = make_storage({url!r})
else:  # the user's own storage, as hftc.sweep.optimize hardens it
    storage = optuna.storages.RDBStorage({url!r})
    one_worker_per_trial(storage)
study = optuna.load_study(study_name="claims", storage=storage)
while time.time() < {start!r}:
    pass
print(json.dumps([study.ask()._trial_id for _ in range({asks})]))
"""


def _asked_ids(url: str, hftc_storage: bool, workers: int = 4, asks: int = 5) -> list[int]:
    start = time.time() + 6  # every worker has loaded the study by then, on a slow machine
    procs = [subprocess.Popen([sys.executable, "-c", WORKER.format(
        root=str(ROOT), hftc_storage=hftc_storage, url=url, start=start, asks=asks)],
        stdout=subprocess.PIPE, text=True) for _ in range(workers)]
    ids = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        ids += json.loads(out.strip().splitlines()[-1])
    return ids


@pytest.mark.parametrize("hftc_storage", [True, False], ids=["make_storage", "users_storage"])
def test_concurrent_asks_on_sqlite_each_get_their_own_enqueued_trial(tmp_path: Path,
                                                                       hftc_storage: bool):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="claims", storage=make_storage(url))
    for i in range(20):
        study.enqueue_trial({"x": i})
    ids = _asked_ids(url, hftc_storage)
    assert len(ids) == 20
    assert len(set(ids)) == 20, f"a trial went to two workers: {sorted(ids)}"
    trials = study.trials  # the 20 enqueued, each asked once, and no new trial
    assert [t.state for t in trials] == [optuna.trial.TrialState.RUNNING] * 20


def test_the_storage_is_hardened_once_and_still_reads_and_writes(tmp_path: Path):
    import sqlalchemy

    from hftc.sweep import storage as hstorage

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'one.db'}")
    one_worker_per_trial(storage)
    one_worker_per_trial(storage)
    assert sqlalchemy.event.contains(storage.engine, "begin", hstorage._begin_immediate)
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    assert len(study.trials) == 3 and all(t.value is not None for t in study.trials)
    one_worker_per_trial(optuna.storages.InMemoryStorage())  # not a database: nothing to do
