"""``python -m hftc bench`` (the arguments are declared in ``hftc/__main__.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .contenders import CONTENDERS
from .report import markdown, plot, update_docs
from .suite import RESULTS_DIR, default_config, run_suite
from .workloads import WORKLOADS


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def config_from_args(args: argparse.Namespace):
    cfg = default_config(quick=args.quick)
    if args.workloads:
        names = args.workloads.split(",")
        unknown = [w for w in names if w not in WORKLOADS]
        if unknown:
            raise SystemExit(f"hftc bench: unknown workloads {unknown}; "
                             f"choose from {list(WORKLOADS)}")
        cfg.workloads = names
        for w in names:
            cfg.sizes.setdefault(w, list(WORKLOADS[w].quick_sizes if args.quick
                                         else WORKLOADS[w].sizes))
            cfg.rounds.setdefault(w, 3 if args.quick else WORKLOADS[w].rounds)
        cfg.name = "custom"
    if args.sizes:
        cfg.sizes = {w: _ints(args.sizes) for w in cfg.workloads}
        cfg.name = "custom"
    if args.contenders:
        names = args.contenders.split(",")
        unknown = [c for c in names if c not in CONTENDERS]
        if unknown:
            raise SystemExit(f"hftc bench: unknown contenders {unknown}; choose from {CONTENDERS}")
        cfg.contenders = names
    if args.rounds:
        cfg.rounds = {w: args.rounds for w in cfg.workloads}
    if args.compile_sizes is not None:
        cfg.compile_sizes = {w: _ints(args.compile_sizes) for w in cfg.workloads}
    if args.max_n is not None:
        cfg.max_n = []
        for item in filter(None, args.max_n.split(",")):
            workload, _, contender = item.partition(":")
            cfg.max_n.append({"workload": workload, "contender": contender or "hftc",
                              "cap_mib": args.mem_cap})
    else:
        for search in cfg.max_n:
            search["cap_mib"] = args.mem_cap
    cfg.cores = args.cores
    cfg.threads = args.threads if args.threads else max(1, args.cores)
    cfg.adam = args.adam
    if args.adam != "default":
        cfg.name += f"-adam-{args.adam}"
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    out = Path(args.out) if args.out else RESULTS_DIR / f"{cfg.name}.json"
    result = run_suite(cfg, out=out)
    text = markdown(result)
    print("\n" + text)
    print(f"results: {out}")
    # A run with every Adam fused goes into its own block and plot files.
    block = "" if cfg.adam == "default" else f"adam-{cfg.adam}"
    if args.plots:
        for path in plot(result, Path(args.plots), "bench" if not block else f"bench_{block}"):
            print(f"wrote {path}")
    if args.docs:
        update_docs(Path(args.docs), text, block)
        print(f"updated {args.docs}")
    sys.stdout.flush()
    return 0
