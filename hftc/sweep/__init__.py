"""Fused hyper-parameter sweeps with Optuna: N trials trained as one fused module.

::

    import hftc.sweep

    spec = hftc.sweep.load_spec("spec.py")          # space(trial), model(params), data(), ...
    result = hftc.sweep.run(spec, n_trials=32, per_array=16, out="sweeps/digits")
    print(result.leaderboard)                       # results.csv, best.pt, curves.png in out/

Optuna does the searching (samplers), the early stopping (pruners) and the
book-keeping across processes and machines (its RDB storage: SQLite by default,
PostgreSQL for many machines); hftc trains each batch of N asked trials as one
fused module. ``python -m hftc sweep SPEC`` is the command line; ``docs/SWEEP.md``
has the whole story.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .engine import Sweep, SweepError, SweepResult, make_storage
from .optstate import fused_param_names, load_model_slice
from .spec import SpecError, SweepSpec, default_optimizer, load_spec
from .training import SweepData, epoch_order, train_alone

__all__ = [
    "SpecError", "Sweep", "SweepData", "SweepError", "SweepResult", "SweepSpec",
    "default_optimizer", "epoch_order", "fused_param_names", "load_model_slice",
    "load_spec", "make_storage", "run", "train_alone",
]


def run(
    spec: SweepSpec | str | Path | Any,
    *,
    n_trials: int | None = None,
    per_array: int | None = None,
    epochs: int | None = None,
    out: str | Path | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    resume: bool = False,
    sampler: Any = None,
    pruner: Any = None,
    seed: int | None = None,
    heartbeat_interval: int = 30,
    grace_period: int | None = None,
    progress: bool | None = None,
    log=None,
) -> SweepResult:
    """Run one sweep worker to the end (see :class:`Sweep`); arguments given here
    override the spec's. Returns a :class:`SweepResult` (study, files, leaderboard)."""
    spec = load_spec(spec).replace(n_trials=n_trials, per_array=per_array, epochs=epochs,
                                   sampler=sampler, pruner=pruner, seed=seed)
    return Sweep(spec, out=out, storage=storage, study_name=study_name, resume=resume,
                 heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                 progress=progress, log=log).run()
