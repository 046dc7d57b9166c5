"""hftc's default training step against the serial loop on the model zoo's workloads, side by
side in one process, one thread, interleaved rounds.

    python benchmarks/zoo_pair.py [--workloads convnext,lstm_lm] [--n 4] [--rounds 11]
                                  [--strategy auto|fused|model_loop] [--autotune]

A step is what ``hftc bench`` times: zero_grad, forward, loss, backward, Adam step.  The
serial contender is N stock models with N stock Adams; hftc's is ``hftc.fuse(models)``
(no options unless given) + ``hftc.optim.Adam`` + ``hftc.per_model(loss)``.  Each round
times both (the order alternating) for at least ``--seconds`` each; the report is the
median serial/hftc ratio of the rounds with their 10th-90th percentile.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hftc
from hftc.bench.contenders import build_step, learning_rates, make_models
from hftc.bench.workloads import WORKLOADS


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


def _time(fn, seconds: float) -> float:
    start, reps = time.perf_counter(), 0
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / reps


def compare(name: str, n: int, rounds: int, seconds: float, **fuse_options) -> dict:
    serial = build_step("serial", name, n).fn
    fused_step, fused = hftc_step(name, n, **fuse_options)
    for fn in (serial, fused_step, serial, fused_step):  # build, choose, warm up
        fn()
    ratios, times = [], {"serial": [], "hftc": []}
    for r in range(rounds):
        order = [("serial", serial), ("hftc", fused_step)]
        took = {}
        for label, fn in (order if r % 2 == 0 else order[::-1]):
            took[label] = _time(fn, seconds)
            times[label].append(took[label])
        ratios.append(took["serial"] / took["hftc"])
    ratios.sort()
    plan = getattr(fused, "plan", None)
    return {"workload": name, "n": n, "serial_ms": 1e3 * statistics.median(times["serial"]),
            "hftc_ms": 1e3 * statistics.median(times["hftc"]),
            "ratio": statistics.median(ratios), "p10": ratios[int(0.1 * (len(ratios) - 1))],
            "p90": ratios[int(round(0.9 * (len(ratios) - 1)))], "plan": str(plan)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="convnext,efficientnet,lstm_lm,gpt")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--autotune", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = {"autotune": True} if args.autotune else {}
    if args.strategy:
        options["strategy"] = args.strategy
    for name in args.workloads.split(","):
        row = compare(name, args.n, args.rounds, args.seconds, **options)
        print(f"{name:14s} N={row['n']}  serial {row['serial_ms']:8.2f} ms  hftc "
              f"{row['hftc_ms']:8.2f} ms  serial/hftc {row['ratio']:.2f}x "
              f"[{row['p10']:.2f}, {row['p90']:.2f}]  ({row['plan']})", flush=True)


if __name__ == "__main__":
    main()
