"""A depthwise conv's weight gradient on the CPU: oneDNN's (NCHW, channels-last) against
hftc's ``depthwise_wgrad_conv`` formulation, one thread, N = 4 models folded into the
channels, rounds interleaved, medians in ms.

    python benchmarks/depthwise_wgrad.py

``depthwise conv``: the gradient as one depthwise *forward* conv of ``x`` viewed
``[1, B*C, H, W]`` with the ``dy`` maps as kernels, summed over the batch
(:class:`hftc.lowering.runtime.conv._DepthwiseConv2d`); ``... from channels-last``: the same,
with the copies of channels-last ``x`` and ``dy`` to NCHW counted.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(8, 32, 16, 7), (8, 64, 8, 7), (8, 128, 4, 7), (16, 96, 16, 3), (16, 96, 16, 5)]


def _ms(fn, reps: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def _measure(n: int, batch: int, channels: int, size: int, k: int, rounds: int) -> dict:
    """Median ms of each way of one shape's weight gradient."""
    backward = torch.ops.aten.convolution_backward
    groups, pad = n * channels, k // 2
    x, dy = torch.randn(batch, groups, size, size), torch.randn(batch, groups, size, size)
    w = torch.randn(groups, 1, k, k)
    x_cl, dy_cl = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))

    def onednn(x, dy):
        return lambda: backward(dy, x, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0],
                                groups, [False, True, False])

    def as_conv(x, dy):
        maps = x.reshape(1, batch * groups, size, size)
        kernels = dy.reshape(batch * groups, 1, size, size)
        return F.conv2d(maps, kernels, None, 1, pad, 1, batch * groups).view(
            batch, groups, k, k).sum(0)

    ways = {"oneDNN NCHW": onednn(x, dy), "oneDNN channels-last": onednn(x_cl, dy_cl),
            "depthwise conv": lambda: as_conv(x, dy),
            "... from channels-last": lambda: as_conv(x_cl.contiguous(), dy_cl.contiguous())}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            times[name].append(_ms(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def main(n: int = 4, rounds: int = 5) -> None:
    torch.set_num_threads(1)
    print("batch, channels per model, size, kernel: median ms per weight gradient")
    for shape in SHAPES:
        medians = _measure(n, *shape, rounds)
        print(shape, ", ".join(f"{name} {ms:.2f}" for name, ms in medians.items()), flush=True)


if __name__ == "__main__":
    main()
