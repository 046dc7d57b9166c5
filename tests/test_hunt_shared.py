"""Hunt: sweeps whose study is shared by several workers, killed and resumed, and their
storage's failures (SQLite here; PostgreSQL where ``HFTC_TEST_POSTGRES_URL`` reaches one)."""

from __future__ import annotations

import os
import uuid

import optuna
import pytest
from optuna.trial import TrialState
from test_sweep import SPEC_SOURCE, retrain_alone

import hftc.sweep as hs
import hftc.sweep.engine as engine
import hftc.sweep.storage as storage_module
from hftc.__main__ import main


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "tiny_spec.py"  # test_sweep's tiny CNN, float64
    path.write_text(SPEC_SOURCE)
    return path


def _flaky_storage(monkeypatch, fail_at: int) -> dict:
    """make_storage whose storages raise a database error (a server restart) on the
    ``fail_at``-th intermediate value written, once: one report at a time or in a
    round's one transaction (OwnTrialsCache.set_trial_intermediate_values), which then
    writes none of its values, as a failed commit."""
    real_make = engine.make_storage
    calls = {"n": 0}
    real_batch = storage_module._write_intermediate_values

    def flaky_batch(backend, session, writes):
        before = calls["n"]
        calls["n"] += len(writes)
        if before < fail_at <= calls["n"]:
            raise optuna.exceptions.StorageInternalError(
                "An exception is raised during the commit. (server closed the "
                "connection unexpectedly)")
        return real_batch(backend, session, writes)

    monkeypatch.setattr(storage_module, "_write_intermediate_values", flaky_batch)

    def make(*args, **kwargs):
        storage = real_make(*args, **kwargs)
        real = storage.set_trial_intermediate_value

        def flaky(*a, **k):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise optuna.exceptions.StorageInternalError(
                    "An exception is raised during the commit. (server closed the "
                    "connection unexpectedly)")
            return real(*a, **k)

        storage.set_trial_intermediate_value = flaky
        return storage

    monkeypatch.setattr(engine, "make_storage", make)
    return calls


def test_a_storage_error_mid_sweep_fails_no_trial_and_resume_finishes_them(
        spec_file, tmp_path, monkeypatch, capsys):
    """A database that fails a write mid-round (PostgreSQL restarted, a network blip) is
    the storage's failure, not the trials': they stay RUNNING, their epoch checkpointed,
    the command says so naming the storage (no traceback), and --resume finishes them
    equal to each trained alone. (They were failed for good, and lost.)"""
    out = tmp_path / "out"
    args = ["sweep", str(spec_file), "--out", str(out), "--trials", "4", "--epochs", "2",
            "--pruner", "none", "--no-progress", "--no-estimate", "--per-array", "3"]
    _flaky_storage(monkeypatch, fail_at=4)  # round 2's first report
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "storage" in err and "--resume" in err and str(out / "study.db") in err, err
    storage = f"sqlite:///{out / 'study.db'}"
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    assert [t.state for t in trials] == [TrialState.RUNNING] * 3, [
        (t.number, t.state.name, t.user_attrs.get("hftc_fail_reason")) for t in trials]
    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    spec = hs.load_spec(spec_file).replace(epochs=2)
    for t in trials:
        fused = [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
        assert max(abs(a - b) for a, b in zip(retrain_alone(spec, t), fused)) <= 1e-9


@pytest.mark.parametrize("url, said", [
    ("postgresql://hftc:s3cr@t!@127.0.0.1/hftc_test", "%40"),  # an unencoded '@'
    ("postgresql://hftc:s3cr/t!@127.0.0.1:1/hftc_test", "127.0.0.1:1"),  # nothing listens
])
def test_a_bad_or_down_storage_url_is_named_with_its_password_masked(url, said):
    """The error names the URL with the password masked, all of it: one holding an '@'
    or a '/' was masked only up to it (and SQLAlchemy took its rest for the host)."""
    with pytest.raises(hs.SweepError) as info:
        hs.make_storage(url)
    message = str(info.value)
    assert said in message and "hftc:***@127.0.0.1" in message, message
    assert "s3cr" not in message and "t!" not in message, message


@pytest.mark.parametrize("interval, grace", [(5, 2), (3, 3), (1, 0), (1, -4)])
def test_a_grace_period_a_heartbeat_cannot_keep_is_refused(
        spec_file, tmp_path, capsys, interval, grace):
    """A grace period no longer than the heartbeat interval has every other worker fail a
    live worker's trials between two of its heartbeats, and train them again (0 was taken
    for the default, a negative one said as a storage that cannot be opened): refused,
    naming both options, before anything is written."""
    out = tmp_path / "out"
    code = main(["sweep", str(spec_file), "--out", str(out), "--no-progress",
                 "--heartbeat-interval", str(interval), "--grace-period", str(grace)])
    err = capsys.readouterr().err
    assert code == 2 and "--grace-period" in err and "--heartbeat-interval" in err, err
    assert not (out / "study.db").exists()


def _postgres_or_skip() -> str:
    """A fresh study's URL on the PostgreSQL of HFTC_TEST_POSTGRES_URL (skipped without)."""
    from test_sweep_distributed import _reachable

    url = os.environ.get("HFTC_TEST_POSTGRES_URL")
    problem = _reachable(url) if url else "HFTC_TEST_POSTGRES_URL is not set"
    if problem:
        pytest.skip(problem)
    return url


@pytest.mark.parametrize("where", ["sqlite", "postgresql"])
def test_workers_asking_at_once_never_run_more_than_n_trials(
        spec_file, tmp_path, monkeypatch, where):
    """Two workers on one study both count one trial of budget left and both ask: the one
    whose trial comes second gives it back, unrun. (Three workers on PostgreSQL with
    --trials 4 ended with 5 complete trials.)"""
    spec = hs.load_spec(spec_file).replace(n_trials=3, epochs=1, pruner="none", per_array=3)
    url = (f"sqlite:///{tmp_path / 'shared.db'}" if where == "sqlite"
           else _postgres_or_skip())
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    real_ask = optuna.Study.ask
    asks = {"n": 0}

    def ask(study, *args, **kwargs):
        asks["n"] += 1
        if asks["n"] == 3:  # the other worker asks and finishes one, after our count
            other = optuna.load_study(study_name=name, storage=url)
            t = real_ask(other)
            spec.space(t)
            t.set_user_attr("hftc_seed", spec.seed + t.number)
            other.tell(t, 1.0)
        return real_ask(study, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "ask", ask)
    result = hs.run(spec, out=tmp_path / "out", storage=url, study_name=name,
                    progress=False, estimate=False)
    trials = result.study.trials
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) == 3, [(t.number, t.state.name) for t in trials]
    assert [t.state for t in trials if t.state != TrialState.COMPLETE] == [TrialState.FAIL]
    assert [t.params for t in trials if t.state == TrialState.FAIL] == [{}]  # never ran


def test_best_pt_is_never_another_trials_weights(spec_file, tmp_path):
    """A worker whose study's best trial was trained by another worker (its weights in
    that worker's folder) left its own earlier best.pt in place, beside a best.json naming
    the other trial: best.pt then held another model's weights. It goes."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    spec = hs.load_spec(spec_file).replace(n_trials=2, epochs=1, pruner="none")
    out = tmp_path / "a"
    first = hs.run(spec, out=out, storage=url, study_name="tiny", progress=False,
                   estimate=False)
    assert (out / "best.pt").exists()
    study = first.study
    done = study.best_trial
    # Another worker (its folder elsewhere) finished a better trial since.
    study.add_trial(optuna.trial.create_trial(
        params=done.params, distributions=done.distributions, value=done.value - 1.0,
        intermediate_values={1: done.value - 1.0},
        user_attrs={"hftc_worker": "elsewhere-1", "hftc_seed": 99, "hftc_orders": [0]}))
    hs.run(spec.replace(n_trials=3), out=out, storage=url, study_name="tiny", progress=False,
           estimate=False)
    import json

    best = json.loads((out / "best.json").read_text())
    assert best["number"] == 2
    assert not (out / "best.pt").exists()


def test_a_database_that_never_answers_is_an_error_not_a_hang(monkeypatch):
    """A PostgreSQL host that takes the connection and never answers (a hung server, a
    firewall) had the sweep wait forever: the connection has a timeout, and the error
    names the URL, password masked."""
    import socket

    import hftc.sweep.storage as storage

    pytest.importorskip("psycopg")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nobody answers
    port = silent.getsockname()[1]
    monkeypatch.setattr(storage, "CONNECT_TIMEOUT_S", 1)
    try:
        with pytest.raises(hs.SweepError) as info:
            hs.make_storage(f"postgresql://hftc:s3cret@127.0.0.1:{port}/hftc_test")
    finally:
        silent.close()
    message = str(info.value)
    assert f"hftc:***@127.0.0.1:{port}" in message and "s3cret" not in message, message
    assert "timeout" in message.lower(), message


_NETLIB = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(36, 3)

    def forward(self, x):
        return self.fc(torch.flatten(x, 1))
'''

_IMPORTING_SPEC = '''
import torch
from {lib} import Net

name = "imports"
epochs = 1
n_trials = 2
per_array = 2
pruner = "none"
dtype = torch.float64


def space(trial):
    return {{"lr": trial.suggest_float("lr", 0.01, 0.1)}}


def model(params):
    return Net()


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 6, 6, generator=g)
    y = (x.flatten(1) @ torch.randn(36, 3, generator=g)).argmax(1)
    return (x[:48], y[:48]), (x[48:], y[48:])
'''


def test_an_edited_model_class_imported_by_the_spec_is_refused_on_resume(tmp_path):
    """The spec's model() builds a class of the user's own module beside it (``from
    models import Net``, as most projects keep it): an edit of that class is another
    spec, refused when the study is continued, as an edit in the spec file is. (It was
    digested by its name only: the study mixed two architectures.)"""
    import sys

    lib = f"netlib_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{lib}.py").write_text(_NETLIB)
    spec_path = tmp_path / "importing_spec.py"
    spec_path.write_text(_IMPORTING_SPEC.format(lib=lib))
    out = tmp_path / "out"
    hs.run(hs.load_spec(spec_path), out=out, progress=False, estimate=False)
    (tmp_path / f"{lib}.py").write_text(_NETLIB.replace(
        "nn.Linear(36, 3)", "nn.Sequential(nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 3))"))
    del sys.modules[lib]  # (as a new process imports it)
    with pytest.raises(hs.SweepError, match="model"):
        hs.run(hs.load_spec(spec_path), n_trials=4, out=out, progress=False, estimate=False)
    del sys.modules[lib]
    (tmp_path / f"{lib}.py").write_text(_NETLIB + "\n# a comment changes nothing\n")
    hs.run(hs.load_spec(spec_path), n_trials=3, out=out, progress=False, estimate=False)


@pytest.mark.parametrize("url, said", [
    ("study.db", "sqlite:///study.db"),  # a path given for a URL
    ("sqlite:///no/such/folder/study.db", "no/such/folder does not exist"),
])
def test_a_storage_url_typo_says_what_to_write(url, said):
    with pytest.raises(hs.SweepError, match=said):
        hs.make_storage(url)


def test_two_workers_recording_their_spec_at_once_are_compared(spec_file, tmp_path,
                                                              monkeypatch):
    """Two workers start a new study at the same moment, one with an edited spec: both
    read no record, both write theirs, and the second write fails on the unique key (a
    bare storage error), or wins. Read back, the record is compared: the other spec is
    refused, not mixed in."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    spec = hs.load_spec(spec_file).replace(n_trials=2, epochs=1, pruner="none")
    real = optuna.Study.set_user_attr

    def at_once(study, key, value):
        if key == "hftc_spec":  # the other worker's record, with its epochs, came first
            real(study, key, {**value, "epochs": "7"})
            raise optuna.exceptions.StorageInternalError("(IntegrityError) UNIQUE constraint")
        return real(study, key, value)

    monkeypatch.setattr(optuna.Study, "set_user_attr", at_once)
    with pytest.raises(hs.SweepError, match="started with another spec: epochs was 7"):
        hs.run(spec, out=tmp_path / "out", storage=url, study_name="tiny", progress=False,
               estimate=False)


@pytest.mark.parametrize("interval", ["0", "-5"])
def test_a_heartbeat_interval_under_a_second_is_refused(spec_file, tmp_path, capsys,
                                                        interval):
    """A --heartbeat-interval of 0 or below was taken as 1 s without a word: refused,
    naming the option and what it takes, before anything is written."""
    out = tmp_path / "out"
    code = main(["sweep", str(spec_file), "--out", str(out), "--no-progress",
                 "--heartbeat-interval", interval])
    err = capsys.readouterr().err
    assert code == 2 and f"--heartbeat-interval (heartbeat_interval) {interval} s" in err, err
    assert "at least 1" in err
    assert not (out / "study.db").exists()
