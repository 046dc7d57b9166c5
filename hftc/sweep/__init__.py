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

import importlib
from pathlib import Path
from typing import Any

from ..errors import MissingExtraError

_LAZY = {
    "Sweep": "engine", "SweepError": "engine", "SweepFileError": "engine",
    "SweepResult": "engine", "make_storage": "storage",
    "fused_param_names": ".optim.slicing", "load_model_slice": ".optim.slicing",
    "SpecError": "spec", "SweepSpec": "spec", "default_optimizer": "spec", "load_spec": "spec",
    "SweepData": "training", "epoch_order": "training", "train_alone": "training",
    "TrialArray": "trial_array", "optimize": "trial_array",
}

__all__ = [*sorted(_LAZY), "run"]


#: The top-level packages of ``pip install 'hftc[sweep]'`` (pyproject.toml's sweep extra).
SWEEP_EXTRA = ("optuna", "sklearn", "matplotlib", "tqdm", "psycopg")


def missing_sweep_extra(exc: ModuleNotFoundError) -> MissingExtraError:
    """The :class:`MissingExtraError` for a package of the sweep extra not installed."""
    missing = exc.name.split(".")[0]
    error = MissingExtraError(f"hftc.sweep needs {missing!r} ({missing} is not installed): "
                              f"pip install 'hftc[sweep]'", extra="sweep")
    error.name = exc.name
    return error


def __getattr__(name: str) -> Any:
    # Lazy: `python -m hftc --help` and `import hftc` must not need Optuna (an extra).
    if name not in _LAZY:
        raise AttributeError(f"module 'hftc.sweep' has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
    except ModuleNotFoundError as exc:  # hftc's MissingExtraError, still a ModuleNotFoundError
        raise missing_sweep_extra(exc) from exc
    return getattr(module, name)


def _too_small(spec: Any) -> str | None:
    from .serial import too_small

    return too_small(spec)


def run(
    spec: Any,
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
    estimate: bool = True,
) -> Any:
    """Run one sweep worker to the end (see :class:`Sweep`); arguments given here
    override the spec's. ``spec`` is a :class:`SweepSpec`, a spec file or module (see
    :func:`load_spec`). Returns a :class:`SweepResult` (study, files, leaderboard).

    ``estimate=False`` (``hftc sweep --no-estimate``) leaves out what the summary's
    speedup is estimated from: a few epochs trained alone and, after the sweep, a sample
    of its trials through a stock Optuna study (under a second on a small model, which
    a whole-process timing such as ``hftc bench --sweep`` would count)."""
    from .engine import Sweep
    from .spec import load_spec

    spec = load_spec(spec).replace(n_trials=n_trials, per_array=per_array, epochs=epochs,
                                   sampler=sampler, pruner=pruner, seed=seed)
    small = _too_small(spec) if storage is None else None
    folder = Path(out) if out is not None else Path("sweeps") / (study_name or spec.name)
    if small is not None and ((folder / "study.db").exists()
                              or resume and not (folder / "serial.db").exists()):
        # a fused sweep's study there (its trials, enqueued ones, its result files: the
        # one-at-a-time study, made afresh, would ignore them and write over its files), to
        # continue or resume; or none at all to resume: the engine says so
        small = None
    if small is not None:
        # Said before it starts; then run as without hftc, which loses nothing.
        import warnings

        from ..errors import SweepWarning
        from .small import run_one_by_one

        message = (f"this sweep is too small to gain from fusing ({small}): its trials run "
                   f"one at a time with stock Optuna")
        if resume:  # one at a time keeps no checkpoints: --resume runs it again
            message += (f" (--resume: a sweep run one at a time has no checkpoints; its "
                        f"study in {folder / 'serial.db'} is run again from the start, to the "
                        f"same trials and results)")
        warnings.warn(message, SweepWarning, stacklevel=2)
        if log is not None:
            log(message)
        return run_one_by_one(spec, folder)
    return Sweep(spec, out=out, storage=storage, study_name=study_name, resume=resume,
                 heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                 progress=progress, log=log, estimate_serial=3 if estimate else 0,
                 compare_serial=estimate, n_trials_given=n_trials is not None).run()
