"""hftc.compile_step on the CPU: the eager step against mode="compile", side by side.

    PYTHONPATH=. python scripts/step_cpu_bench.py [--rounds 15] [--steps 5]

For each workload (the suite's mlp, lenet5, transformer at their quick N), two fused
copies of the same N models train on the same batch, one through each mode; rounds
alternate eager, compile, eager, ... on one thread, and the per-round ratio eager time /
compile time is reported as its median and 10th-90th percentiles (> 1: compile faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hftc
from hftc.bench.contenders import _first, learning_rates, make_models
from hftc.bench.workloads import WORKLOADS

CASES = (("mlp", 8), ("mlp", 32), ("lenet5", 16), ("transformer", 4))


def _step(workload, n: int, mode: str):
    fused = hftc.fuse(make_models(workload, n))
    opt = hftc.optim.Adam(fused.parameters(), lr=learning_rates(n))
    loss = hftc.per_model(workload.loss_fn)
    return hftc.compile_step(fused, lambda out, y: loss(_first(out), y), opt, mode=mode,
                             per_model_loss=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, n in CASES:
        w = WORKLOADS[name]
        x, y = w.inputs()
        steps = {mode: _step(w, n, mode) for mode in ("eager", "compile")}
        t0 = time.perf_counter()
        for _ in range(3):  # warm-up, then the first compiled step (compiles)
            steps["compile"](x, y)
        compile_s = time.perf_counter() - t0
        for _ in range(3):
            steps["eager"](x, y)
        ratios, times = [], {"eager": [], "compile": []}
        for _ in range(args.rounds):
            for mode, step in steps.items():
                t = time.perf_counter()
                for _ in range(args.steps):
                    step(x, y)
                times[mode].append((time.perf_counter() - t) / args.steps)
            ratios.append(times["eager"][-1] / times["compile"][-1])
        deciles = statistics.quantiles(ratios, n=10)
        print(f"{name} N={n}: eager {statistics.median(times['eager']) * 1e3:.2f} ms, "
              f"compile {statistics.median(times['compile']) * 1e3:.2f} ms per step; "
              f"eager/compile {statistics.median(ratios):.2f}x "
              f"[{deciles[0]:.2f}-{deciles[-1]:.2f}]; first 3 compile-mode steps "
              f"{compile_s:.1f} s", flush=True)


if __name__ == "__main__":
    main()
