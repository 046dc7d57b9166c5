"""hftc's default training step against the serial loop on the model zoo's workloads, side by
side in one process, one thread, interleaved rounds.

    python benchmarks/zoo_pair.py [--workloads convnext,lstm_lm] [--n 4] [--rounds 11]
                                  [--strategy auto|fused|model_loop] [--autotune]
                                  [--without depthwise_wgrad_conv]

A step is what ``hftc bench`` times: zero_grad, forward, loss, backward, Adam step.  The
serial contender is N stock models with N stock Adams; hftc's is ``hftc.fuse(models)``
(no options unless given) + ``hftc.optim.Adam`` + ``hftc.per_model(loss)``.  Each round
times both (the order alternating) for at least ``--seconds`` each; the report is the
median serial/hftc ratio of the rounds with their 10th-90th percentile.  ``--without L``
adds a third contender, hftc with conv lowering ``L`` taken out of the cost model's
lists (the code before ``L`` existed), timed in the same rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import hftc
from hftc.bench.contenders import build_step, learning_rates, make_models
from hftc.bench.workloads import WORKLOADS
from hftc.lowering.runtime import conv as rt_conv


def hftc_step(name: str, n: int, **fuse_options):
    """hftc's step for ``n`` models of workload ``name`` (the models ``build_step`` makes)."""
    w = WORKLOADS[name]
    x, y = w.inputs()
    models = make_models(w, n)
    example = {"example_inputs": (x,)} if w.example_inputs else {}
    fused = hftc.fuse(models, **example, **fuse_options)
    opt = hftc.optim.Adam(fused.parameters(), lr=learning_rates(n))
    per_model_loss = hftc.per_model(w.loss_fn)

    def step():
        opt.zero_grad(set_to_none=True)
        out = fused(x)
        per_model_loss(out[0] if isinstance(out, tuple) else out, y).sum().backward()
        opt.step()

    return step, fused


@contextlib.contextmanager
def conv_lowering_removed(name: str):
    """``hftc.lowering.runtime.conv.conv`` without lowering ``name`` while inside."""
    lowerings = rt_conv.conv_lowerings

    def without(*args, **kwargs):
        return [n for n in lowerings(*args, **kwargs) if n != name]

    rt_conv.conv_lowerings = without
    try:
        yield
    finally:
        rt_conv.conv_lowerings = lowerings


def _without(step, name: str):
    def run():
        with conv_lowering_removed(name):
            step()
    return run


def _time(fn, seconds: float) -> float:
    start, reps = time.perf_counter(), 0
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / reps


def _summary(ratios: list[float]) -> tuple[float, float, float]:
    """Median and 10th-90th percentile of per-round ratios."""
    ratios = sorted(ratios)
    return (statistics.median(ratios), ratios[int(0.1 * (len(ratios) - 1))],
            ratios[int(round(0.9 * (len(ratios) - 1)))])


def compare(name: str, n: int, rounds: int, seconds: float, without: str | None = None,
            **fuse_options) -> dict:
    contenders = {"serial": build_step("serial", name, n).fn}
    contenders["hftc"], fused = hftc_step(name, n, **fuse_options)
    if without:
        with conv_lowering_removed(without):
            step, _ = hftc_step(name, n, **fuse_options)
        contenders["without"] = _without(step, without)
    for _ in range(2):  # build, choose, warm up
        for fn in contenders.values():
            fn()
    times: dict[str, list[float]] = {label: [] for label in contenders}
    ratios: dict[str, list[float]] = {label: [] for label in contenders if label != "serial"}
    order = list(contenders.items())
    for r in range(rounds):
        took = {}
        for label, fn in (order if r % 2 == 0 else order[::-1]):
            took[label] = _time(fn, seconds)
            times[label].append(took[label])
        for label in ratios:
            ratios[label].append(took["serial"] / took[label])
    row = {"workload": name, "n": n, "plan": str(getattr(fused, "plan", None))}
    for label in contenders:
        row[f"{label}_ms"] = 1e3 * statistics.median(times[label])
    for label, values in ratios.items():
        row[label] = _summary(values)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="convnext,efficientnet,lstm_lm,gpt")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--autotune", action="store_true")
    parser.add_argument("--without", default=None, help="a conv lowering to compare without")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = {"autotune": True} if args.autotune else {}
    if args.strategy:
        options["strategy"] = args.strategy
    for name in args.workloads.split(","):
        row = compare(name, args.n, args.rounds, args.seconds, args.without, **options)
        text = f"{name:14s} N={row['n']}  serial {row['serial_ms']:8.2f} ms"
        for label in ("hftc", "without"):
            if label in row:
                median, p10, p90 = row[label]
                text += (f"  {label} {row[label + '_ms']:8.2f} ms serial/{label} {median:.2f}x "
                         f"[{p10:.2f}, {p90:.2f}]")
        print(f"{text}  ({row['plan']})", flush=True)


if __name__ == "__main__":
    main()
