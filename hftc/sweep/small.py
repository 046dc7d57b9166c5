"""A sweep too small to gain from fusing (:func:`hftc.sweep.serial.too_small`), run as it
would be without hftc: one trial at a time with stock Optuna, with the sweep's files."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..errors import SweepFileError
from .clock import before_sweep
from .serial import run_serial, too_small
from .spec import SweepSpec
from .training import load_data

__all__ = ["run_one_by_one"]


def run_one_by_one(spec: SweepSpec, out: str | Path, log=None, why: str | None = None) -> Any:
    """A sweep too small to gain (:func:`too_small`), or asked to (``why``: ``hftc sweep
    --serial``), run as it would be without hftc: :func:`run_serial` in ``out`` (its study
    in ``out/serial.db``), with the sweep's results (results.csv, curves.png, best.json)
    and a :class:`~hftc.sweep.SweepResult`."""
    from types import SimpleNamespace

    from .engine import SweepResult
    from .report import write_results

    out = Path(out)
    try:  # a folder that cannot be written stops it at the start, as the sweep's does
        (out / "trials").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SweepFileError(
            f"cannot write in the sweep's folder {out} ({exc.strerror or exc}): make it "
            f"writable or give another --out", str(out)) from exc
    why = why or too_small(spec) or "asked to"
    if log is not None:
        log(f"one trial at a time with stock Optuna: {why}")
    start = time.perf_counter()
    before_s = before_sweep()
    data = load_data(spec)  # start-up, as the fused sweep's (the spec's errors first)
    load_s = time.perf_counter() - start
    # torch.optim's first optimizer imports torch._dynamo (about a second, once per
    # process): start-up, as in the fused sweep, not the first trial's training.
    dynamo_start = time.perf_counter()
    import torch._dynamo  # noqa: F401
    dynamo_import_s = time.perf_counter() - dynamo_start
    result = run_serial(spec, out, data=data, save_best=True, record=True)
    results_start = time.perf_counter()
    files, board = write_results(SimpleNamespace(study=result.study, out=out, spec=spec))
    results_s = time.perf_counter() - results_start
    timings = {"train": result.train_s, "fuse": 0.0, "optuna": result.optuna_s,
               "checkpoint": 0.0, "results": results_s}
    return SweepResult(result.study, out, time.perf_counter() - start, result.train_s,
                       result.trial_epochs, files, board, timings, spec.metric_name,
                       load_s=load_s, dynamo_import_s=dynamo_import_s,
                       before_s=before_s,
                       note=f"run one trial at a time with stock Optuna, no fusing ({why})")
