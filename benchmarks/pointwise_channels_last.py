"""N 1x1 convs of a folded channels-last map: ``pointwise_channels_last`` against
``pointwise_bmm`` and one call per model (``loop``), forward + backward, one thread,
interleaved rounds.

    python benchmarks/pointwise_channels_last.py [--n 4] [--rounds 15]

Shapes: EfficientNet-like's 1x1 convs (batch 8; expand, project and SE's squeeze).  Each
round times every lowering once (order alternating); the report is the median time and the
median [10th-90th percentile] of the per-round ratios bmm / channels-last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hftc.lowering.runtime import conv as rt_conv
from hftc.lowering.runtime.layout import unfold_channels

# (batch, in channels, out channels, size) a model
SHAPES = [(8, 16, 64, 32), (8, 64, 16, 32), (8, 24, 96, 16), (8, 96, 24, 16), (8, 96, 384, 4),
          (8, 384, 96, 4), (8, 32, 32, 2), (8, 96, 4, 1)]
LOWERINGS = ["pointwise_channels_last", "pointwise_bmm", "loop"]


def _step(n: int, batch: int, cin: int, cout: int, size: int, lowering: str):
    folded = torch.randn(batch, n * cin, size, size).contiguous(memory_format=torch.channels_last)
    x = unfold_channels(folded, n, True).requires_grad_()
    weight = torch.randn(n, cout, cin, 1, 1, requires_grad=True)
    bias = torch.randn(n, cout, requires_grad=True)

    def run():
        x.grad = weight.grad = bias.grad = None
        y = rt_conv.conv(x, weight, bias, spatial=2, x_batched=True, lowering=lowering)
        y.backward(torch.ones_like(y))

    return run


def _time(fn, reps: int = 5) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for shape in SHAPES:
        steps = {name: _step(args.n, *shape, name) for name in LOWERINGS}
        for fn in steps.values():
            fn()
        times = {name: [] for name in LOWERINGS}
        for r in range(args.rounds):
            for name in (LOWERINGS if r % 2 == 0 else LOWERINGS[::-1]):
                times[name].append(_time(steps[name]))
        ratios = sorted(b / c for b, c in zip(times["pointwise_bmm"],
                                              times["pointwise_channels_last"]))
        p10, p90 = ratios[int(0.1 * (len(ratios) - 1))], ratios[round(0.9 * (len(ratios) - 1))]
        row = "  ".join(f"{name} {1e3 * statistics.median(t):6.2f} ms" for name, t in times.items())
        print(f"N={args.n} batch, cin, cout, size {shape}: {row}  bmm/channels-last "
              f"{statistics.median(ratios):.2f}x [{p10:.2f}, {p90:.2f}]", flush=True)


if __name__ == "__main__":
    main()
