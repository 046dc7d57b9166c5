"""``make demo``: a real fused sweep on the 8x8 digits, and what it saved.

Runs :mod:`hftc.sweep.digits` (48 trials over learning rate, momentum, weight
decay and dropout, 16 per fused array, median pruning), prints the leaderboard
and the best accuracy, and the wall-clock speedup against the same study run one
trial at a time with stock Optuna: its training estimated from a sample of epochs
trained alone (stock model, stock ``torch.optim.SGD``, :func:`hftc.sweep.train_alone`,
one after each of the first 8 rounds of the sweep, off its clock, so both sides see the same machine
load) times the trial-epochs one at a time trains for these learning curves; its
Optuna share measured by replaying the trials through a stock Optuna study
(:func:`hftc.sweep.serial.replay_optuna`), and its data loading the sweep's.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import torch

from . import digits
from .engine import Sweep
from .report import fused_seconds, serial_estimate
from .spec import load_spec
from .training import SweepData, train_alone

__all__ = ["run_demo"]


def run_demo(out: str | Path = "sweeps/demo-digits", *, n_trials: int | None = None,
             per_array: int | None = None, epochs: int | None = None,
             serial_per_round: int = 1, threads: int | None = 1,
             progress: bool | None = None) -> dict:
    """Run the demo sweep in ``out`` (wiped first: the demo always starts afresh) and
    print the leaderboard, the best accuracy and the measured speedup. Returns the numbers.

    The serial side is sampled while the sweep runs: after each of its first 8 rounds, off
    the sweep's clock, ``serial_per_round`` trial-epochs of trials in the array are trained alone
    (stock model, stock SGD). On a shared machine whose load comes and goes, both sides
    are then measured under the same load."""
    before = torch.get_num_threads()
    if threads:
        # Small kernels on a shared 2-core machine: one intra-op thread per process is
        # both faster and steadier (the serial baseline gets the same).
        torch.set_num_threads(threads)
    try:
        return _run_demo(out, n_trials, per_array, epochs, serial_per_round, progress)
    finally:
        torch.set_num_threads(before)


def _run_demo(out, n_trials, per_array, epochs, serial_per_round, progress) -> dict:
    spec = load_spec(digits).replace(n_trials=n_trials, per_array=per_array, epochs=epochs)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / ".gitignore").write_text("# hftc sweep --demo output\n*\n")  # not for committing
    print(f"hftc sweep demo: {spec.n_trials} trials of a small CNN on scikit-learn's 8x8 digits "
          f"(1,437 train / 360 val images), {spec.epochs} epochs each, {spec.per_array} trials "
          f"per fused array, Optuna TPE sampler + median pruner, SQLite storage in {out}/")
    print(f"search space: lr, momentum, weight_decay (SGD) and dropout p; torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s), CPU\n", flush=True)

    data = SweepData.from_spec(spec)
    serial: list[float] = []

    def time_serial_epochs(sweep) -> None:
        # The same trials one by one: a trial of the array, this round's data order, one
        # epoch of a stock model and stock SGD (train_alone), evaluation included.
        arrays = [r for a in sweep.arrays for r in a.members]
        if len(serial) >= 8 * serial_per_round:  # a median of 8 holds; more costs demo time
            return
        sweep.charge_dynamo_import()
        for k in range(serial_per_round):
            run = arrays[(sweep.round + k) % len(arrays)]
            with torch.random.fork_rng(devices=[]):  # the sweep's dropout masks stay its own
                start = time.perf_counter()
                train_alone(spec, run.params, run.seed, run.orders[-1:], data)
                serial.append(time.perf_counter() - start)

    result = Sweep(spec, out=out, progress=progress, on_round=time_serial_epochs,
                   estimate_serial=0).run()
    print(result.leaderboard)
    best = result.best_trial
    if best is not None:
        print(f"\nbest: trial {best.number}, validation accuracy {best.value:.4f} "
              f"({', '.join(f'{k}={v:.3g}' for k, v in best.params.items())})")
    print(f"files: {', '.join(str(p) for p in result.files.values())}\n")

    result.serial_epoch_s = list(serial)
    serial_s, how = serial_estimate(result)
    trial_epochs = result.trial_epochs
    fused_s = fused_seconds(result)
    speedup = serial_s / fused_s
    tm = result.timings
    other = result.wall_s - sum(tm.values())
    before = (f" + the process's start {result.before_s:.1f} s (Python, the imports)"
              if fused_s != result.wall_s else "")
    print(f"fused sweep, measured:  {fused_s:6.1f} s wall clock for {trial_epochs} "
          f"trial-epochs = the sweep {result.wall_s:.1f} s (training {tm['train']:.1f} s, "
          f"fusing {tm['fuse']:.1f} s, Optuna {tm['optuna']:.1f} s, checkpoints "
          f"{tm['checkpoint']:.1f} s, result files {tm['results']:.1f} s, start-up "
          f"{other:.1f} s){before}")
    print(f"one at a time with stock Optuna, estimated: {serial_s:6.1f} s = {how}")
    print(f"speedup: {speedup:.2f}x wall clock (the serial side charged its own Optuna, "
          f"data loading, torch._dynamo's import and process start; its training estimated "
          f"from epochs trained alone; training alone: "
          f"{statistics.median(serial) * trial_epochs / tm['train']:.2f}x)")
    return {"wall_s": fused_s, "train_s": tm["train"], "serial_s": serial_s,
            "speedup": speedup, "trial_epochs": trial_epochs,
            "serial_trial_epochs": result.serial_trial_epochs,
            "best_value": best.value if best else None}
