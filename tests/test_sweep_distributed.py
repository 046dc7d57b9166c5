"""Two sweep workers on one PostgreSQL study: every trial runs once, a killed worker loses nothing.

Needs a PostgreSQL server: ``HFTC_TEST_POSTGRES_URL`` (``.ci/run`` starts one on
127.0.0.1 and exports it). Elsewhere the test is skipped, saying how to run it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from test_sweep import ROOT, _env, _sweep_cmd, _wait_for, spec_file  # noqa: F401  (a fixture)

URL = os.environ.get("HFTC_TEST_POSTGRES_URL", "postgresql://hftc:hftc@127.0.0.1/hftc_test")


def _reachable(url: str) -> str | None:
    import sqlalchemy

    try:
        sqlalchemy.create_engine(url, connect_args={"connect_timeout": 3}).connect().close()
    except ImportError as exc:
        return f"no PostgreSQL driver ({exc}); pip install 'hftc[sweep]'"
    except Exception as exc:
        return f"no PostgreSQL at {url.split('@')[-1]}: {str(exc).strip().splitlines()[0]}"
    return None


@pytest.fixture(scope="module")
def postgres_url() -> str:
    problem = _reachable(URL)
    if problem:
        message = (f"{problem}. Set HFTC_TEST_POSTGRES_URL=postgresql://user:pass@host/db "
                   f"(.ci/run starts a server and sets it).")
        if os.environ.get("CI"):
            pytest.fail(message)  # CI starts PostgreSQL: not reaching it is a failure there
        pytest.skip(message)
    return URL


def _trials(url: str, study: str):
    try:
        return optuna.load_study(study_name=study, storage=url).trials
    except KeyError:  # not created yet
        return []


def test_two_workers_one_killed_nothing_lost_nothing_twice(spec_file: Path,  # noqa: F811
                                                           tmp_path: Path, postgres_url: str):
    study = f"tiny-{uuid.uuid4().hex[:8]}"
    n_trials = 8
    args = ("--storage", postgres_url, "--study", study, "--trials", str(n_trials),
            "--grace-period", "3", "--pruner", "none", "--epochs", "3")
    slow = _env(HFTC_TEST_SLOW="0.5")
    # Both start together (under load, a worker that starts late may find no work left).
    a, b = (subprocess.Popen(_sweep_cmd(spec_file, tmp_path / name, *args), cwd=ROOT, env=slow,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name in ("a", "b"))
    try:
        # Each holds at most 3 trials: 5 running means both hold some.
        _wait_for(lambda: sum(t.state == TrialState.RUNNING
                              for t in _trials(postgres_url, study)) >= 5, 180, a)
        assert b.poll() is None
        a.send_signal(signal.SIGKILL)  # A dies with its trials RUNNING
        a.wait()
        killed = {t.number for t in _trials(postgres_url, study) if t.state == TrialState.RUNNING}
        out, _ = b.communicate(timeout=240)
        assert b.returncode == 0, out
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    trials = _trials(postgres_url, study)
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len(finished) == n_trials, [(t.number, t.state.name) for t in trials]
    assert failed, "killing worker A failed none of its trials"
    # Each of A's lost trials failed once (heartbeat) and was retried once, to the end,
    # with its parameters (those it had: A may die while one is being sampled) and seed.
    retries = {t.system_attrs.get("failed_trial"): t for t in finished
               if "failed_trial" in t.system_attrs}
    for t in failed:
        assert t.number in retries, f"trial {t.number} failed and was never retried"
        retry = retries[t.number]
        assert {k: retry.params[k] for k in t.params} == t.params
        if "hftc_seed" in t.user_attrs:
            assert retry.user_attrs["hftc_seed"] == t.user_attrs["hftc_seed"]
    assert {t.number for t in failed} <= killed
    # Nothing ran twice: every finished trial has its own parameters.
    assert len({tuple(sorted(t.params.items())) for t in finished}) == n_trials
