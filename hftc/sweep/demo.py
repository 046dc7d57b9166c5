"""``make demo``: a real fused sweep on the 8x8 digits, and what it saved.

Runs :mod:`hftc.sweep.digits` (48 trials over learning rate, momentum, weight
decay and dropout, 16 per fused array, median pruning), prints the leaderboard
and the best accuracy, then measures the same trials trained one by one (stock
model, stock ``torch.optim.SGD``, :func:`hftc.sweep.train_alone`) on a subset of
trials and epochs, scales that to the sweep's trial-epochs and reports the
wall-clock speedup, labelled as the estimate it is.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import torch

from . import digits
from .engine import Sweep
from .spec import load_spec
from .training import SweepData, train_alone

__all__ = ["run_demo"]


def run_demo(out: str | Path = "sweeps/demo-digits", *, n_trials: int | None = None,
             per_array: int | None = None, epochs: int | None = None,
             serial_trials: int = 4, serial_epochs: int = 2, threads: int | None = 1,
             progress: bool | None = None) -> dict:
    """Run the demo sweep in ``out`` (wiped first: the demo always starts afresh) and
    print the leaderboard, the best accuracy and the measured speedup. Returns the numbers."""
    before = torch.get_num_threads()
    if threads:
        # Small kernels on a shared 2-core machine: one intra-op thread per process is
        # both faster and steadier (the serial baseline gets the same).
        torch.set_num_threads(threads)
    try:
        return _run_demo(out, n_trials, per_array, epochs, serial_trials, serial_epochs,
                         progress)
    finally:
        torch.set_num_threads(before)


def _run_demo(out, n_trials, per_array, epochs, serial_trials, serial_epochs, progress) -> dict:
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

    result = Sweep(spec, out=out, progress=progress).run()
    study = result.study
    print(result.leaderboard)
    best = result.best_trial
    if best is not None:
        print(f"\nbest: trial {best.number}, validation accuracy {best.value:.4f} "
              f"({', '.join(f'{k}={v:.3g}' for k, v in best.params.items())})")
    print(f"files: {', '.join(str(p) for p in result.files.values())}\n")

    # The serial baseline: the same trials, one by one, each a stock model + stock SGD.
    data = SweepData.from_spec(spec)
    finished = sorted((t for t in study.trials if t.user_attrs.get("hftc_orders")),
                      key=lambda t: t.number)
    picked = finished[:: max(1, len(finished) // serial_trials)][:serial_trials]
    per_epoch = []
    for t in picked:
        for k in range(1, serial_epochs + 1):
            orders = t.user_attrs["hftc_orders"][:k]
            start = time.perf_counter()
            train_alone(spec, digits_params(t), t.user_attrs["hftc_seed"], orders, data)
            per_epoch.append((time.perf_counter() - start, len(orders)))
    # The median per-epoch time over the measured runs: robust to a busy neighbour.
    serial_epoch_s = statistics.median(s / k for s, k in per_epoch)
    trial_epochs = sum(len(t.intermediate_values) for t in study.trials)
    serial_s = serial_epoch_s * trial_epochs
    speedup = serial_s / result.wall_s
    tm = result.timings
    other = result.wall_s - sum(tm.values())
    print(f"fused sweep, measured:  {result.wall_s:6.1f} s wall clock for {trial_epochs} "
          f"trial-epochs (training {tm['train']:.1f} s, fusing {tm['fuse']:.1f} s, Optuna "
          f"{tm['optuna']:.1f} s, checkpoints {tm['checkpoint']:.1f} s, start-up {other:.1f} s)")
    print(f"one by one, estimated: {serial_s:6.1f} s = {serial_epoch_s * 1e3:.1f} ms per "
          f"trial-epoch (measured: {len(picked)} of these trials x {serial_epochs} epochs, "
          f"trained alone) x {trial_epochs} trial-epochs")
    print(f"speedup: {speedup:.2f}x wall clock (estimate: the serial side is measured on a "
          f"subset and scaled, and leaves out its own Optuna and start-up costs)")
    return {"wall_s": result.wall_s, "train_s": result.train_s, "serial_s": serial_s,
            "speedup": speedup, "trial_epochs": trial_epochs,
            "best_value": best.value if best else None}


def digits_params(trial) -> dict:
    """The params dict the spec's space gives for a finished trial."""
    return dict(trial.params)
