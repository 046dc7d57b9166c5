"""hftc.sweep.optimize from two processes on one study (SQLite file, PostgreSQL): every
trial is asked and told once, none is lost (none left RUNNING), each process runs its
n_trials (as study.optimize does), and each trial's values are its own (equal to the
trial trained alone), whichever process ran it.  PostgreSQL: HFTC_TEST_POSTGRES_URL
(skipped without it, failed in CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from trial_array_worker import STEPS, alone, storage_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "trial_array_worker.py"
N_TRIALS, ARRAY_SIZE = 5, 2  # per process: arrays of 2, 2 and 1


def run_two_processes(url: str) -> None:
    name = f"array-{uuid.uuid4().hex[:8]}"
    optuna.create_study(study_name=name, storage=storage_of(url), direction="minimize",
                        sampler=optuna.samplers.RandomSampler(seed=0),
                        pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(WORKER), url, name, str(N_TRIALS), str(ARRAY_SIZE)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    ran = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
        ran.append(json.loads(out.strip().splitlines()[-1]))
    trials = optuna.load_study(study_name=name, storage=storage_of(url)).get_trials()
    numbers = sorted(t.number for t in trials)
    assert numbers == list(range(2 * N_TRIALS))  # n_trials each, none lost
    assert [len(r) for r in ran] == [N_TRIALS, N_TRIALS]
    assert sorted(ran[0] + ran[1]) == numbers  # each trial run by one process, once
    states = {t.number: t.state.name for t in trials}
    assert set(states.values()) <= {"COMPLETE", "PRUNED"}, states  # every one told
    for t in trials:
        history = alone(t.number, t.params["lr"], STEPS)
        steps = sorted(t.intermediate_values)
        assert steps == list(range(len(steps))) and steps, t.number
        for step in steps:
            assert t.intermediate_values[step] == pytest.approx(history[step], rel=1e-9), \
                (t.number, step)
        if t.state.name == "COMPLETE":
            assert len(steps) == STEPS
            assert t.value == pytest.approx(history[-1], rel=1e-9)


def test_two_processes_on_one_sqlite_file(tmp_path):
    run_two_processes(f"sqlite:///{tmp_path / 'study.db'}")


def test_two_processes_on_one_postgresql_database():
    url = os.environ.get("HFTC_TEST_POSTGRES_URL")
    problem = "HFTC_TEST_POSTGRES_URL is not set" if not url else _reachable(url)
    if problem:
        message = (f"{problem}. Set HFTC_TEST_POSTGRES_URL=postgresql://user:pass@host/db "
                   f"(.ci/run starts a server and sets it).")
        if os.environ.get("CI"):
            pytest.fail(message)  # CI starts PostgreSQL: not reaching it is a failure there
        pytest.skip(message)
    run_two_processes(url)


def _reachable(url: str) -> str | None:
    import sqlalchemy

    try:
        sqlalchemy.create_engine(url, connect_args={"connect_timeout": 3}).connect().close()
    except Exception as exc:
        return f"no PostgreSQL at {url.split('@')[-1]}: {str(exc).strip().splitlines()[0]}"
    return None
