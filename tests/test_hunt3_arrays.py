"""hftc.sweep.optimize / TrialArray beside stock Optuna (study.optimize, several
processes calling optuna.load_study(...).optimize on one storage): what a user's own
script sees of the study (its trial count, its log, its trials) is a stock study's."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from optuna.study import MaxTrialsCallback  # noqa: E402
from optuna.trial import TrialState  # noqa: E402
from torch import nn  # noqa: E402

import hftc  # noqa: E402
import hftc.sweep  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
X = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(8, 3)
Y = X.sum(1, keepdim=True).sin()
STEPS = 3


def make_model(number: int) -> nn.Module:
    torch.manual_seed(number)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def objective_alone(trial):
    """The stock objective(trial): one model, stock SGD, report and prune each step."""
    lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
    model = make_model(trial.number)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(X), Y).backward()
        opt.step()
        with torch.no_grad():
            value = F.mse_loss(model(X), Y).item()
        trial.report(value, step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return value


def objective_array(array):
    """The same objective, N trials fused."""
    lrs = [t.suggest_float("lr", 1e-3, 1.0, log=True) for t in array.trials]
    fused = array.fuse([make_model(t.number) for t in array.trials])
    opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.5)
    per_model_mse = hftc.per_model(F.mse_loss)
    for step in range(STEPS):
        opt.zero_grad()
        per_model_mse(fused(X), Y).sum().backward()
        opt.step()
        with torch.no_grad():
            array.report(per_model_mse(fused(X), Y), step)
    with torch.no_grad():
        return per_model_mse(fused(X), Y)


def quiet_study(**kwargs):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), **kwargs)


# ------------------------------------------------------------ MaxTrialsCallback


@pytest.mark.parametrize("states", [None, (TrialState.COMPLETE,)])
def test_max_trials_callback_stops_the_study_at_its_count_as_study_optimize(states):
    counts = {}
    for kind in ("stock", "hftc"):
        study = quiet_study(pruner=optuna.pruners.NopPruner())
        limit = MaxTrialsCallback(6, states=states)
        if kind == "stock":
            study.optimize(objective_alone, n_trials=20, callbacks=[limit])
        else:
            hftc.sweep.optimize(study, objective_array, n_trials=20, array_size=4,
                                callbacks=[limit])
        counts[kind] = len(study.trials)
    assert counts["hftc"] == counts["stock"] == 6


def test_max_trials_callback_counts_refilled_places_too():
    study = quiet_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1,
                                                           n_warmup_steps=0))

    def objective(array):
        per_model_mse = hftc.per_model(F.mse_loss)

        def build(trial):
            return make_model(trial.number), {"lr": trial.suggest_float("lr", 1e-3, 1.0,
                                                                          log=True)}

        lrs = [t.suggest_float("lr", 1e-3, 1.0, log=True) for t in array.trials]
        fused = array.fuse([make_model(t.number) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs)
        array.refill_with(build)
        for _ in array.epochs(STEPS):
            opt.zero_grad()
            per_model_mse(fused(X), Y).sum().backward()
            opt.step()
            with torch.no_grad():
                array.report(per_model_mse(fused(X), Y))

    limit = MaxTrialsCallback(7, states=None)
    hftc.sweep.optimize(study, objective, n_trials=40, array_size=4, callbacks=[limit])
    assert len(study.trials) == 7
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)


# ------------------------------------------------------------ the log


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Trial "):  # without the parameters and values
            self.lines.append(message.split(" and parameters")[0].split(" with ")[0])


def _optuna_log(run) -> list[str]:
    """The "Trial ..." lines Optuna's loggers write while ``run()`` runs."""
    lines = _Lines()
    root = logging.getLogger("optuna")
    optuna.logging.set_verbosity(optuna.logging.INFO)
    root.addHandler(lines)
    try:
        run()
    finally:
        root.removeHandler(lines)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    return lines.lines


def test_optimize_logs_each_finished_trial_as_study_optimize():
    logs = {}
    for kind in ("stock", "hftc"):
        study = quiet_study(pruner=optuna.pruners.NopPruner())
        for lr in (0.01, 0.5, 0.02):
            study.enqueue_trial({"lr": lr})
        if kind == "stock":
            logs[kind] = _optuna_log(lambda s=study: s.optimize(objective_alone, 3))
        else:
            logs[kind] = _optuna_log(lambda s=study: hftc.sweep.optimize(
                s, objective_array, n_trials=3, array_size=3))
    assert logs["hftc"] == logs["stock"]
    assert logs["stock"] == ["Trial 0 finished", "Trial 1 finished", "Trial 2 finished"]


def test_a_caught_error_is_logged_as_study_optimize_logs_it():
    def boom_alone(trial):
        raise ValueError("boom")

    def boom_array(array):
        raise ValueError("boom")

    study = quiet_study()
    stock = _optuna_log(lambda: study.optimize(boom_alone, 1, catch=(ValueError,)))
    study = quiet_study()
    ours = _optuna_log(lambda s=study: hftc.sweep.optimize(
        study, boom_array, n_trials=2, array_size=2, catch=(ValueError,)))
    assert any("failed" in line for line in stock)
    assert [line for line in ours if "failed" in line] == [
        "Trial 0 failed", "Trial 1 failed"]


# ------------------------------------------------------------ several processes

WORKER = textwrap.dedent('''
    import os, sys, warnings
    sys.path.insert(0, sys.argv[1])
    import optuna, torch
    import torch.nn.functional as F
    import hftc, hftc.sweep
    from test_hunt3_arrays import X, Y, make_model
    from optuna.study import MaxTrialsCallback

    url, name, mode, n_trials, array_size, limit = sys.argv[2:8]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore")
    beat = {"heartbeat_interval": 1, "grace_period": 2,
            "failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)}
    lock = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    storage = optuna.storages.RDBStorage(url, engine_kwargs=lock,
                                         **(beat if mode != "plain" else {}))
    study = optuna.load_study(study_name=name, storage=storage)
    per_model_mse = hftc.per_model(F.mse_loss)

    def build(trial):
        if mode == "die-in-build":
            os._exit(3)   # killed while a refill builds its new trial
        return make_model(trial.number), {"lr": trial.suggest_float("lr", 1e-3, 1.0, log=True)}

    def objective(array):
        lrs = [t.suggest_float("lr", 1e-3, 1.0, log=True) for t in array.trials]
        fused = array.fuse([make_model(t.number) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs)
        array.refill_with(build)
        for _ in array.epochs(2):
            opt.zero_grad()
            per_model_mse(fused(X), Y).sum().backward()
            opt.step()
            with torch.no_grad():
                array.report(per_model_mse(fused(X), Y))

    callbacks = [MaxTrialsCallback(int(limit), states=None)] if int(limit) else None
    hftc.sweep.optimize(study, objective, n_trials=int(n_trials) or None,
                        array_size=int(array_size), callbacks=callbacks)
''')


def _start_workers(tmp_path, url, name, mode, n_trials, array_size, limit=0, count=1):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(script), str(Path(__file__).parent), url, name, mode,
           str(n_trials), str(array_size), str(limit)]
    return [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(count)]


def _wait(procs) -> list[int]:
    codes = []
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        codes.append(proc.returncode)
        assert proc.returncode in (0, 3), out
    return codes


def _new_study(url: str) -> str:
    name = f"hunt3-{uuid.uuid4().hex[:8]}"
    optuna.create_study(study_name=name, storage=url,
                        sampler=optuna.samplers.RandomSampler(seed=0))
    return name


def test_a_worker_killed_while_a_refill_builds_leaves_no_trial_running(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    name = _new_study(url)
    assert _wait(_start_workers(tmp_path, url, name, "die-in-build", 4, 2)) == [3]
    study = optuna.load_study(study_name=name, storage=url)
    asked = [t for t in study.trials if t.state == TrialState.RUNNING]
    assert [t.number for t in asked] == [2]  # the newcomer the dead worker was building

    time.sleep(3)  # its grace period (2 s) over: the next worker fails it and retries it
    assert _wait(_start_workers(tmp_path, url, name, "beat", 1, 1)) == [0]
    states = {t.number: t.state for t in optuna.load_study(study_name=name,
                                                           storage=url).trials}
    assert TrialState.RUNNING not in states.values(), states
    assert states[2] == TrialState.FAIL and states[3] == TrialState.COMPLETE


def _storage_url(kind: str, tmp_path: Path) -> str:
    """A SQLite file, or the PostgreSQL database of HFTC_TEST_POSTGRES_URL (skipped
    without it)."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    url = os.environ.get("HFTC_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("HFTC_TEST_POSTGRES_URL is not set")
    return url


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_max_trials_callback_across_two_workers_started_at_once(tmp_path, kind):
    url = _storage_url(kind, tmp_path)
    name = _new_study(url)
    assert _wait(_start_workers(tmp_path, url, name, "plain", 0, 4, limit=10,
                                count=2)) == [0, 0]
    trials = optuna.load_study(study_name=name, storage=url).trials
    # study.optimize in two processes: 10, or 11 where both asked at once (was 16)
    assert len(trials) in (10, 11)
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}


def test_a_refilled_array_fails_and_retries_a_dead_workers_trials_as_it_goes(tmp_path):
    # study.optimize fails the stale trials before each trial; one refilled array may run
    # the whole budget, and the dead worker's trial was left RUNNING for ever
    with pytest.warns(Warning):
        storage = optuna.storages.RDBStorage(
            f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1, grace_period=2,
            failed_trial_callback=optuna.storages.RetryFailedTrialCallback(max_retry=1))
    # (no pruning: whether the median pruner stops the retry depends on which trials
    # finished first, which is not what is tested)
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=0),
                                pruner=optuna.pruners.NopPruner())
    with pytest.warns(UserWarning, match="Heartbeat"):  # Optuna's: "for study.optimize"
        dead = study.ask({"lr": optuna.distributions.FloatDistribution(1e-3, 1.0, log=True)})
    storage.record_heartbeat(dead._trial_id)  # its worker beat once, then died

    def objective(array):
        lrs = [t.suggest_float("lr", 1e-3, 1.0, log=True) for t in array.trials]
        fused = array.fuse([make_model(t.number) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs)
        array.refill_with(lambda t: (make_model(t.number),
                                     {"lr": t.suggest_float("lr", 1e-3, 1.0, log=True)}))
        for _ in array.epochs(2):
            opt.zero_grad()
            hftc.per_model(F.mse_loss)(fused(X), Y).sum().backward()
            opt.step()
            time.sleep(0.5)
            with torch.no_grad():
                array.report(hftc.per_model(F.mse_loss)(fused(X), Y))

    hftc.sweep.optimize(study, objective, n_trials=8, array_size=2)
    trials = study.trials
    assert trials[0].state == TrialState.FAIL  # stale: failed, then retried
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert retries[0].params == trials[0].params
    assert TrialState.RUNNING not in {t.state for t in trials}


# ------------------------------------------------------------ multi-objective


@pytest.mark.parametrize("array_size", [2, 3])
def test_a_multi_objective_return_of_one_tensor_per_direction_is_each_trials_values(
        array_size):
    # objective(trial)'s `return loss, accuracy`, fused: K per-model [N] tensors; with
    # N == K they were read as rows (trial 0 got both models' losses), else refused
    xs = [0.1, 0.7, 0.4]

    def alone(trial):
        x = torch.tensor(trial.suggest_float("x", 0, 1), dtype=torch.float64)
        return (x * 10).item(), (x + 100).item()

    def fused(array):
        x = torch.tensor(array.suggest_float("x", 0, 1), dtype=torch.float64)
        return x * 10, x + 100

    values = {}
    for kind in ("stock", "hftc"):
        study = quiet_study(directions=["minimize", "maximize"])
        for x in xs[:array_size]:
            study.enqueue_trial({"x": x})
        if kind == "stock":
            study.optimize(alone, n_trials=array_size)
        else:
            hftc.sweep.optimize(study, fused, n_trials=array_size, array_size=array_size)
        values[kind] = [t.values for t in study.trials]
        assert [t.number for t in study.best_trials] == list(range(array_size))
    assert values["hftc"] == values["stock"]


# ------------------------------------------------------------ refills


def test_refill_in_a_range_loop_is_refused_not_a_newcomer_completed_after_fewer_steps():
    # in range(E) a refilled trial reported at the array's steps ({1: ..., 2: ...}) and
    # completed after E - 1 steps of training with that value
    study = quiet_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=0,
                                                           n_warmup_steps=0))
    per_model_mse = hftc.per_model(F.mse_loss)

    def objective(array):
        lrs = array.suggest_float("lr", 1e-3, 1.0, log=True)
        fused = array.fuse([make_model(t.number) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs)
        array.refill_with(lambda t: (make_model(t.number),
                                     {"lr": t.suggest_float("lr", 1e-3, 1.0, log=True)}))
        for step in range(STEPS):
            opt.zero_grad()
            per_model_mse(fused(X), Y).sum().backward()
            opt.step()
            with torch.no_grad():
                values = per_model_mse(fused(X), Y)
            array.report(values, step)
        return values

    with pytest.raises(hftc.errors.SweepError, match=r"array\.epochs\(E\)"):
        hftc.sweep.optimize(study, objective, n_trials=8, array_size=3)
    for trial in study.trials:  # none completed with the value of fewer steps
        assert trial.state == TrialState.FAIL


def test_ctrl_c_while_an_array_is_asked_leaves_no_trial_running():
    class InterruptedSampler(optuna.samplers.RandomSampler):
        def before_trial(self, study, trial):
            if trial.number == 2:
                raise KeyboardInterrupt  # Ctrl-C while the array's third trial is asked

    study = optuna.create_study(sampler=InterruptedSampler(seed=0))
    with pytest.raises(KeyboardInterrupt):
        hftc.sweep.optimize(study, objective_array, n_trials=4, array_size=4)
    states = [t.state for t in study.trials[:2]]
    assert states == [TrialState.FAIL, TrialState.FAIL]  # not RUNNING for ever
    assert "KeyboardInterrupt" in study.trials[0].user_attrs["hftc_fail_reason"]


def test_ctrl_c_in_a_refills_build_fails_the_new_trial_too():
    study = quiet_study()

    def build(trial):
        trial.suggest_float("lr", 1e-3, 1.0, log=True)
        raise KeyboardInterrupt

    def objective(array):
        lrs = array.suggest_float("lr", 1e-3, 1.0, log=True)
        fused = array.fuse([make_model(t.number) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs)
        array.refill_with(build)
        for _ in array.epochs(1):
            opt.zero_grad()
            hftc.per_model(F.mse_loss)(fused(X), Y).sum().backward()
            opt.step()
            with torch.no_grad():
                array.report(hftc.per_model(F.mse_loss)(fused(X), Y))

    with pytest.raises(KeyboardInterrupt):
        hftc.sweep.optimize(study, objective, n_trials=4, array_size=2)
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL], states


def test_a_multi_objective_numpy_array_of_each_trials_values_is_taken_as_a_tensor():
    import numpy as np

    def fused(array):
        x = np.array(array.suggest_float("x", 0, 1))
        return np.stack([x * 10, x + 100], 1)  # [N, K], as torch.stack(..., 1) is taken

    study = quiet_study(directions=["minimize", "maximize"])
    hftc.sweep.optimize(study, fused, n_trials=3, array_size=3)
    for trial in study.trials:
        x = trial.params["x"]
        assert trial.values == [x * 10, x + 100]


def test_n_trials_zero_and_numpy_ints_are_taken_as_study_optimize_takes_them():
    import numpy as np

    study = quiet_study()
    study.optimize(objective_alone, n_trials=0)  # stock: no trial (a resumed script's
    hftc.sweep.optimize(study, objective_array, n_trials=0, array_size=2)  # `total - done`)
    assert len(study.trials) == 0
    hftc.sweep.optimize(study, objective_array, n_trials=np.int64(3), array_size=np.int64(2),
                        timeout=np.float32(600))
    study.optimize(objective_alone, n_trials=np.int64(1))
    assert len(study.trials) == 4


def test_a_call_ported_from_study_optimize_with_a_positional_timeout_is_refused():
    """``study.optimize(objective, 20, 600)`` is 20 trials in 600 s; hftc.sweep.optimize's
    third positional argument after the objective is n_trials too, and nothing after it
    is positional: the 600 is refused, not taken for an array of 600 trials."""
    import optuna

    study = optuna.create_study()
    with pytest.raises(TypeError, match="positional"):
        hftc.sweep.optimize(study, lambda array: [0.0] * len(array.trials), 20, 600)
    assert study.trials == []
