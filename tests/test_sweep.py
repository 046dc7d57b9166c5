"""hftc.sweep end to end: a fused Optuna sweep on SQLite, its files, its numbers, resume.

The spec is a tiny CNN on synthetic data in float64, so a fused trial and the same
trial trained alone with stock torch agree to 1e-9, epoch by epoch.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
import torch.nn.functional as F
from optuna.trial import TrialState

import hftc.sweep as hs
from hftc.__main__ import main
from hftc.sweep.training import SweepData, batches, epoch_order

ROOT = Path(__file__).resolve().parents[1]

SPEC_SOURCE = '''
"""A tiny sweep for the tests: a CNN on 6x6 synthetic images, float64."""
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

name = "tiny"
metric = "loss"
epochs = 4
batch_size = 32
n_trials = 6
per_array = 3
dtype = torch.float64
pruner = "sha"
SLOW = float(os.environ.get("HFTC_TEST_SLOW", "0"))  # seconds per model and epoch


class Tiny(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(self.drop(torch.flatten(F.relu(self.conv(x)), 1)))


def space(trial):
    return {
        "lr": trial.suggest_float("lr", 0.01, 0.5, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.9),
        "weight_decay": trial.suggest_float("weight_decay", 1e-5, 1e-2, log=True),
    }


def model(params):
    return Tiny(params.get("dropout", 0.0))


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(240, 1, 6, 6, generator=g)
    y = (x.flatten(1) @ torch.randn(36, 3, generator=g)).argmax(1)
    return (x[:160], y[:160]), (x[160:], y[160:])


def loss(output, target):
    if SLOW:
        time.sleep(SLOW / 5)  # per batch: 5 batches an epoch
    return F.cross_entropy(output, target)
'''


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_spec.py"
    path.write_text(SPEC_SOURCE)
    return path


def retrain_alone(spec, trial) -> list[float]:
    """The trial trained alone: stock model, stock torch.optim.SGD, its seed and data order."""
    params = dict(trial.params)
    data = SweepData.from_spec(spec)
    torch.manual_seed(trial.user_attrs["hftc_seed"])
    model = spec.model(params).to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params["momentum"],
                          weight_decay=params["weight_decay"])
    history = []
    for key in trial.user_attrs["hftc_orders"]:
        model.train()
        for idx in batches(epoch_order(key, data.n_train), spec.batch_size):
            opt.zero_grad()
            F.cross_entropy(model(data.x_train[0][idx]), data.y_train[idx]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            history.append(F.cross_entropy(model(data.x_val[0]), data.y_val).item())
    return history


def test_sweep_end_to_end_files_and_best(spec_file: Path, tmp_path: Path):
    base = hs.load_spec(spec_file)

    def space(trial):  # with dropout: models differ in Dropout.p, one fused group all the same
        return {**base.space(trial), "dropout": trial.suggest_float("dropout", 0.0, 0.3)}

    spec = base.replace(space=space, metric="accuracy", epochs=3)
    out = tmp_path / "out"
    result = hs.run(spec, out=out, progress=False)
    trials = result.study.trials
    assert len(trials) == 6
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    assert any(t.state == TrialState.COMPLETE for t in trials)

    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [int(r["number"]) for r in rows] == list(range(6))
    for r, t in zip(rows, trials):
        assert r["state"] == t.state.name
        assert int(r["epochs"]) == len(t.intermediate_values) >= 1
        assert float(r["accuracy"]) == t.value
        for k in ("lr", "momentum", "weight_decay", "dropout"):
            assert float(r[k]) == t.params[k]
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "rank" in result.leaderboard and "trials:" in result.leaderboard

    best = result.study.best_trial
    info = json.loads((out / "best.json").read_text())
    assert info["number"] == best.number and info["value"] == best.value
    fresh = spec.model(best.params).to(torch.float64)
    fresh.load_state_dict(torch.load(out / "best.pt", weights_only=True))
    fresh.eval()
    data = SweepData.from_spec(spec)
    with torch.no_grad():
        acc = (fresh(data.x_val[0]).argmax(-1) == data.y_val).double().mean().item()
    assert acc == best.value
    assert not list((out / "workers").iterdir())  # a finished worker leaves no folder


def test_fused_trials_match_stock_training_alone(spec_file: Path, tmp_path: Path):
    """Every trial of a sweep with pruning and re-formed arrays reports, epoch by epoch,
    what stock torch reports for it trained alone (float64, dropout off)."""
    spec = hs.load_spec(spec_file).replace(n_trials=7)
    result = hs.run(spec, out=tmp_path / "out", progress=False)
    trials = result.study.trials
    states = [t.state for t in trials]
    assert states.count(TrialState.PRUNED) >= 1, states  # arrays shrank and took newcomers
    assert set(states) <= {TrialState.COMPLETE, TrialState.PRUNED}
    for t in trials:
        fused = [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
        alone = retrain_alone(spec, t)
        assert len(alone) == len(fused)
        for a, b in zip(alone, fused):
            assert abs(a - b) <= 1e-9, (t.number, alone, fused)
    best = result.study.best_trial
    assert abs(retrain_alone(spec, best)[-1] - best.value) <= 1e-9
    # hftc.sweep.train_alone is the same loop, from the spec.
    _, history = hs.train_alone(spec, dict(best.params), best.user_attrs["hftc_seed"],
                                best.user_attrs["hftc_orders"])
    assert abs(history[-1] - best.value) <= 1e-9


def _sweep_cmd(spec_file: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hftc", "sweep", str(spec_file), "--out", str(out),
            "--heartbeat-interval", "1", "--no-progress", *extra]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the sweep ended (rc {proc.returncode}) too early:\n{out}")
        time.sleep(0.1)
    raise AssertionError("timed out waiting for the sweep")


def _max_epoch_in_manifests(out: Path) -> int:
    best = 0
    for m in out.glob("workers/*/manifest.json"):
        try:
            trials = json.loads(m.read_text())["trials"]
        except (ValueError, KeyError):
            continue
        best = max([best, *(t["epoch"] for t in trials)])
    return best


def test_resume_after_sigkill_loses_and_repeats_nothing(spec_file: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    # 9 trials, 3 at a time: when the first trial reaches epoch 2 there is work left.
    proc = subprocess.Popen(_sweep_cmd(spec_file, out, "--trials", "9"), cwd=ROOT,
                            env=_env(HFTC_TEST_SLOW="0.3"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: _max_epoch_in_manifests(out) >= 2, 120, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    storage = f"sqlite:///{out / 'study.db'}"
    study = optuna.load_study(study_name="tiny", storage=storage)
    running = {t.number for t in study.trials if t.state == TrialState.RUNNING}
    assert running, "the sweep was killed with no trial running"

    # Without --resume: an error that says what to do. (In this process: it is faster.)
    assert main(_sweep_cmd(spec_file, out, "--trials", "9")[3:]) == 2
    assert "--resume" in capsys.readouterr().err

    assert main(_sweep_cmd(spec_file, out, "--trials", "9", "--resume", "-v")[3:]) == 0
    log = capsys.readouterr().out
    assert re.search(r"resumed \d+ trial\(s\): .*@epoch [1-9]", log), log  # from checkpoints

    study = optuna.load_study(study_name="tiny", storage=storage)
    trials = study.trials
    assert len(trials) == 9, [(t.number, t.state) for t in trials]
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    assert running <= {t.number for t in trials}  # re-attached under their own numbers
    spec = hs.load_spec(spec_file)
    for t in trials:
        steps = sorted(t.intermediate_values)
        assert steps == list(range(1, len(steps) + 1))
        # Weights and momentum came back from the checkpoint exactly: the trial still
        # matches stock training alone, across the kill.
        fused = [t.intermediate_values[s] for s in steps]
        alone = retrain_alone(spec, t)
        assert max(abs(a - b) for a, b in zip(alone, fused)) <= 1e-9, t.number
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 9  # nothing ran twice


def test_spec_errors_say_what_is_missing(tmp_path: Path, capsys):
    bad = tmp_path / "bad_spec.py"
    bad.write_text("def model(params):\n    pass\n")
    with pytest.raises(hs.SpecError, match="space, data"):
        hs.load_spec(bad)
    with pytest.raises(hs.SpecError, match="no such sweep spec file"):
        hs.load_spec(tmp_path / "missing.py")
    assert main(["sweep", str(bad)]) == 2
    assert "does not define space, data" in capsys.readouterr().err
    assert main(["sweep"]) == 2
    assert "give a SPEC" in capsys.readouterr().err


def test_a_misspelled_spec_field_is_an_error_not_ignored(spec_file: Path, tmp_path: Path,
                                                          capsys):
    """A spec whose ``optimiser`` (or ``epoch = 1``) the sweep silently did not read trained
    with SGD (or 10 epochs): a SpecError names the file, the name and the field meant."""
    typo = tmp_path / "typo_spec.py"
    typo.write_text(SPEC_SOURCE + "\n\ndef optimiser(params, module):\n"
                    "    return torch.optim.Adam(module.parameters(), lr=params['lr'])\n")
    with pytest.raises(hs.SpecError, match=r"typo_spec.py defines optimiser \(.*typo_spec.py:\d+"
                       r"\), which the sweep does not read: did you mean optimizer\(params, "
                       r"module\)\? Rename it to 'optimizer'"):
        hs.load_spec(typo)
    assert main(["sweep", str(typo), "--out", str(tmp_path / "out")]) == 2
    assert "did you mean optimizer(params, module)?" in capsys.readouterr().err
    typo.write_text(SPEC_SOURCE.replace("epochs = 4", "epoch = 1"))
    with pytest.raises(hs.SpecError, match=r"defines epoch = 1, .*did you mean epochs\?"):
        hs.load_spec(typo)
    # Fields whose default's type does not say their kinds: a metric by name, a direction
    # (default None), a pruner object
    for line, meant in (("metrics = 'loss'", "metric"), ("directions = 'maximize'", "direction"),
                        ("import optuna\nprunner = optuna.pruners.NopPruner()", "pruner")):
        source = SPEC_SOURCE.replace('metric = "loss"', "").replace('pruner = "sha"', "")
        typo.write_text(source + "\n" + line + "\n")
        with pytest.raises(hs.SpecError, match=rf"which the sweep does not read: did you mean "
                           rf"{meant}\? Rename it to '{meant}'"):
            hs.load_spec(typo)
    # Not typos: a field and a near name both defined, helpers of other kinds or arguments,
    # private names, imported functions.
    typo.write_text(SPEC_SOURCE + "\nEPOCHS = 3\nseeds = [0, 1]\n_optimiser = None\n"
                    "from torch.nn.functional import mse_loss as losses\n"
                    "def schedule(epoch):\n    return 0.5 ** epoch\n"
                    "def models(params):\n    return None\n")
    assert hs.load_spec(typo).epochs == 4


def test_spec_functions_returning_the_wrong_thing_are_named(spec_file: Path, tmp_path: Path):
    """model() returning None, space() a list, a metric a tensor per sample, a loss a float,
    data() a bare pair: each is a SpecError naming the function and where it is defined
    (the metric's and the loss's were a RuntimeError / FusionTypeError from inside)."""
    spec = hs.load_spec(spec_file).replace(n_trials=2, per_array=2, epochs=1, pruner="none")
    where = r" \(.*test_sweep.py:\d+\)"

    def no_model(params):
        spec.model(params)

    def space_list(trial):
        return [trial.suggest_float("lr", 0.01, 0.1)]

    def per_sample(output, target):
        return (output.argmax(-1) == target).double()

    def float_loss(output, target):
        return F.cross_entropy(output, target).item()

    cases = [(dict(model=no_model), rf"spec.model{where} returned a NoneType, not an nn.Module"),
             (dict(space=space_list), rf"spec.space{where} returned a list; return a dict"),
             (dict(metric=per_sample), rf"spec.metric{where} returned a tensor of shape "
                                       r"\(80,\); return one number"),
             (dict(loss=float_loss, metric="accuracy"),
              rf"spec.loss{where} returned a float on one model's output \(32, 3\) and the "
              r"targets \(32,\); the training loss must return a scalar tensor")]
    for k, (change, message) in enumerate(cases):
        with pytest.raises(hs.SpecError, match=message):
            hs.run(spec.replace(**change), out=tmp_path / f"out{k}", progress=False,
                   estimate=False)
    (xt, yt), _ = spec.data()
    with pytest.raises(hs.SpecError, match=r"the train split must be a pair .*\(spec.data is "
                                           r"defined at .*test_sweep.py:\d+\)"):
        hs.run(spec.replace(data=lambda: (xt, yt)), out=tmp_path / "out", progress=False)


def test_an_unknown_pruner_is_refused_before_anything_is_written(spec_file: Path,
                                                                 tmp_path: Path, capsys):
    """An unknown pruner name was refused after the output folder and its study.db were
    made; now before, saying where it came from."""
    out = tmp_path / "out"
    assert main(["sweep", str(spec_file), "--out", str(out), "--pruner", "asha2"]) == 2
    assert "unknown pruner 'asha2' (the spec's pruner, or --pruner)" in capsys.readouterr().err
    assert not out.exists()


USER_SPEC = '''
"""Minimize val loss; Adam vs SGD; width/depth choice; scheduler; random sampler; sha."""
import torch
import torch.nn as nn
import torch.nn.functional as F

name = "spec-a"
metric = "loss"
direction = "minimize"
epochs = 3
batch_size = 25
n_trials = 7
per_array = 3
pruner = "sha"
sampler = "random"
dtype = torch.float64
seed = 3


def space(trial):
    return {
        "lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
        "opt": trial.suggest_categorical("opt", ["adam", "sgd"]),
        "hidden": trial.suggest_categorical("hidden", [8, 16]),
        "layers": trial.suggest_int("layers", 1, 2),
        "gamma": trial.suggest_float("gamma", 0.5, 0.9),
    }


def model(params):
    layers = [nn.Linear(10, params["hidden"]), nn.ReLU()]
    for _ in range(params["layers"] - 1):
        layers += [nn.Linear(params["hidden"], params["hidden"]), nn.Tanh()]
    layers.append(nn.Linear(params["hidden"], 3))
    return nn.Sequential(*layers)


def optimizer(params, module):
    if params["opt"] == "adam":
        return torch.optim.Adam(module.parameters(), lr=params["lr"])
    return torch.optim.SGD(module.parameters(), lr=params["lr"], momentum=0.9)


def scheduler(optimizer, params):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=params["gamma"])


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 10, generator=g)
    y = (x[:, :3] @ torch.randn(3, 3, generator=g)).argmax(1)
    return (x[:200], y[:200]), (x[200:], y[200:])
'''


def test_a_users_spec_of_choices_matches_alone_and_reruns_alike(tmp_path: Path):
    """A spec as a user writes it: minimize the loss, Adam or SGD, a width and a depth
    choice (arrays split by structure), a StepLR per trial, the random sampler, successive
    halving, 7 trials through arrays of 3. Each trial reports what it reports trained
    alone, and the same spec in a fresh folder gives the same trials and values."""
    path = tmp_path / "user_spec.py"
    path.write_text(USER_SPEC)
    spec = hs.load_spec(path)
    runs = [hs.run(spec, out=tmp_path / f"out{k}", progress=False, estimate=False)
            for k in range(2)]
    trials = runs[0].study.trials
    assert len(trials) == 7 and {t.state for t in trials} <= {TrialState.COMPLETE,
                                                             TrialState.PRUNED}
    assert len({(t.params["hidden"], t.params["layers"]) for t in trials}) >= 2
    assert any("different shapes" in why for why in runs[0].apart)
    for t in trials:
        _, history = hs.train_alone(spec, dict(t.params), t.user_attrs["hftc_seed"],
                                    t.user_attrs["hftc_orders"])
        fused = [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
        assert max(abs(a - b) for a, b in zip(history, fused)) <= 1e-9, t.number
    assert [(t.state, t.value, t.params) for t in runs[1].study.trials] == [
        (t.state, t.value, t.params) for t in trials]


def _assert_failed_once_and_retried(trials, orphan, n_finished: int) -> None:
    """``orphan`` failed, and exactly one finished trial retried it with its parameters."""
    assert trials[orphan.number].state == TrialState.FAIL
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) == n_finished
    retry = [t for t in finished if t.system_attrs.get("failed_trial") == orphan.number]
    assert len(retry) == 1 and retry[0].params == trials[orphan.number].params


def test_orphaned_running_trial_is_failed_and_retried(spec_file: Path, tmp_path: Path):
    """A trial left RUNNING with no heartbeat and no manifest (its worker died right after
    asking) is failed and retried with its parameters, not waited for forever."""
    spec = hs.load_spec(spec_file).replace(n_trials=3, epochs=1, pruner="none")
    out = tmp_path / "out"
    out.mkdir()
    storage = hs.make_storage(f"sqlite:///{out / 'study.db'}")
    study = optuna.create_study(study_name="tiny", storage=storage, direction="minimize")
    orphan = study.ask()
    spec.space(orphan)
    result = hs.run(spec, out=out, progress=False)
    _assert_failed_once_and_retried(result.study.trials, orphan, n_finished=3)


def test_orphan_without_heartbeat_on_a_shared_storage_is_retried(spec_file: Path,
                                                                 tmp_path: Path, monkeypatch):
    """On a shared storage (one given by URL: other machines' workers may be alive), a
    trial left RUNNING by a worker killed while asking it never gets a heartbeat, which
    Optuna's stale check skips: it is failed and retried once it has stayed without one
    for the wait (a CI run hung on this with PostgreSQL)."""
    import hftc.sweep.recovery as recovery

    monkeypatch.setattr(recovery, "NO_HEARTBEAT_S", 0.0)
    spec = hs.load_spec(spec_file).replace(n_trials=3, epochs=1, pruner="none")
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    study = optuna.create_study(study_name="tiny", storage=hs.make_storage(url),
                                direction="minimize")
    orphan = study.ask()
    spec.space(orphan)
    logged: list[str] = []
    result = hs.run(spec, out=tmp_path / "out", storage=url, study_name="tiny",
                    heartbeat_interval=1, grace_period=2, progress=False, log=logged.append)
    _assert_failed_once_and_retried(result.study.trials, orphan, n_finished=3)
    assert any(f"trial {orphan.number} was running nowhere" in m for m in logged)


def test_a_trial_asked_a_moment_ago_is_not_taken_for_dead(spec_file: Path, tmp_path: Path):
    """The first sight of a RUNNING trial without a heartbeat starts its wait: a live
    worker between asking a trial and its first heartbeat keeps it."""
    import hftc.sweep.engine as engine

    spec = hs.load_spec(spec_file).replace(n_trials=2, epochs=1, pruner="none")
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    sweep = engine.Sweep(spec, out=tmp_path / "out", storage=url, study_name="tiny",
                         heartbeat_interval=1, grace_period=2, progress=False)
    sweep.storage = hs.make_storage(url)
    sweep.study = optuna.create_study(study_name="tiny", storage=sweep.storage,
                                      direction="minimize")
    fresh = sweep.study.ask()
    assert not sweep._reap_orphans()  # seen now: the wait starts
    assert sweep.study.trials[fresh.number].state == TrialState.RUNNING
    sweep.storage.record_heartbeat(fresh._trial_id)  # its worker is alive after all
    sweep._silent_since[fresh._trial_id] -= 3600  # (as if watched for an hour)
    assert not sweep._reap_orphans()
    assert sweep.study.trials[fresh.number].state == TrialState.RUNNING


def test_resume_restarts_a_trial_killed_before_its_first_manifest(spec_file: Path,
                                                                    tmp_path: Path):
    """A worker killed between asking a trial and writing its manifest leaves a RUNNING
    trial that did no work. --resume runs it under its own number, from epoch 0, and
    the study ends with no failed trial; the result is stock training alone."""
    spec = hs.load_spec(spec_file).replace(n_trials=3, epochs=2, pruner="none")
    out = tmp_path / "out"
    out.mkdir()
    storage = hs.make_storage(f"sqlite:///{out / 'study.db'}")
    study = optuna.create_study(study_name="tiny", storage=storage, direction="minimize")
    unstarted = study.ask()  # killed before sampling its space: no parameters yet
    result = hs.run(spec, out=out, progress=False, resume=True)
    trials = result.study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert trials[unstarted.number].params  # sampled on restart, under its own number
    for t in trials:
        fused = [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
        assert len(fused) == 2
        assert max(abs(a - b) for a, b in zip(retrain_alone(spec, t), fused)) <= 1e-9


def test_median_pruner_decides_as_optuna_does():
    """With no trial numbered below it still running (one at a time), the sweep's rule
    (hftc.sweep.pruning) answers as Optuna's median pruner does."""
    from hftc.sweep.pruning import prune_in_sequence

    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
    study = optuna.create_study(pruner=pruner)
    for k in range(4):
        study.add_trial(optuna.trial.create_trial(
            value=float(k), intermediate_values={s: k + 1.0 / s for s in range(1, 5)},
            params={}, distributions={}))
    for values in ([0.5, 3.0, 0.1], [5.0, 4.0], [2.0, 2.5, 1.6, 1.7], [float("nan")]):
        trial = study.ask()
        for s, v in enumerate(values, 1):
            trial.report(v, s)
        complete = study.get_trials(states=(TrialState.COMPLETE,))
        ours = prune_in_sequence(pruner, study, trial.number, trial._trial_id,
                                 dict(enumerate(values, 1)), complete, [])
        assert ours == trial.should_prune(), values
        study.tell(trial, state=TrialState.FAIL)


def test_demo_runs_small(tmp_path: Path, capsys):
    """make demo's code path, shrunk: leaderboard, best accuracy, a labelled speedup."""
    from hftc.sweep.demo import run_demo

    numbers = run_demo(tmp_path / "demo", n_trials=4, per_array=2, epochs=1, progress=False)
    text = capsys.readouterr().out
    assert "rank" in text and "best: trial" in text and "speedup" in text and "estimate" in text
    assert numbers["trial_epochs"] == 4 and numbers["speedup"] > 0
    assert 0 < numbers["best_value"] <= 1


def test_data_may_be_datasets(spec_file: Path):
    """(train_dataset, val_dataset) of (x, y) pairs is read once into the same tensors."""
    from torch.utils.data import TensorDataset

    spec = hs.load_spec(spec_file)
    (xt, yt), (xv, yv) = spec.data()
    as_datasets = spec.replace(data=lambda: (TensorDataset(xt, yt), TensorDataset(xv, yv)))
    a, b = SweepData.from_spec(spec), SweepData.from_spec(as_datasets)
    assert torch.equal(a.x_train[0], b.x_train[0]) and torch.equal(a.y_train, b.y_train)
    assert torch.equal(a.x_val[0], b.x_val[0]) and torch.equal(a.y_val, b.y_val)
    with pytest.raises(hs.SpecError, match="must be a pair"):
        SweepData.from_spec(spec.replace(data=lambda: ((xt, yt, yt), (xv, yv))))


def _space_with_optimizer_choice(trial):
    return {"lr": trial.suggest_float("lr", 0.01, 0.1, log=True),
            "opt": trial.suggest_categorical("opt", ["sgd", "adam"])}


def _optimizer_of_choice(params, model):
    if params["opt"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=params["lr"])


def test_a_categorical_optimizer_choice_shares_one_array(spec_file: Path, tmp_path: Path):
    """Trials whose optimizer() returned SGD and Adam landed in one array, and
    fuse_optimizers' 'needs optimizers of one class' failed every trial for good; then
    each class got an array of its own (half-empty arrays). Now both classes share one
    array (a MixedOptimizer); every trial reports what it reports trained alone."""
    spec = hs.load_spec(spec_file).replace(
        space=_space_with_optimizer_choice, optimizer=_optimizer_of_choice, n_trials=6,
        per_array=6, pruner="none", sampler="random", epochs=2)
    result = hs.run(spec, out=tmp_path / "out", progress=False)
    trials = result.study.trials
    assert result.formations == [(6,)]
    assert result.mixed and sorted(result.mixed[0][1]) == ["Adam", "SGD"]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6
    assert {t.params["opt"] for t in trials} == {"sgd", "adam"}
    for t in trials:
        _, history = hs.train_alone(spec, dict(t.params), t.user_attrs["hftc_seed"],
                                    t.user_attrs["hftc_orders"])
        assert abs(history[-1] - t.value) <= 1e-9, (t.number, history, t.value)


def test_a_grid_sampler_running_out_ends_the_sweep(spec_file: Path, tmp_path: Path):
    """optuna's GridSampler calls study.stop() when its grid is used up, which raises
    outside study.optimize: the sweep crashed and failed a trial that had trained. Now it
    asks for no more trials once the grid is done, and ends. Nor does it ask while every
    point is taken by a running trial: optuna's GridSampler would hand one out again (its
    is_exhausted counts finished trials only), and an array of 2 over a grid of 3 trained
    one point twice (a grid of 6 in arrays of 4: one point three times)."""
    grid = {"lr": [0.01, 0.03, 0.1], "momentum": [0.5], "weight_decay": [1e-4]}
    spec = hs.load_spec(spec_file).replace(
        sampler=optuna.samplers.GridSampler(grid, seed=0), n_trials=5, per_array=2,
        pruner="none", epochs=2)
    trials = hs.run(spec, out=tmp_path / "out", progress=False).study.trials
    assert len(trials) == 3
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert sorted(t.params["lr"] for t in trials) == grid["lr"]  # each point once


def _space_with_derived_values(trial):
    log_lr = trial.suggest_float("log_lr", -2.0, -1.0)
    return {"lr": 10 ** log_lr, "momentum": 0.5, "weight_decay": 1e-4}


def test_best_json_gives_the_params_space_returned(spec_file: Path, tmp_path: Path):
    """best.json held Optuna's trial.params, without the values space() derives or fixes
    (lr = 10 ** log_lr, a constant momentum): model(best["params"]) and train_alone with
    them built or trained another model than the sweep's best."""
    spec = hs.load_spec(spec_file).replace(space=_space_with_derived_values, n_trials=2,
                                           per_array=2, pruner="none", epochs=2)
    result = hs.run(spec, out=tmp_path / "out", progress=False)
    best = json.loads((tmp_path / "out" / "best.json").read_text())
    assert set(best["params"]) == {"lr", "momentum", "weight_decay"}
    _, history = hs.train_alone(spec, best["params"], best["seed"], best["orders"])
    assert abs(history[-1] - result.study.best_trial.value) <= 1e-9


def test_a_trial_whose_model_raises_fails_alone_and_the_others_resume(spec_file: Path,
                                                                     tmp_path: Path):
    """model() raising for one trial failed the other live trials with that trial's error
    (later: named as the other trial's), their work lost and their budget spent, where
    study.optimize fails the trial that raised alone. Now the others stay RUNNING with
    their checkpoints, and --resume trains them to the end, each as if alone."""
    spec = hs.load_spec(spec_file).replace(pruner="none", n_trials=4, per_array=2, epochs=2)
    seen: list[dict] = []

    def model(params):
        if params not in seen:
            seen.append(dict(params))
        if len(seen) > 2 and params == seen[2]:  # trial 2, asked with trials 0 and 1
            raise RuntimeError("this model refuses these params")
        return spec.model(params)

    with pytest.raises(RuntimeError, match="refuses") as raised:
        hs.run(spec.replace(model=model, per_array=3), out=tmp_path / "out", progress=False)
    # (the user's own error and traceback, noted with the trial and its params)
    [note] = raised.value.__notes__
    assert note.startswith("hftc sweep: raised while starting trial 2 (params {'lr': ")
    assert "trials [0, 1] are not failed: rerun with --resume" in note
    storage = f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    study = optuna.load_study(study_name=None, storage=storage)
    states = {t.number: t.state for t in study.trials}
    assert states == {0: TrialState.RUNNING, 1: TrialState.RUNNING, 2: TrialState.FAIL}
    assert study.trials[2].user_attrs["hftc_fail_reason"].startswith(
        "error while starting the trial: RuntimeError")

    trials = hs.run(spec.replace(model=model, per_array=3), out=tmp_path / "out",
                    progress=False, resume=True).study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE,
                                         TrialState.FAIL, TrialState.COMPLETE]
    for t in (trials[0], trials[1], trials[3]):
        fused = [t.intermediate_values[k] for k in sorted(t.intermediate_values)]
        assert max(abs(a - b) for a, b in zip(retrain_alone(spec, t), fused)) <= 1e-9


class _ExportOnly(torch.nn.Module):
    """Symbolic tracing cannot build torch.zeros of a traced size; torch.export can."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(36, 3)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc(x) + torch.zeros(x.shape[0], 3, dtype=x.dtype)


def test_a_model_only_torch_export_traces_is_swept(spec_file: Path, tmp_path: Path):
    """The sweep fused without example_inputs, so such a model failed every trial with a
    TraceError that said to pass example_inputs, which a spec cannot. The engine gives a
    training batch as example_inputs; the trials match training alone."""
    spec = hs.load_spec(spec_file).replace(model=lambda params: _ExportOnly(), n_trials=2,
                                           per_array=2, pruner="none", epochs=2)
    trials = hs.run(spec, out=tmp_path / "out", progress=False).study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    for t in trials:
        _, history = hs.train_alone(spec, dict(t.params), t.user_attrs["hftc_seed"],
                                    t.user_attrs["hftc_orders"])
        assert abs(history[-1] - t.value) <= 1e-9


def _space_one_trial_blows_up(trial):
    lr = trial.suggest_float("lr", 0.01, 0.1, log=True)
    return {"lr": 1e12 if trial.number == 0 else lr, "momentum": 0.9, "weight_decay": 1e-4}


def test_weights_gone_nan_are_diverged_whatever_the_metric(spec_file: Path, tmp_path: Path):
    """With metric='accuracy', a model whose weights went NaN still scored (argmax of NaN)
    and completed; it is failed as diverged, and its array's other trials go on alone."""
    spec = hs.load_spec(spec_file).replace(space=_space_one_trial_blows_up, metric="accuracy",
                                           n_trials=2, per_array=2, pruner="none", epochs=3)
    trials = hs.run(spec, out=tmp_path / "out", progress=False).study.trials
    assert trials[0].state == TrialState.FAIL
    assert "weights not finite" in trials[0].user_attrs["hftc_fail_reason"]
    assert trials[1].state == TrialState.COMPLETE


def _space_with_dropout(trial):
    return {"lr": trial.suggest_float("lr", 0.01, 0.5, log=True), "momentum": 0.5,
            "weight_decay": 1e-4, "dropout": 0.3}


def test_resume_draws_the_dropout_an_uninterrupted_sweep_draws(spec_file: Path,
                                                               tmp_path: Path):
    """A resumed sweep restarted its trials' dropout draws from their seeds, so with dropout
    its metrics after the resume differed from an uninterrupted sweep's. The random state
    the next round starts from is in the manifest, and resuming restores it."""
    spec = hs.load_spec(spec_file).replace(space=_space_with_dropout, n_trials=4,
                                           per_array=2, pruner="none", epochs=4)
    full = hs.run(spec, out=tmp_path / "full", progress=False).study.trials

    def interrupt(sweep):
        if sweep.round == 2:
            raise KeyboardInterrupt

    cut = hs.Sweep(spec, out=tmp_path / "cut", progress=False, on_round=interrupt)
    with pytest.raises(KeyboardInterrupt):
        cut.run()
    cut._lock.close()  # as if its process had died
    resumed = hs.Sweep(spec, out=tmp_path / "cut", progress=False, resume=True).run()
    trials = resumed.study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    for a, b in zip(full[:2], trials[:2]):  # the two trials the interruption cut
        assert a.params == b.params
        assert a.intermediate_values == b.intermediate_values, a.number


class _PruneAt(optuna.pruners.BasePruner):
    """Prunes trial number k at step ``plan[k]`` (a sweep's refills made predictable)."""

    def __init__(self, plan: dict[int, int]):
        self.plan = plan

    def prune(self, study, trial) -> bool:
        return self.plan.get(trial.number) == trial.last_step


def test_a_running_array_is_refilled_once_a_quarter_of_it_is_free(spec_file: Path,
                                                                 tmp_path: Path):
    """Each refill fuses the array again: an array of 8 takes new trials when 2 places
    are free, not after every pruned trial; at the end of the budget, when what is left
    fits. Every trial still reports, epoch by epoch, what it reports trained alone."""
    plan = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}
    spec = hs.load_spec(spec_file).replace(
        n_trials=11, per_array=8, epochs=6, pruner=_PruneAt(plan), sampler="random")
    result = hs.run(spec, out=tmp_path / "out", progress=False)
    # round 1: trial 0 pruned, 1 place free of 8: no refill, the array is cut in place;
    # round 2: trial 1 pruned, 2 free: trials 8 and 9 join; round 3: trial 2 pruned, 1
    # free, and the budget's last trial, 10, fits: it joins; then only cuts.
    assert result.formations[:5] == [(8,), (7,), (8,), (8,), (7,)], result.formations
    trials = result.study.trials
    assert len(trials) == 11
    assert [t.state for t in trials[:5]] == [TrialState.PRUNED] * 5
    assert [t.state for t in trials[5:]] == [TrialState.COMPLETE] * 6
    for t in trials:
        _, history = hs.train_alone(spec, dict(t.params), t.user_attrs["hftc_seed"],
                                    t.user_attrs["hftc_orders"])
        reported = [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
        assert len(reported) == plan.get(t.number, spec.epochs), t.number
        assert max(abs(a - b) for a, b in zip(reported, history)) <= 1e-9, t.number
