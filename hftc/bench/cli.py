"""``hftc bench`` (the arguments are declared in ``hftc/__main__.py``)."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from ..errors import CommandLineError, MissingExtraError
from .contenders import CONTENDERS
from .report import docs_block as report_block
from .report import markdown, plot, plot_stem, result_block, update_docs
from .suite import RESULTS_DIR, default_config, run_suite, write_results
from .workloads import WORKLOADS


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def config_from_args(args: argparse.Namespace):
    device = args.device
    if device != "cpu":
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise CommandLineError(f"hftc bench: --device {device}: no such device here "
                             f"(torch.cuda.is_available() is {torch.cuda.is_available()})")
    cfg = default_config(quick=args.quick, device=device)
    cfg.precision = args.precision
    if args.workloads:
        names = args.workloads.split(",")
        unknown = [w for w in names if w not in WORKLOADS]
        if unknown:
            raise CommandLineError(f"hftc bench: unknown workloads {unknown}; "
                             f"choose from {list(WORKLOADS)}")
        cfg.workloads = names
        cfg.max_n = [s for s in cfg.max_n if s["workload"] in names]
        for w in names:
            on = WORKLOADS[w].on(device)
            cfg.sizes.setdefault(w, list(on.quick_sizes if args.quick else on.sizes))
            cfg.rounds.setdefault(w, 3 if args.quick else on.rounds)
        cfg.name = "custom"
    if args.sizes is not None:
        cfg.sizes = {w: _ints(args.sizes) for w in cfg.workloads}
        cfg.name = "custom"
    if args.contenders:
        names = args.contenders.split(",")
        unknown = [c for c in names if c not in CONTENDERS]
        if unknown:
            raise CommandLineError(f"hftc bench: unknown contenders {unknown}; "
                                   f"choose from {CONTENDERS}")
        cfg.contenders = names
    if args.rounds:
        cfg.rounds = {w: args.rounds for w in cfg.workloads}
    if args.compile_sizes is not None:
        cfg.compile_sizes = {w: _ints(args.compile_sizes) for w in cfg.workloads}
    # The CPU's cap is 1 GiB above a bare process; a GPU's, its whole memory (0).
    cap = args.mem_cap if args.mem_cap is not None else (1024 if device == "cpu" else 0)
    if args.max_n is not None:
        cfg.max_n = []
        for item in filter(None, args.max_n.split(",")):
            workload, _, contender = item.partition(":")
            contender = contender or "hftc"
            if workload not in WORKLOADS or contender not in CONTENDERS:
                raise CommandLineError(f"hftc bench: --max-n {item}: choose a workload from "
                                 f"{list(WORKLOADS)} and a contender from {list(CONTENDERS)}")
            cfg.max_n.append({"workload": workload, "contender": contender, "cap_mib": cap})
    else:
        for search in cfg.max_n:
            search["cap_mib"] = cap
    cfg.max_n_budget_s = args.max_n_budget
    # On the CPU every contender gets one pinned core; a GPU's contenders are not pinned
    # (the concurrent contender's N processes each feed the GPU from a core of their own).
    cfg.cores = args.cores if args.cores is not None else (1 if device == "cpu" else 0)
    cfg.threads = args.threads if args.threads else max(1, cfg.cores)
    cfg.adam = args.adam
    if docs_block(cfg):
        cfg.name += f"-{docs_block(cfg)}"
    return cfg


def docs_block(cfg, gpu_name: str | None = None) -> str:
    """The BENCHMARKS.md block (and plot-file infix) of a run (``report.docs_block``): "" for
    the CPU fp32 default Adam suite on one pinned core, else e.g. "cuda", "cuda-h200-bf16",
    "adam-fused", "cores-2"."""
    return report_block(asdict(cfg), gpu_name)


#: ``--workloads sweep``: the whole-sweep bench of the demo's spec (``--sweep``'s default)
SWEEP_WORKLOAD = "sweep"


def _sweep_workload(args: argparse.Namespace) -> None:
    """``--workloads sweep`` is ``--sweep`` (the demo's spec): a whole sweep both ways
    as processes, which times no training step and so runs apart from the suite."""
    names = [w for w in (args.workloads or "").split(",") if w]
    if SWEEP_WORKLOAD not in names:
        return
    if len(names) > 1 or getattr(args, "sweep", None):
        raise CommandLineError(f"hftc bench: --workloads {args.workloads}: the sweep workload runs "
                         f"alone (whole sweeps as processes, not training steps); run it as "
                         f"--workloads sweep or --sweep SPEC, and the others apart")
    args.sweep = "hftc.sweep.digits"


def _check_out(out: Path) -> None:
    """``--out`` is the results JSON: a folder there, or a folder for it that cannot be
    made, is refused before the run, not found after its minutes."""
    if out.is_dir():
        raise CommandLineError(f"hftc bench: --out {out} is a folder; --out names the "
                               f"results JSON file (e.g. --out {out / 'results.json'})")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandLineError(f"hftc bench: cannot create the output folder {out.parent}: "
                               f"{exc.strerror}") from None


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``'s, a part's time limit in scripts/gpu_bench.sh) ends the run as
    Ctrl-C does: the suite's clean-up runs (its workers closed, the MPS daemon it started
    told to quit), where the default handler left that daemon serving the GPU under the
    next part's own."""
    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


def _seeds(text: str | None) -> list[int] | None:
    """``--seeds 0,1,2`` as ints (None when not given)."""
    if text is None:
        return None
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"hftc bench --seeds {text}: give integers separated by commas, "
                         f"e.g. --seeds 0,1,2") from None
    if not seeds:
        raise SystemExit("hftc bench --seeds: give at least one seed, e.g. --seeds 0,1,2")
    return seeds


def run(args: argparse.Namespace) -> int:
    exit_on_sigterm()
    _sweep_workload(args)
    if args.out:
        _check_out(Path(args.out))
    if getattr(args, "sweep", None):
        from .sweep import format_sweep_bench, run_sweep_bench

        seeds = _seeds(getattr(args, "seeds", None))
        result = run_sweep_bench(args.sweep, rounds=args.rounds or (len(seeds) if seeds else 3),
                                 threads=args.threads or 1,
                                 same_trials=getattr(args, "same_trials", None), seeds=seeds)
        print("\n" + format_sweep_bench(result))
        if args.out:
            write_results(Path(args.out), result)
            print(f"results: {args.out}")
        return 0
    cfg = config_from_args(args)
    out = Path(args.out) if args.out else RESULTS_DIR / f"{cfg.name}.json"
    # Every output place is made (or refused) before the run, not after minutes of it.
    if args.docs and not Path(args.docs).is_file():
        raise CommandLineError(f"hftc bench: --docs {args.docs}: no such file (it updates the "
                         f"tables between the bench markers of an existing markdown file)")
    if args.plots:  # refused now, not after the minutes of the run
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError as exc:
            raise MissingExtraError(f"hftc bench --plots needs matplotlib ({exc.name} is not "
                                    f"installed): pip install 'hftc[plots]'",
                                    extra="plots") from exc
    for folder in (out.parent, *([Path(args.plots)] if args.plots else [])):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommandLineError(f"hftc bench: cannot create the output folder {folder}: "
                             f"{exc.strerror}") from None
    result = run_suite(cfg, out=out)
    text = markdown(result)
    print("\n" + text)
    print(f"results: {out}")
    # A GPU run (each card its own), a bf16 run, a run with every Adam fused: each its own
    # block and plots.
    block = result_block(result)
    if args.docs:  # first: where the tables cannot go in, no plot is replaced either
        update_docs(Path(args.docs), text, block)
        print(f"updated {args.docs}")
    if args.plots:
        for path in plot(result, Path(args.plots), plot_stem(block)):
            print(f"wrote {path}")
    sys.stdout.flush()
    return 0
