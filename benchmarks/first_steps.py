"""The default's first training steps against the serial loop (issue 45: "the default's
first 24 steps of an MLP at N = 32 >= 4x the serial loop; the choice costs at most about
two serial steps").

    python -m benchmarks.first_steps [--models 32] [--steps 24] [--rounds 5]

Per round, interleaved, one thread: N stock MLPs (hftc.bench.zoo.MLP, batch 64) each with
its own torch.optim.SGD, ``steps`` steps one model after another (serial); then
``hftc.fuse`` of N new ones with the default options and ``hftc.optim.SGD``, the same
steps, timed from the first call (its trace, check and compile included) and again from
``hftc.fuse``. Then one fused module's step times, step by step, and the steady state
(the median of steps ``steps + 1`` to ``2 * steps``). Reported: the median ratios and
what the first call costs in serial steps, and the serial step against the fused
step's eight batched GEMMs timed alone: the ceiling of any fused step's ratio here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import hftc
from hftc.bench.zoo import MLP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, steps = args.models, args.steps
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 64, generator=generator),
                torch.randint(0, 10, (64,), generator=generator)) for _ in range(2 * steps)]
    loss = hftc.per_model(F.cross_entropy)

    def serial() -> float:
        models = [MLP() for _ in range(n)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
        start = time.perf_counter()
        for x, y in batches[:steps]:
            for m, o in zip(models, opts):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()
        return time.perf_counter() - start

    def fused(count: int) -> tuple[float, float, list[float]]:
        start = time.perf_counter()
        module = hftc.fuse([MLP() for _ in range(n)])
        opt = hftc.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        made = time.perf_counter()
        times = []
        for x, y in batches[:count]:
            t = time.perf_counter()
            opt.zero_grad()
            loss(module(x), y).sum().backward()
            opt.step()
            times.append(time.perf_counter() - t)
        return made - start, sum(times[:steps]), times

    def gemms(rounds: int = 20) -> float:
        """The fused step's eight batched GEMMs alone (forward 3, backward 5), the median
        of ``rounds``: no fused step is faster, whatever its other ops cost."""
        x = torch.randn(n, 64, 64)
        w = [torch.randn(n, 64, 128), torch.randn(n, 128, 128), torch.randn(n, 128, 10)]
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            h1 = torch.bmm(x, w[0])
            h2 = torch.bmm(h1, w[1])
            g3 = torch.bmm(h2, w[2])
            torch.bmm(h2.transpose(1, 2), g3)
            g2 = torch.bmm(g3, w[2].transpose(1, 2))
            torch.bmm(h1.transpose(1, 2), g2)
            g1 = torch.bmm(g2, w[1].transpose(1, 2))
            torch.bmm(x.transpose(1, 2), g1)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    serial(), fused(steps), gemms()  # warm-up: torch's and hftc's first uses in the process
    from_call, from_fuse, steady, first, floor = [], [], [], [], []
    for _ in range(args.rounds):
        s = serial()
        fuse_s, steps_s, times = fused(2 * steps)
        from_call.append(s / steps_s)
        from_fuse.append(s / (fuse_s + steps_s))
        steady.append(s / steps / statistics.median(times[steps:]))
        first.append((times[0] - statistics.median(times[steps:])) / (s / steps))
        floor.append(s / steps / gemms())

    def show(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"

    print(f"MLP N = {n}, {steps} steps, {args.rounds} rounds, one thread")
    print(f"  the first {steps} steps from the first call: {show(from_call)} the serial loop")
    print(f"  the same with hftc.fuse counted:         {show(from_fuse)}")
    print(f"  the steady state:                        {show(steady)}")
    print(f"  the first call's extra cost: {statistics.median(first):.1f} serial steps "
          f"[{min(first):.1f}-{max(first):.1f}]")
    print(f"  the serial step against the fused step's GEMMs alone: {show(floor)} (the "
          f"most a fused step can gain on this CPU)")


if __name__ == "__main__":
    main()
