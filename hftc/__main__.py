"""``hftc`` (or ``python -m hftc``): inspect a fusion, run the demo, run benchmarks, sweep.

The parsers import nothing heavy (``hftc/__init__.py`` loads no torch until something
imports it), so ``hftc --help`` and every subcommand's ``--help`` answer in a fraction of a
second; torch and hftc's core are imported inside the command handlers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .bench import names as bench_names
from .cli.args import InputSpec, input_spec, int_list, non_negative_int, positive_int
from .cli.load import import_user_module, make_models, run_user_code
from .errors import CommandLineError, FusionError, MismatchError, MissingExtraError


def _load_factory(spec: str):
    """``package.module:factory`` or ``path/to/file.py:factory`` -> the factory callable; a
    spec that does not load is a CommandLineError (exit 2) naming the user's line."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise CommandLineError(
            f"hftc: expected MODULE:FACTORY (e.g. mymodels:make_cnn), got {spec!r}")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise CommandLineError(f"hftc: no such file {path} (FACTORY is "
                                   f"path/to/file.py:FACTORY or MODULE:FACTORY)")
        # A name of its own: under its stem, a models file named copy.py or types.py
        # replaced that module for torch and hftc (the fused program's check failed)
        name = f"_hftc_factory_{path.stem}"
        loaded = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loaded)
        sys.modules[name] = module
        if str(path.resolve().parent) not in sys.path:  # its neighbours, as for a script
            sys.path.insert(0, str(path.resolve().parent))
        run_user_code(lambda: loaded.loader.exec_module(module), f"hftc: {path}",
                      CommandLineError)
    else:
        sys.path.insert(0, str(Path.cwd()))
        module = import_user_module(module_name, f"hftc: {module_name}",
                                    f"hftc: cannot import {module_name!r}", CommandLineError)
    try:
        factory = getattr(module, attr)
    except AttributeError as exc:
        raise CommandLineError(f"hftc: {module_name} has no attribute {attr!r}") from exc
    if not callable(factory):
        raise CommandLineError(f"hftc: {spec} is {factory!r} ({type(factory).__name__}), "
                               f"not a factory (a function or class called with no "
                               f"arguments that returns one model)")
    return factory


def _write_output(path: str, text: str) -> None:
    """``-o FILE``: one that cannot be written is a CommandLineError (exit 2), not a
    traceback after the fusion's work."""
    try:
        Path(path).write_text(text + "\n")  # as print writes it to stdout: a last newline
    except OSError as exc:
        raise CommandLineError(f"hftc inspect: cannot write -o {path}: "
                               f"{exc.strerror or exc}") from exc


def _example_input(spec: InputSpec, models) -> object:
    """A random tensor for ``spec``; integer values in [0, HIGH), HIGH by default the
    smallest ``num_embeddings`` of the models' embeddings (else 2), so token ids are valid
    for every model (with --pad-widths their vocabularies may differ)."""
    import torch

    dtype = getattr(torch, spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, spec.shape).bool()
    high = spec.high or min((m.num_embeddings for model in models for m in model.modules()
                             if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))),
                            default=2)
    return torch.randint(0, high, spec.shape, dtype=dtype)


def _spec_text(spec: InputSpec) -> str:
    """``--input``'s text for ``spec`` (``long:8,16``), as the user could have typed it."""
    shape = ",".join(map(str, spec.shape))
    return (f"{spec.dtype}:{shape}" if spec.dtype != "float32" else shape) + (
        f":{spec.high}" if spec.high else "")


def _settle_strategy(fused, inputs, most_calls: int = 200) -> None:
    """Call the fused module until a strategy timed on the first calls has chosen, so that
    the report says what runs (not "alternates ..." while it times)."""
    from .lowering.strategy import TIMING_CALLS

    for _ in range(most_calls):
        plan = fused.last_program().plan
        if getattr(plan, "reason", None) != TIMING_CALLS:
            return
        fused(*inputs)


def cmd_inspect(args: argparse.Namespace) -> int:
    import hftc

    from .cli.graph import graph_to_dot
    from .cli.report import inspect_text

    specs = list(args.input or [])
    if args.input_shape:
        specs.insert(0, input_spec(args.input_shape))
    if not specs:
        print("hftc inspect: give the model's inputs: --input [DTYPE:]SHAPE, once per input "
              "(e.g. --input long:8,16 --input float:8,16)", file=sys.stderr)
        return 2
    if args.format in ("svg", "png"):  # refused before the fusion's work, not after it
        if shutil.which("dot") is None:
            print(f"hftc: --format {args.format} needs Graphviz's `dot` program, which is not "
                  f"installed (Debian: apt-get install graphviz). Use --format dot to write "
                  f"the DOT text.", file=sys.stderr)
            return 2
        if not args.output:
            print(f"hftc: --format {args.format} needs -o FILE", file=sys.stderr)
            return 2
    import torch

    # seeded: the same command draws the same models and example inputs, so it prints the
    # same report (the check's largest difference too), as a seeded script would
    torch.manual_seed(0)
    factory = _load_factory(args.factory)
    models = make_models(factory, args.factory, args.n)
    inputs = [_example_input(spec, models) for spec in specs]
    try:  # example_inputs, as a script that has them: torch.export traces what fx cannot
        fused = hftc.fuse(models, example_inputs=tuple(inputs), autotune=args.autotune,
                          strategy=args.strategy, pad_widths=args.pad_widths)
    except MismatchError as exc:  # its advice is hftc.fuse's keyword: say the option
        if "pad_widths=True" in str(exc) and not args.pad_widths:
            exc.add_note("hftc inspect: --pad-widths fuses them so")
        raise
    except FusionError as exc:  # the inputs are the command line's: say which option
        exc.add_note(f"hftc inspect: the example inputs came from --input "
                     f"{' --input '.join(_spec_text(spec) for spec in specs)}: give the "
                     f"shapes (and dtypes) the model's forward takes")
        raise
    _settle_strategy(fused, inputs)
    if args.format == "text":
        text = inspect_text(fused, f"{args.factory}", code=args.code)
        if args.output:
            _write_output(args.output, text)
        else:
            print(text)
        return 0
    dot = graph_to_dot(fused, f"{args.factory} x{args.n}")
    if args.format == "dot":
        if args.output:
            _write_output(args.output, dot)
        else:
            print(dot)
        return 0
    drawn = subprocess.run(["dot", f"-T{args.format}", "-o", args.output],
                           input=dot.encode(), capture_output=True)
    if drawn.returncode:  # -o in a missing folder, say: dot's own words, not a traceback
        raise CommandLineError(f"hftc inspect: Graphviz's dot could not write -o "
                               f"{args.output}: {drawn.stderr.decode().strip()}")
    print(f"wrote {args.output}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The one demo: the fused Optuna sweep of ``make demo`` (``sweep --demo`` runs it too)."""
    from .sweep.cli import main as sweep_main

    args.demo, args.spec = True, None
    return sweep_main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.cli import run

    return run(args)


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep.cli import main as sweep_main

    return sweep_main(args)


def _bench_sweep_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", nargs="?", const="hftc.sweep.digits", default=None,
                   metavar="SPEC",
                   help="instead of the suite: a whole sweep of SPEC (default: the demo's) "
                        "both ways as whole processes, alternated --rounds times (default "
                        "3): hftc sweep vs stock Optuna one trial at a time")
    p.add_argument("--same-trials", nargs="?", const="random", default=None,
                   choices=("random", "fused", "serial"), metavar="SOURCE",
                   help="with --sweep: both sides train the same configurations, enqueued, "
                        "so the trial-epochs differ by the pruning only: 'random' (default) "
                        "n_trials drawn once from the spec's space with a seeded "
                        "RandomSampler; 'fused' / 'serial' the trials that side's own "
                        "sampler asked (it runs first in each round)")
    p.add_argument("--seeds", default=None, metavar="S0,S1,...",
                   help="with --sweep: round k runs both sides with the spec's seed set to "
                        "the k-th of these (cycled; --rounds defaults to their count): a "
                        "sweep's trial-epochs, and so its wall clock, vary with the seed "
                        "far more than between the sides")
    p.set_defaults(fn=cmd_bench)


def _listing(title: str, entries: dict[str, str]) -> str:
    width = max(map(len, entries))
    return f"{title}:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, text in entries.items())


def _add_inspect(sub) -> None:
    """``hftc inspect``'s parser."""
    p = sub.add_parser(
        "inspect", help="fuse N models from a factory; print what became of each op (or draw "
                        "the fused graph)", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fuse N models made by FACTORY, compile them for example inputs and "
                    "print each op of the model: what hftc did with it, its output's shape "
                    "[N, ...] (N: the model axis) and how the program runs (--code: the "
                    "generated forward too), or draw the fused graph.",
        epilog="examples:\n"
               "  hftc inspect tests/zoo.py:resnet_small --input 8,3,32,32\n"
               "  hftc inspect mymodels:make_gpt --input long:8,64            # token ids\n"
               "  hftc inspect mymodels:make_pair --input long:8,16 --input float:8,16\n"
               "  hftc inspect tests/zoo.py:resnet_small --input 8,3,32,32 --format png "
               "-o resnet.png")
    p.add_argument("factory", help="MODULE:FACTORY or path/to/file.py:FACTORY (called N times)")
    p.add_argument("-n", type=positive_int, default=3, help="number of models (default 3)")
    p.add_argument("--input", action="append", type=input_spec, metavar="[DTYPE:]SHAPE[:HIGH]",
                   help="one example input, in the order forward takes them (repeat for "
                        "several): e.g. 8,3,32,32 (float), long:8,16 (token ids in [0, the "
                        "smallest nn.Embedding's size)), long:8,16:1000 (ids in [0, 1000)); "
                        "DTYPE: float, double, half, bfloat16, long, int, bool")
    p.add_argument("--input-shape", type=int_list, metavar="SHAPE",
                   help="the same as --input SHAPE (one float input)")
    p.add_argument("--format", choices=["text", "dot", "svg", "png"], default="text",
                   help="text (default): each op of the model, what hftc did with it and its "
                        "output's shape [N, ...] (--code: the generated forward too); dot: "
                        "the fused graph as Graphviz DOT (shapes, chosen kernels, a legend); "
                        "svg, png: that graph drawn by Graphviz's `dot` (needs -o)")
    p.add_argument("--code", action="store_true",
                   help="with --format text: print the generated fused forward too")
    p.add_argument("--autotune", action="store_true",
                   help="time the kernels' lowerings and keep the fastest, as "
                        "hftc.fuse(..., autotune=True) (default: the cost model's choice)")
    p.add_argument("--strategy", choices=["auto", "fused", "model_loop", "timed"],
                   default=None,
                   help="as hftc.fuse(..., strategy=...): auto (default, or $HFTC_STRATEGY) "
                        "runs the fused program the check found exact; timed times it "
                        "against the models one by one and keeps the faster; the report's "
                        "'strategy:' line says which runs")
    p.add_argument("--pad-widths", action="store_true",
                   help="as hftc.fuse(..., pad_widths=True): models that differ only in "
                        "layer widths fuse, each zero-padded to the widest (exact); the "
                        "report's padding line says what it costs")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(fn=cmd_inspect)


def build_parser() -> argparse.ArgumentParser:
    """The command line; builds without importing torch (tests/test_cli.py checks)."""
    from .sweep.cli import add_arguments as add_sweep_arguments
    from .sweep.cli import add_demo_arguments

    parser = argparse.ArgumentParser(
        prog="hftc", description="hftc: fuse N PyTorch models into one module.",
        epilog="`hftc COMMAND --help` for a command's options; `python -m hftc` is the same.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_inspect(sub)
    p = sub.add_parser("demo", help="the demo (make demo): a fused Optuna sweep of a CNN on "
                                    "8x8 digits and its speedup over training trials one by one")
    add_demo_arguments(p)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser(
        "bench", help="training-step throughput of hftc against serial, concurrent, "
                      "torch.func and hand-fused baselines",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_listing("workloads", bench_names.WORKLOADS)
        + "\n  sweep              the demo's whole sweep, hftc sweep vs stock Optuna one "
          "trial at a time,\n                     as processes (alone; --sweep SPEC for "
          "another spec)\n\n"
        + _listing("contenders", bench_names.CONTENDERS)
        + "\n\nexample: hftc bench --workloads mlp --sizes 2 --contenders serial,hftc "
          "--rounds 1 --compile-sizes '' --max-n ''   (seconds)")
    p.add_argument("--quick", action="store_true",
                   help="the short suite (mlp and lenet5, a few sizes; minutes)")
    p.add_argument("--workloads", default="", help="comma-separated, from the list below "
                                                   "(default: the suite's)")
    p.add_argument("--sizes", type=int_list, default=None,
                   help="values of N for every workload, e.g. 1,4,16 ('' for none: only "
                        "the --max-n searches)")
    p.add_argument("--contenders", default="",
                   help="comma-separated, from the list below (default: all)")
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
    p.add_argument("--max-n-budget", type=float, default=None, metavar="SECONDS",
                   help="stop each largest-N search after this many seconds, keeping the "
                        "largest N seen to fit (default: no limit)")
    p.add_argument("--mem-cap", type=float, default=None,
                   help="MiB, for --max-n (default 1024 on the CPU, the whole GPU on a GPU)")
    p.add_argument("--out", default="",
                   help="results JSON (default: benchmarks/results/NAME.json in a source "
                        "checkout, else hftc-bench-results/NAME.json); its folder is created")
    p.add_argument("--docs", default="", help="also update this markdown file's tables")
    p.add_argument("--plots", default="",
                   help="also write PNG plots into this folder (created if missing)")
    _bench_sweep_option(p)  # and fn=cmd_bench
    p = sub.add_parser("sweep", help="a fused hyper-parameter sweep with Optuna over a spec "
                                     "file")
    add_sweep_arguments(p)
    p.set_defaults(fn=cmd_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CommandLineError as exc:  # a usage error: argparse's exit status
        print(exc, file=sys.stderr)
        return 2
    except MissingExtraError as exc:  # what to pip install; nothing ran
        print(f"hftc: {exc}", file=sys.stderr)
        return 2
    except FusionError as exc:
        notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", ()))
        print(f"hftc: {type(exc).__name__}: {exc}{notes}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `hftc inspect ... | head` closed the pipe: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no 2nd error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
