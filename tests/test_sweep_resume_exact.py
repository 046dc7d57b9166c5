"""A sweep killed with SIGKILL anywhere, then resumed until done, equals the sweep that
never stopped: every trial's number, parameters, state, intermediate values and value,
bit for bit, with dropout on and a TPE sampler that conditions on the trials before it.

Before: a resumed worker's sampler restarted its random stream (reseeded past the trials
already there, or restored from the last manifest, which a kill before the first
manifest or mid-ask did not have), so 8-15 of 16 trials of the digits sweep got other
parameters than the uninterrupted run's, other trials were pruned and the best changed.

Each killed run is a fork of this process (the imports are paid once), which a hook
kills at a named point (its nth pass), or the test at a random moment; the resumes run
the same way, and the last one here.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

import hftc
import hftc.sweep as hs
from hftc.sweep import engine
from hftc.sweep.sampling import TrialSeededSampler, random_streams

SPEC_SOURCE = '''
"""An MLP with dropout in float64, two widths (two fused arrays a round), TPE with two
startup trials (the later trials' parameters depend on the earlier ones' results)."""
import optuna
import torch
import torch.nn.functional as F
from torch import nn

name = "exact"
metric = "loss"
epochs = 3
batch_size = 32
n_trials = 10
per_array = 4
dtype = torch.float64
pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)


def sampler(seed):
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=2, constant_liar=True)


class Net(nn.Module):
    def __init__(self, p, width):
        super().__init__()
        self.fc1 = nn.Linear(12, width)
        self.dropout = nn.Dropout(p)
        self.fc2 = nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


def space(trial):
    return {"lr": trial.suggest_float("lr", 0.01, 0.5, log=True),
            "momentum": trial.suggest_float("momentum", 0.0, 0.9),
            "dropout": trial.suggest_float("dropout", 0.1, 0.5),
            "width": trial.suggest_categorical("width", [8, 16])}


def model(params):
    return Net(params["dropout"], params["width"])


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=g)
    y = (x @ torch.randn(12, 3, generator=g)).argmax(1)
    return (x[:160], y[:160]), (x[160:], y[160:])
'''

# The uninterrupted sweep (5 batches a round): trials 0-3 (widths 8, 8, 16, 8: two
# arrays) complete in rounds 0-2; trials 4-7 (TPE, conditioned on 0-3) start; 5 is pruned
# at epoch 2 and 8 takes its place; 4, 6, 7 complete and 8 is pruned at epoch 1; then 9.
# Each case: the runs killed one after the other, (kill point, at its nth pass); each run
# after the first resumes.
KILLS = {
    # before the first checkpoint: trial 0 asked, nothing sampled, no manifest yet
    "right after the first ask": [("ask", 1)],
    # trial 1's lr drawn and stored, its momentum not
    "while sampling trial 1": [("sample_independent", 6)],
    # the first array fused, the second not yet
    "during the first formation's fusing": [("fuse", 1)],
    "between the two arrays of a batch": [("step", 2)],
    "mid-array, round 1": [("batch", 8)],
    # after round 2's decisions, before asking trials 4-7 (the next formation)
    "between array formations": [("refill", 4)],
    # trials 4 and 5 asked (TPE), trial 6 not yet sampled
    "while sampling trial 6": [("sample_relative", 7)],
    # trial 5's parameters drawn and stored, not yet in the manifest
    "after sampling trial 5": [("space", 6)],
    "mid-decisions": [("tell", 3)],
    "twice: mid-round, then the resumer while fusing": [("batch", 13), ("fuse", 1)],
    "thrice": [("sample_relative", 6), ("step", 3), ("tell", 2)],
}


@pytest.mark.parametrize("make", [
    lambda seed: optuna.samplers.RandomSampler(seed=seed),
    lambda seed: optuna.samplers.TPESampler(seed=seed, n_startup_trials=2),
], ids=["random", "tpe"])
def test_a_trials_draws_depend_on_its_number_not_on_the_draws_before_it(make):
    """A sampler made anew mid-study (a resumed process), from another seed, asks what
    the one that never stopped asks: each draw is seeded from (seed, trial, what)."""
    def asked(new_sampler_at: int | None) -> list[dict]:
        study = optuna.create_study(sampler=TrialSeededSampler(make(0), seed=7))
        for k in range(6):
            if k == new_sampler_at:
                study.sampler = TrialSeededSampler(make(1000 + k), seed=7)
            trial = study.ask()
            x = trial.suggest_float("x", -1.0, 1.0)
            kind = trial.suggest_categorical("kind", ["a", "b", "c"])
            study.tell(trial, x * x + (kind == "b"))
        return [t.params for t in study.trials]

    assert asked(None) == asked(3) == asked(5)
    with_other_seed = optuna.create_study(sampler=TrialSeededSampler(make(0), seed=8))
    assert with_other_seed.ask().suggest_float("x", -1.0, 1.0) != asked(None)[0]["x"]


def test_the_seeded_sampler_finds_optunas_streams_and_is_the_wrapped_one_otherwise():
    tpe = optuna.samplers.TPESampler(seed=0)
    assert [path for path, _ in random_streams(tpe)] == ["_random_sampler._rng", "_rng"]
    grid = TrialSeededSampler(optuna.samplers.GridSampler({"x": [0, 1]}), seed=0)
    study = optuna.create_study(sampler=grid)
    assert not grid.is_exhausted(study)  # GridSampler's own method, through the wrapper
    assert "GridSampler" in repr(grid)


def _outcome(trials: list[optuna.trial.FrozenTrial]) -> list[tuple]:
    """What a sweep's trials came to, all of it: compared for equality, bit for bit."""
    return [(t.number, t.state, t.params, t.value, t.intermediate_values,
             t.user_attrs.get("hftc_seed"), t.user_attrs.get("hftc_orders")) for t in trials]


def _sweep(spec: hs.SweepSpec, out: Path, resume: bool) -> hs.SweepResult:
    return hs.Sweep(spec, out=out, progress=False, resume=resume, estimate_serial=0).run()


def _kill_at(point: str, nth: int) -> None:
    """Make this process SIGKILL itself at its ``nth`` pass of ``point``."""
    passes = 0

    def reached() -> None:
        nonlocal passes
        passes += 1
        if passes == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    def hook(owner: object, name: str, before: bool) -> None:
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            if before:
                reached()
            result = original(*args, **kwargs)
            if not before:
                reached()
            return result
        setattr(owner, name, hooked)

    if point == "batch":  # before the nth training batch
        batches = engine.batches

        def hooked_batches(*args):
            for index in batches(*args):
                reached()
                yield index
        engine.batches = hooked_batches
        return
    owner, name, before = {
        "ask": (optuna.Study, "ask", False),  # the trial made, none of its space sampled
        "sample_independent": (TrialSeededSampler, "sample_independent", True),
        "sample_relative": (TrialSeededSampler, "sample_relative", True),
        "fuse": (hftc, "fuse", False),  # an array fused, its fused optimizers not yet made
        "step": (engine.Sweep, "_step", True),  # one array's step of a batch
        "space": (engine.Sweep, "_params", False),  # spec.space(trial) returned
        "refill": (engine.Sweep, "_refill", True),
        "tell": (engine.Sweep, "_tell", True),
    }[point]
    hook(owner, name, before)


def _in_a_fork(run, timeout: float = 240.0, kill_when=None) -> str:
    """``run()`` in a forked child; how it ended: "killed" (SIGKILL, by itself or by the
    test once ``kill_when()`` is true), "finished", or a failure of the test."""
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 0
        try:
            torch.set_num_threads(1)
            run()
        except BaseException:  # noqa: BLE001 - reported by the exit code
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        elapsed = time.monotonic() - start
        if (kill_when is not None and kill_when()) or elapsed >= timeout:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            assert elapsed < timeout, f"the sweep ran past {timeout} s"
            break
        time.sleep(0.02)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"the forked sweep failed (status {status}); its traceback is in the captured stderr")
    return "finished"


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> hs.SweepSpec:
    path = tmp_path_factory.mktemp("spec") / "exact_spec.py"
    path.write_text(SPEC_SOURCE)
    return hs.load_spec(path)


@pytest.fixture(scope="module")
def uninterrupted(spec: hs.SweepSpec, tmp_path_factory) -> list[tuple]:
    """The outcome of the sweep that never stopped."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = _sweep(spec, tmp_path_factory.mktemp("full") / "out", resume=False)
    finally:
        torch.set_num_threads(threads)
    outcome = _outcome(result.study.trials)
    states = [o[1] for o in outcome]
    # A sweep worth checking, on which the kill points above are placed: TPE trials, pruned
    # ones, one that took a pruned trial's place, two widths in the first array.
    assert len(outcome) == 10 and states.count(TrialState.PRUNED) >= 1, states
    assert {o[2]["width"] for o in outcome[:4]} == {8, 16}
    return outcome


def _killed_then_resumed(spec: hs.SweepSpec, out: Path, kills: list[tuple[str, int]],
                         ) -> list[optuna.trial.FrozenTrial]:
    """The sweep of ``spec`` in ``out`` killed at each of ``kills`` in turn (every run
    after the first resuming), then resumed to its end: its trials."""
    for k, (point, nth) in enumerate(kills):
        def killed_run(point=point, nth=nth, resume=k > 0):
            _kill_at(point, nth)
            _sweep(spec, out, resume)
        assert _in_a_fork(killed_run) == "killed", f"{point} #{nth} was never reached"
    resumed = _sweep(spec, out, resume=True)
    assert not list(out.rglob("*.tmp"))
    return resumed.study.trials


@pytest.mark.parametrize("case", list(KILLS))
def test_a_sweep_killed_anywhere_and_resumed_equals_the_uninterrupted_one(
        case: str, spec: hs.SweepSpec, uninterrupted: list[tuple], tmp_path: Path):
    trials = _killed_then_resumed(spec, tmp_path / "out", KILLS[case])
    assert _outcome(trials) == uninterrupted


def _after(seconds: float, condition=lambda: True):
    """A ``kill_when`` for :func:`_in_a_fork`: ``seconds`` after ``condition()`` first
    held."""
    since: list[float] = []

    def due() -> bool:
        if not since and condition():
            since.append(time.monotonic())
        return bool(since) and time.monotonic() - since[0] >= seconds
    return due


def test_a_sweep_killed_at_random_moments_and_resumed_equals_the_uninterrupted_one(
        spec: hs.SweepSpec, uninterrupted: list[tuple], tmp_path: Path):
    """Kills wherever the clock puts them: the first 0-1 s after the sweep's first manifest
    (it is training by then, seconds from its end), each resume 0.3-3 s after it started,
    three kills at most; then resumed to the end."""
    out = tmp_path / "out"
    clock = random.Random(44)
    started = lambda: any((out / "workers").glob("*/manifest.json"))  # noqa: E731
    kills = 0
    while kills < 3:
        when = (_after(clock.uniform(0.0, 1.0), started) if kills == 0
                else _after(clock.uniform(0.3, 3.0)))
        if _in_a_fork(lambda resume=kills > 0: _sweep(spec, out, resume),
                      kill_when=when) == "finished":
            break
        kills += 1
    assert kills >= 1, "the sweep ended before the first kill"
    assert _outcome(_sweep(spec, out, resume=True).study.trials) == uninterrupted


def _width_8_8_8_16(trial: optuna.Trial) -> dict:
    return {"lr": trial.suggest_float("lr", 0.05, 0.3, log=True), "momentum": 0.5,
            "dropout": trial.suggest_float("dropout", 0.2, 0.5),
            "width": 16 if trial.number == 3 else 8}


class _PruneAtEpochOne(optuna.pruners.BasePruner):
    """Prunes the trials ``numbers`` after their first epoch, and no other."""

    def __init__(self, numbers: set[int]):
        self.numbers = numbers

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number in self.numbers and trial.last_step == 1


def test_a_resumed_sweep_fuses_the_arrays_the_uninterrupted_one_had(spec: hs.SweepSpec,
                                                                    tmp_path: Path):
    """Widths 8, 8, 8 and 16 padded would do 1.6x their arithmetic (> max_padding 1.4):
    two arrays. Trials 1 and 2 pruned, 8 and 16 pad within 1.4x. The uninterrupted sweep
    re-formed only the shrunk array ([0] and [3], apart), a resumed one fused [0, 3] as
    one padded array: other dropout draws, other metrics after the resume. Now every
    change re-forms all arrays from the live trials, in both."""
    padded = spec.replace(space=_width_8_8_8_16, n_trials=4, per_array=4, pad_widths=True,
                          max_padding=1.4, pruner=_PruneAtEpochOne({1, 2}))
    full = _sweep(padded, tmp_path / "full", resume=False)
    assert full.formations[0] == (3, 1), full.formations  # two arrays, as the docstring says
    trials = _killed_then_resumed(padded, tmp_path / "out", [("batch", 13)])
    assert _outcome(trials) == _outcome(full.study.trials)


class _LoggedMedianPruner(optuna.pruners.MedianPruner):
    """The spec's median pruner, writing down every (trial, step) it is asked about."""

    def __init__(self, log: Path):
        super().__init__(n_startup_trials=1, n_warmup_steps=0)
        self.log = log

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        with open(self.log, "a") as f:
            f.write(f"{trial.number} {trial.last_step}\n")
        return super().prune(study, trial)


def test_the_pruner_is_asked_once_per_trial_and_epoch_across_kills(
        spec: hs.SweepSpec, uninterrupted: list[tuple], tmp_path: Path):
    """A resumed worker asked the pruner again about every trial it re-attached (one that
    counts, samples or reads the trials told since would answer otherwise). Now a trial
    kept at an epoch is recorded so (the worker folder's ``kept.txt``), and is not asked again: every
    (trial, step) once, as in the uninterrupted sweep."""
    log = tmp_path / "asked.txt"
    logged = spec.replace(pruner=_LoggedMedianPruner(log))
    # killed in round 2 (trials 0-3 kept at epoch 2), the resumer killed in that round too
    trials = _killed_then_resumed(logged, tmp_path / "out", [("batch", 13), ("batch", 4)])
    assert _outcome(trials) == uninterrupted
    asked = Counter(tuple(map(int, line.split())) for line in log.read_text().splitlines())
    # (the last epoch too: Optuna's loop asks after every report, test_hunt_spec.py)
    once = Counter((t.number, step) for t in trials for step in t.intermediate_values)
    assert asked == once


class _TaggedNet(torch.nn.Module):
    """The spec's Net with extra state (``get_extra_state``): its trial's tag, which
    torch saves beside the tensors and a checkpoint must give back."""

    def __init__(self, p: float, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, width)
        self.dropout = torch.nn.Dropout(p)
        self.fc2 = torch.nn.Linear(width, 3)
        self.tag = f"p={p:.3f}"

    def forward(self, x):
        return self.fc2(self.dropout(torch.relu(self.fc1(x))))

    def get_extra_state(self):
        return {"tag": self.tag}

    def set_extra_state(self, state):
        self.tag = state["tag"]


def test_a_model_with_extra_state_is_checkpointed_and_resumed_exactly(
        spec: hs.SweepSpec, tmp_path: Path):
    """A fused state dict holds each model's extra state (a list of the N models' own):
    the checkpoint of an array of such models resumes (torch's strict load wanted
    ``_extra_state``, which the fused state dict lacked) to the uninterrupted sweep."""
    tagged = spec.replace(model=lambda params: _TaggedNet(params["dropout"], params["width"]),
                          n_trials=6)
    full = _sweep(tagged, tmp_path / "full", resume=False)
    trials = _killed_then_resumed(tagged, tmp_path / "out", [("batch", 8)])
    assert _outcome(trials) == _outcome(full.study.trials)
