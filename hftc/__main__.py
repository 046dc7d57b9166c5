"""``python -m hftc``: inspect a fusion, run the demo, run benchmarks."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .cli_args import int_list, non_negative_int, positive_int
from .errors import FusionError


def _load_factory(spec: str):
    """``package.module:factory`` or ``path/to/file.py:factory`` -> the factory callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise SystemExit(f"hftc: expected MODULE:FACTORY (e.g. mymodels:make_cnn), got {spec!r}")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.exists():
            raise SystemExit(f"hftc: no such file {path}")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loaded)
        sys.modules[path.stem] = module
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise SystemExit(f"hftc: cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise SystemExit(f"hftc: {module_name} has no attribute {attr!r}") from exc


def graph_to_dot(fused, title: str = "fused") -> str:
    """The fused graph as Graphviz DOT: one box per op, labelled with the rule that made it."""
    program = fused.last_program()
    lines = [f'digraph "{title}" {{', "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
    colors = {"loop": "mistyrose", "shared": "lightgrey"}
    for node in program.graph.nodes:
        if node.op == "get_attr":
            continue
        rule = node.meta.get("hftc_rule", node.op)
        origin = node.meta.get("hftc_origin", [])
        label = f"{node.name}\\n{getattr(node.target, '__name__', node.target)}\\n[{rule}]"
        if origin:
            label += f"\\n<- {origin[0]} x{len(origin)}"
        color = colors.get(rule, "lightblue" if rule not in ("placeholder", "output") else "white")
        lines.append(f'  "{node.name}" [label="{label}", style=filled, fillcolor={color}];')
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                lines.append(f'  "{arg.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    import hftc

    factory = _load_factory(args.factory)
    models = [factory() for _ in range(args.n)]
    shape = tuple(int(s) for s in args.input_shape.split(","))
    fused = hftc.fuse(models)
    fused.compile(torch.randn(*shape))
    program = fused.last_program()
    if args.format == "text":
        text = f"{program.report}\n\nfused graph (generated forward):\n{program.source}"
        if args.output:
            Path(args.output).write_text(text)
        else:
            print(text)
        return 0
    dot = graph_to_dot(fused, args.factory)
    if args.format == "dot":
        if args.output:
            Path(args.output).write_text(dot)
        else:
            print(dot)
        return 0
    if shutil.which("dot") is None:
        print("hftc: --format svg needs Graphviz's `dot` program, which is not installed "
              "(Debian: apt-get install graphviz). Use --format dot to write the DOT text.",
              file=sys.stderr)
        return 2
    if not args.output:
        print("hftc: --format svg needs -o FILE", file=sys.stderr)
        return 2
    subprocess.run(["dot", "-Tsvg", "-o", args.output], input=dot.encode(), check=True)
    print(f"wrote {args.output}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .speed import run_demo

    run_demo(args.n)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.cli import run

    return run(args)


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep.cli import main as sweep_main

    return sweep_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hftc", description="hftc: fuse N PyTorch models into one module."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="fuse N models from a factory; print the fusion report "
                                       "and the fused graph")
    p.add_argument("factory", help="MODULE:FACTORY or path/to/file.py:FACTORY (called N times)")
    p.add_argument("-n", type=positive_int, default=3, help="number of models (default 3)")
    p.add_argument("--input-shape", type=int_list, required=True,
                   help="e.g. 8,3,32,32 (a shared input)")
    p.add_argument("--format", choices=["text", "dot", "svg"], default="text")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("demo", help="measure a fused training step against a serial loop")
    p.add_argument("-n", type=positive_int, default=16, help="number of models (default 16)")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="training-step throughput of hftc against serial, "
                                     "concurrent, torch.func and hand-fused baselines")
    p.add_argument("--quick", action="store_true", help="the < 3 min suite (MLP, LeNet-5)")
    p.add_argument("--workloads", default="", help="comma-separated (default: the suite's)")
    p.add_argument("--sizes", type=int_list, default="",
                   help="values of N for every workload, e.g. 1,4,16")
    p.add_argument("--contenders", default="", help="comma-separated (default: all)")
    p.add_argument("--rounds", type=non_negative_int, default=0,
                   help="timed rounds (default: per workload)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda (cuda:K): every contender on that GPU (full-size "
                        "workloads, concurrent also under MPS where its daemon starts)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: forward and loss under torch.autocast(bfloat16) (AMP)")
    p.add_argument("--cores", type=non_negative_int, default=None,
                   help="confine every contender to this many CPUs (default: 1 for --device "
                        "cpu, 0 for a GPU; 0: no pinning)")
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="intra-op threads per process (default: --cores, at least 1)")
    p.add_argument("--adam", choices=["default", "fused"], default="default",
                   help="Adam as constructed by default, or fused=True for stock and hftc")
    p.add_argument("--compile-sizes", default=None,
                   help="values of N that also run hftc+compile ('' for none)")
    p.add_argument("--max-n", default=None, metavar="WORKLOAD:CONTENDER[,...]",
                   help="search the largest N that fits the memory cap ('' for none)")
    p.add_argument("--mem-cap", type=float, default=None,
                   help="MiB, for --max-n (default 1024 on the CPU, the whole GPU on a GPU)")
    p.add_argument("--out", default="", help="results JSON (default benchmarks/results/NAME.json)")
    p.add_argument("--docs", default="", help="also update this markdown file's tables")
    p.add_argument("--plots", default="", help="also write PNG plots into this folder")
    p.set_defaults(fn=cmd_bench)
    from .sweep.cli import add_arguments as add_sweep_arguments

    p = sub.add_parser("sweep", help="a fused hyper-parameter sweep with Optuna (make demo: "
                                     "--demo)")
    add_sweep_arguments(p)
    p.set_defaults(fn=cmd_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except FusionError as exc:
        print(f"hftc: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
