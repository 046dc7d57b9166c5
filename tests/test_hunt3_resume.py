"""Bugs found hunting through the resume of a killed ``hftc sweep`` (real SQLite storage,
real subprocesses killed with SIGKILL) and sweeps over models of several widths."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import hftc.sweep as hs
from hftc.__main__ import main
from hftc.errors import SweepError

ROOT = Path(__file__).resolve().parents[1]

SPEC = '''
"""An MLP of two widths in float64 (two fused arrays a round), the default sampler and
pruner (TPE, median)."""
import torch
import torch.nn.functional as F
from torch import nn

name = "resume"
metric = "loss"
epochs = 3
batch_size = 32
n_trials = 4
per_array = 2
dtype = torch.float64


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(12, width)
        self.fc2 = nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def space(trial):
    return {"lr": trial.suggest_float("lr", 0.02, 0.3, log=True), "momentum": 0.5,
            "width": trial.suggest_categorical("width", [8, 16])}


def model(params):
    return Net(params["width"])


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=g)
    y = (x @ torch.randn(12, 3, generator=g)).argmax(1)
    return (x[:160], y[:160]), (x[160:], y[160:])
'''

# Kills its own process with SIGKILL before the nth training batch.
KILLED_AT_BATCH = '''
import os, signal, sys
import hftc.sweep as hs
from hftc.sweep import engine

spec, out, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
count = 0
batches = engine.batches


def _batches(*args):
    global count
    for idx in batches(*args):
        count += 1
        if count == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        yield idx


engine.batches = _batches
hs.run(spec, out=out, progress=False, estimate=False)
print("the kill point was never reached")
'''


def _killed_sweep(tmp_path: Path, source: str, nth: int = 12) -> tuple[Path, Path]:
    """A sweep of ``source`` run in a subprocess and killed with SIGKILL mid-array: its
    spec file and its folder."""
    spec, out, driver = tmp_path / "spec.py", tmp_path / "out", tmp_path / "driver.py"
    spec.write_text(source)
    driver.write_text(KILLED_AT_BATCH)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(driver), str(spec), str(out), str(nth)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    return spec, out


def _trials(out: Path, name: str = "resume") -> list[tuple]:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}")
    return [(t.number, t.state, t.params, t.intermediate_values) for t in study.trials]


@pytest.mark.parametrize("extra, said", [
    (["--pruner", "none"], "pruner was MedianPruner, now NopPruner (--pruner or the spec's "
                           "pruner)"),
    (["--sampler", "random"], "sampler was TPESampler, now RandomSampler (--sampler or the "
                              "spec's sampler)"),
    (["--seed", "7"], "seed was 0, now 7 (--seed or the spec's seed)"),
    (["--epochs", "5"], "epochs was 3, now 5 (--epochs or the spec's epochs)"),
])
def test_a_killed_sweep_resumed_with_another_search_is_refused(tmp_path: Path, capsys, extra,
                                                               said):
    """Before: ``--resume --pruner none`` (or ``--sampler random``) after a kill went on
    silently with the other pruner or sampler: the study's first trials chosen by TPE and
    pruned by the median rule, the rest drawn at random and never pruned, one leaderboard.
    Now every option that changes the study's meaning is in its record, and a resume with
    another value is refused (status 2) naming the option, both values and what to do;
    the killed trials wait, untouched, for the resume with the first run's options, which
    completes them. (The workers' count, --per-array, --trials are no edit.)"""
    spec, out = _killed_sweep(tmp_path, SPEC)
    before = _trials(out)
    assert TrialState.RUNNING in [t[1] for t in before]
    args = ["sweep", str(spec), "--out", str(out), "--no-progress", "--no-estimate",
            "--resume"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert said in err and "was started with another spec" in err, err
    assert "another --out, or --study" in err
    assert _trials(out) == before  # nothing asked, told or failed by the refused resume
    assert main([*args, "--per-array", "3"]) == 0
    assert [t[1] for t in _trials(out)] == [TrialState.COMPLETE] * 4


MEDIAN = SPEC.replace('dtype = torch.float64', 'dtype = torch.float64\nimport optuna\n'
                      'pruner = optuna.pruners.MedianPruner(n_startup_trials=1)')
OWN_PRUNER = SPEC.replace('dtype = torch.float64', """dtype = torch.float64
import optuna


class PruneTrialOne(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return trial.number == 1 and len(trial.intermediate_values) >= 1


pruner = PruneTrialOne()""")


@pytest.mark.parametrize("source, edit, said", [
    (MEDIAN, ("n_startup_trials=1", "n_startup_trials=3"),
     r"pruner was MedianPruner\(n_startup_trials=1\), now MedianPruner\(n_startup_trials=3\)"),
    (OWN_PRUNER, ("trial.number == 1", "trial.number == 2"),
     r"pruner was PruneTrialOne \(its code \w+\), now PruneTrialOne \(its code \w+\)"),
], ids=["median", "own class"])
def test_a_pruner_edited_in_the_spec_between_kill_and_resume_is_refused(tmp_path: Path, source,
                                                                        edit, said):
    """The spec's pruner edited between the kill and the resume (the median pruner's
    startup trials, the rule of a pruner class of the spec's own) trained on: the trials
    before and after the kill were pruned by other rules, in one study."""
    spec, out = _killed_sweep(tmp_path, source)
    before = _trials(out)
    spec.write_text(source.replace(*edit))
    with pytest.raises(SweepError, match=said):
        hs.run(spec, out=out, resume=True, progress=False, estimate=False)
    assert _trials(out) == before
    spec.write_text(source)
    done = hs.run(spec, out=out, resume=True, progress=False, estimate=False)
    assert {t.state for t in done.study.trials} <= {TrialState.COMPLETE, TrialState.PRUNED}


def test_optuna_objects_run_again_in_one_process_are_no_edit_but_others_are(tmp_path: Path):
    """A notebook runs ``hs.run(spec)`` twice with the same objects: Optuna fills in the
    arguments it resolves on first use (Hyperband's ``max_resource="auto"``, inside a
    PatientPruner; TPE's ``gamma=None``), which is no edit; a pruner of another patience
    is one."""
    path = tmp_path / "spec.py"
    path.write_text(SPEC)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        pruner = optuna.pruners.PatientPruner(
            optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto"), patience=1)
        other = optuna.pruners.PatientPruner(
            optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto"), patience=2)
    spec = hs.load_spec(path).replace(
        pruner=pruner, sampler=optuna.samplers.TPESampler(n_startup_trials=2), n_trials=3)
    hs.run(spec, out=tmp_path / "out", estimate=False, progress=False)
    pruner._wrapped_pruner._max_resource = 3  # as Optuna sets it at its first call
    again = hs.run(spec.replace(n_trials=4), out=tmp_path / "out", estimate=False,
                   progress=False)
    assert len(again.study.trials) == 4
    with pytest.raises(SweepError, match=r"pruner was PatientPruner\(patience=1\), now "
                                         r"PatientPruner\(patience=2\)"):
        hs.run(spec.replace(n_trials=5, pruner=other), out=tmp_path / "out", estimate=False,
               progress=False)


def test_a_killed_sweep_resumed_with_another_direction_says_how_to_continue_it(
        tmp_path: Path):
    """An edited ``direction`` on resume said only "pick another --study name": the way
    to continue the killed sweep (set the direction back) went unsaid."""
    spec, out = _killed_sweep(tmp_path, SPEC)
    before = _trials(out)
    spec.write_text(SPEC.replace('metric = "loss"', 'metric = "loss"\ndirection = "maximize"'))
    with pytest.raises(SweepError, match=r"is minimize, but the spec's direction is "
                                         r"'maximize'.*set direction = 'minimize' in the "
                                         r"spec to continue it, or pick another --study"):
        hs.run(spec, out=out, resume=True, progress=False, estimate=False)
    assert _trials(out) == before


def test_a_study_run_with_trials_goes_on_to_them_when_a_later_run_gives_none(tmp_path: Path):
    """Before: ``hftc sweep spec.py --trials 2`` then the same command without ``--trials``
    (``--resume``, or run again) went on to the spec's ``n_trials`` (4), the study grown
    silently. Now the study records the number a run gave and a run that gives none goes
    on to it; a run that gives one (``--trials 3``) extends the study, and is recorded."""
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    args = ["sweep", str(spec), "--out", str(tmp_path / "out"), "--no-progress",
            "--no-estimate"]
    assert main([*args, "--trials", "2"]) == 0
    assert len(_trials(tmp_path / "out")) == 2
    assert main(args) == 0
    assert len(_trials(tmp_path / "out")) == 2, "a run without --trials grew the study"
    assert main([*args, "--trials", "3"]) == 0
    assert main(args) == 0
    assert [t[1] for t in _trials(tmp_path / "out")] == [TrialState.COMPLETE] * 3
