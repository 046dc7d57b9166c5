"""What the fused step's order of work costs on its own, without hftc: N stock models and N
stock Adams stepped in serial's order against the order any fused step runs them in.

    python -m benchmarks.schedule_cost [--workloads gpt] [--n 2] [--rounds 31]

* ``serial``: for each model: zero_grad, forward, loss, backward, step (``f0 b0 f1 b1``);
* ``forwards_first``: every forward, then one backward of the summed losses (autograd
  runs the later model's graph first: ``f0 f1 b1 b0``), then the N steps: the order of
  ``hftc.fuse``'s program and of its one-by-one loop under a user's training loop;
* ``backwards_in_order``: every forward, then each model's backward in turn
  (``f0 f1 b0 b1``).

The same stock ops run in all three; only what each finds in the core's caches differs
(a model whose weights fit L2 alone while N models' do not loses it between its forward
and its backward).  Rounds interleave the three on one thread; the report is each
order's median step time and the median serial/order ratio with its 10th-90th percentile.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hftc.bench.contenders import learning_rates, make_models
from hftc.bench.workloads import WORKLOADS


def orders(name: str, n: int) -> dict:
    """The three steps of the module docstring over the same N models and batch."""
    w = WORKLOADS[name]
    x, y = w.inputs()
    models = make_models(w, n)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, learning_rates(n))]

    def serial():
        for model, opt in zip(models, opts):
            opt.zero_grad(set_to_none=True)
            w.loss(model(x), y).backward()
            opt.step()

    def forwards_first():
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        sum(w.loss(model(x), y) for model in models).backward()
        for opt in opts:
            opt.step()

    def backwards_in_order():
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        for loss in [w.loss(model(x), y) for model in models]:
            loss.backward()
        for opt in opts:
            opt.step()

    return {"serial": serial, "forwards_first": forwards_first,
            "backwards_in_order": backwards_in_order}


def measure(name: str, n: int, rounds: int) -> dict:
    steps = orders(name, n)
    for step in steps.values():  # Adam's state, the allocator's caches
        step()
        step()
    return against_serial(interleaved(steps, rounds))


def interleaved(steps: dict[str, Callable[[], object]], rounds: int,
                alternate: bool = False) -> dict[str, list[float]]:
    """Each step's seconds in ``rounds`` rounds of one call each, in turn (``alternate``:
    every other round in the reverse order, so that drift hits both ends alike)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(rounds):
        for k in (list(steps) if not alternate or r % 2 == 0 else list(reversed(steps))):
            start = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - start)
    return times


def against_serial(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per step: its median ms and the median [p10, p90] of the per-round ratios
    serial / it."""
    out = {}
    for k, ts in times.items():
        ratios = sorted(s / t for s, t in zip(times["serial"], ts))
        q = statistics.quantiles(ratios, n=10)
        out[k] = {"ms": statistics.median(ts) * 1e3, "ratio": statistics.median(ratios),
                  "p10": q[0], "p90": q[-1]}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="gpt")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| workload | N | order | step (ms) | serial / order, median [p10, p90] |")
    print("|---|---|---|---|---|")
    for name in args.workloads.split(","):
        for k, r in measure(name, args.n, args.rounds).items():
            print(f"| {name} | {args.n} | {k} | {r['ms']:.2f} | {r['ratio']:.3f} "
                  f"[{r['p10']:.3f}, {r['p90']:.3f}] |", flush=True)


if __name__ == "__main__":
    main()
