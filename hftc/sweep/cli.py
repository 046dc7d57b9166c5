"""``python -m hftc sweep``: the command line of :mod:`hftc.sweep`.

    python -m hftc sweep spec.py                  # SQLite in ./sweeps/<name>/
    python -m hftc sweep spec.py --resume         # after a crash or Ctrl-C
    python -m hftc sweep spec.py --storage postgresql://u:p@db/hftc --study lr   # every machine
    python -m hftc sweep spec.py --ray --workers 4  # 4 Ray actors, one device each
    python -m hftc sweep spec.py --ray auto --workers 8 --storage postgresql://...
    hftc demo                                     # make demo (also: sweep --demo)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from ..cli.args import positive_int
from ..errors import MissingExtraError, SweepWarning
from . import SWEEP_EXTRA, missing_sweep_extra

__all__ = ["add_arguments", "add_demo_arguments", "main"]


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``hftc demo`` shares with ``hftc sweep``."""
    p.add_argument("--trials", type=positive_int,
                   help="number of trials in the study (default: spec's n_trials, else 32; "
                        "the demo: 48)")
    p.add_argument("-n", "--per-array", type=positive_int,
                   help="trials trained at once per fused array (default: spec's per_array, "
                        "else 16)")
    p.add_argument("--epochs", type=positive_int, help="epochs per trial (default: spec's "
                                                       "epochs)")
    p.add_argument("--out", help="folder for results, checkpoints and the default SQLite "
                                 "storage (default: sweeps/<study>; the demo: "
                                 "sweeps/demo-digits)")
    p.add_argument("--threads", type=positive_int,
                   help="torch intra-op threads (default: torch's; the demo: 1)")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="progress bars even when stderr is not a terminal")
    progress.add_argument("--no-progress", dest="progress", action="store_false",
                          help="no progress bars")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``sweep`` subcommand's options (options override the spec's values)."""
    p.add_argument("spec", nargs="?",
                   help="the sweep spec: path/to/spec.py or a module path (pkg.sweeps.digits) "
                        "defining space(trial), model(params), data() (see docs/SWEEP.md)")
    p.add_argument("--demo", action="store_true",
                   help="run the demo sweep instead of SPEC (the same as `hftc demo`)")
    add_demo_arguments(p)
    p.add_argument("--storage", help="Optuna RDB URL: sqlite:///file.db (default: OUT/study.db) "
                                     "or postgresql://user:pass@host/db to share a study "
                                     "between machines")
    p.add_argument("--study", help="study name (default: the spec's name or file name)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted sweep in OUT from its checkpoints")
    p.add_argument("--sampler", help="tpe (default) or random")
    p.add_argument("--pruner", help="median (default), sha, hyperband or none")
    p.add_argument("--seed", type=int, help="base seed (trial seeds, data order, sampler)")
    p.add_argument("--heartbeat-interval", type=int, default=30,
                   help="seconds between heartbeats of this worker's trials (default 30)")
    p.add_argument("--grace-period", type=int,
                   help="seconds without a heartbeat before a trial is failed and retried by "
                        "another worker (default: 4 heartbeats)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run --workers Ray actors on the cluster at ADDRESS (auto, "
                        "host:6379, ray://host:10001; none: a running cluster, else a local "
                        "Ray; it says which and how long it took), each holding one GPU where "
                        "there are GPUs; needs pip install 'hftc[ray]' (see "
                        "docs/guides/ray.md)")
    p.add_argument("--workers", type=positive_int,
                   help="with --ray: the number of sweep actors (default 2)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a line per started, pruned and finished trial")
    p.add_argument("--serial", action="store_true",
                   help="instead of fusing: the same study one trial at a time with stock "
                        "Optuna (study.optimize, a stock model each; OUT/serial.db), what "
                        "the fused sweep is compared with")
    p.add_argument("--no-estimate", dest="estimate", action="store_false",
                   help="no speedup estimate in the summary: skip the epochs trained alone "
                        "and the sample of trials through stock Optuna it is made from "
                        "(under a second on a small model)")


def main(args: argparse.Namespace) -> int:
    """Run the ``sweep`` subcommand; returns the exit status."""
    from .clock import command_process

    try:
        with command_process(), _sweep_warnings_said():  # (the process's start-up counts)
            return _main(args)
    except ModuleNotFoundError as exc:  # a plain `pip install hftc`: no Optuna
        if (exc.name or "").split(".")[0] not in SWEEP_EXTRA:
            raise
        print(f"hftc sweep: {missing_sweep_extra(exc)}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _sweep_warnings_said() -> Iterator[None]:
    """A SweepWarning printed as ``hftc sweep: warning: ...``: Python's format put hftc's
    own file and line first, and the line of code that warned after it (``cli.py:158:
    SweepWarning: ...`` then ``result = run(args.spec, ...``), which say nothing to the
    user. Other warnings (torch's, the spec's) keep their place."""
    previous = warnings.formatwarning

    def said(message, category, filename, lineno, line=None):
        if issubclass(category, SweepWarning):
            return f"hftc sweep: warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    warnings.formatwarning = said
    try:
        yield
    finally:
        warnings.formatwarning = previous


def _main(args: argparse.Namespace) -> int:
    import torch

    from .collector import freeze_at_exit
    from .engine import SweepError
    from .spec import SpecError

    if args.threads:
        torch.set_num_threads(args.threads)
    # `hftc demo` shares this function and has neither option.
    ray_address, workers = getattr(args, "ray", None), getattr(args, "workers", None)
    if workers is not None and ray_address is None:
        print("hftc sweep: --workers is the number of Ray actors: give --ray [ADDRESS] too",
              file=sys.stderr)
        return 2
    try:
        if args.demo:
            if args.spec or ray_address is not None:
                print("hftc sweep: --demo runs its own spec on this machine; leave out SPEC "
                      "and --ray", file=sys.stderr)
                return 2
            if not getattr(args, "estimate", True):
                print("hftc sweep: --demo measures its speedup (that is the demo); leave out "
                      "--no-estimate", file=sys.stderr)
                return 2
            from .demo import run_demo

            run_demo(args.out or "sweeps/demo-digits", n_trials=args.trials,
                     per_array=args.per_array, epochs=args.epochs,
                     threads=args.threads or 1, progress=args.progress)
            freeze_at_exit()
            return 0
        if not args.spec:
            print("hftc sweep: give a SPEC (path/to/spec.py or a module path), or --demo",
                  file=sys.stderr)
            return 2
        from . import run

        log = (lambda msg: print(msg, flush=True)) if args.verbose else None
        if getattr(args, "serial", False):
            if ray_address is not None or args.storage or args.resume:
                print("hftc sweep: --serial runs stock Optuna one trial at a time in this "
                      "process, on OUT/serial.db made afresh; leave out --ray, --storage "
                      "and --resume", file=sys.stderr)
                return 2
            run = _serial_run
        if ray_address is not None:
            from ..integrations import ray as hftc_ray

            # Ray reached first, saying how and how long (a running cluster is reused);
            # the sweep's summary says it again, from the same RayStart
            reached = hftc_ray.connect(ray_address or None, log_to_driver=log is not None)
            print(reached, flush=True)
            run = lambda spec, **kw: hftc_ray.sweep(  # noqa: E731
                spec, address=ray_address or None, workers=workers or 2, reached=reached,
                **{k: v for k, v in kw.items() if k not in ("progress", "estimate")})
        result = run(args.spec, n_trials=args.trials, per_array=args.per_array,
                     epochs=args.epochs, out=args.out, storage=args.storage,
                     study_name=args.study, resume=args.resume, sampler=args.sampler,
                     pruner=args.pruner, seed=args.seed,
                     heartbeat_interval=args.heartbeat_interval,
                     grace_period=args.grace_period, progress=args.progress, log=log,
                     estimate=args.estimate)
    except (SpecError, SweepError, MissingExtraError) as exc:
        print(f"hftc sweep: {exc}", file=sys.stderr)
        return 2
    except _out_of_memory() as exc:  # the arrays' size: the trials wait for --resume
        notes = [n for n in getattr(exc, "__notes__", []) if n.startswith("hftc sweep:")]
        print(f"hftc sweep: {type(exc).__name__}: {exc}" + "".join(f"\n{n}" for n in notes),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"hftc sweep: interrupted; {_after_interrupt(args, exc)}", file=sys.stderr)
        return 130
    if result.trial_epochs == 0:
        print(f"nothing to train: study {result.study.study_name!r} already has its trials "
              f"(raise --trials to run more); results written again\n")
    print(result.leaderboard)
    best = result.best_trial
    if best is not None:
        print(f"\nbest: trial {best.number}, {result.metric} {best.value:.6g} "
              f"({', '.join(f'{k}={v!r}' for k, v in best.params.items())})")
    print(result.summary)  # a Ray sweep's says how Ray was reached, its actors and nodes
    print("files: " + ", ".join(str(p) for p in result.files.values()))
    freeze_at_exit()
    return 0



def _out_of_memory() -> type[BaseException]:
    """torch.OutOfMemoryError (torch imported only once an error is on its way)."""
    import torch

    return torch.OutOfMemoryError


def _after_interrupt(args: Any, exc: KeyboardInterrupt) -> str:
    """What to run after Ctrl-C: --resume only where it continues something (--serial
    refuses it; before the study is made there is no sweep to resume)."""
    if getattr(args, "serial", False):
        return ("--serial keeps no checkpoints: rerun the same command to run its study "
                "again from the start")
    if getattr(exc, "hftc_resumable", True) is False:
        return ("it stopped before it made its study, so there is nothing to resume: rerun "
                "the same command, without --resume")
    return "rerun the same command with --resume to continue"


def _serial_run(spec: Any, *, n_trials=None, epochs=None, out=None, study_name=None,
                sampler=None, pruner=None, seed=None, log=None, **_fused_only: Any) -> Any:
    """``hftc sweep SPEC --serial``: :func:`hftc.sweep.run`'s arguments, the study run one
    trial at a time with stock Optuna in ``OUT/serial.db`` (no fusing), with the sweep's
    files and summary."""
    from pathlib import Path

    from .small import run_one_by_one
    from .spec import load_spec

    spec = load_spec(spec).replace(n_trials=n_trials, epochs=epochs, sampler=sampler,
                                   pruner=pruner, seed=seed)
    folder = Path(out) if out is not None else Path("sweeps") / (study_name or spec.name)
    return run_one_by_one(spec, folder, log=log, why="--serial")
