"""A width sweep's training step: 8 MLPs of hidden widths 64-512, three ways.

``python -m benchmarks.pad_widths [--rounds 15] [--steps 5] [--batch 64]``

* ``serial``: the 8 models one by one, each with its own ``torch.optim.SGD``;
* ``fuse_groups``: ``hftc.fuse_groups(models)`` as it is today: 8 widths, 8 groups of one
  model each, each with its ``hftc.optim.SGD``;
* ``padded``: ``hftc.fuse(models, pad_widths=True)``: one array padded to width 512, one
  ``hftc.optim.SGD`` (the padding's arithmetic is in ``fused.fusion_report``).

A step is forward, the per-model cross-entropy, backward and the optimizer step.  Rounds
interleave the contenders (serial, fuse_groups, padded, serial, ...) on one thread; the
report is each contender's median time per step over serial's, per round, with the
10th-90th percentile of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import hftc

WIDTHS = [64 * k for k in range(1, 9)]


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.LayerNorm(width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def contenders(batch: int):
    torch.manual_seed(0)
    models = [mlp(w) for w in WIDTHS]
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    lrs = [0.01 * (i + 1) for i in range(len(models))]

    serial = [copy for copy in (mlp(w) for w in WIDTHS)]
    for s, m in zip(serial, models):
        s.load_state_dict(m.state_dict())
    serial_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
                   for m, lr in zip(serial, lrs)]

    def serial_step():
        for m, opt in zip(serial, serial_opts):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

    groups = hftc.fuse_groups(models)
    group_opts = [hftc.optim.SGD(f.parameters(), lr=[lrs[i] for i in idx], momentum=0.9)
                  for f, idx in groups]

    def groups_step():
        for (f, idx), opt in zip(groups, group_opts):
            opt.zero_grad()
            out = f(x)
            sum(F.cross_entropy(out[j], y) for j in range(len(idx))).backward()
            opt.step()

    padded = hftc.fuse(models, pad_widths=True)
    padded_opt = hftc.optim.SGD(padded.parameters(), lr=lrs, momentum=0.9)

    def padded_step():
        padded_opt.zero_grad()
        out = padded(x)
        sum(F.cross_entropy(out[j], y) for j in range(len(models))).backward()
        padded_opt.step()

    return {"serial": serial_step, "fuse_groups": groups_step, "padded": padded_step}, padded


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps, padded = contenders(args.batch)
    for step in steps.values():  # first calls: compile, check, strategy timing
        for _ in range(3):
            step()
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    result = {"widths": WIDTHS, "batch": args.batch, "rounds": args.rounds,
              "padding": padded.fusion_report.padding}
    for name in steps:
        ratios = sorted(t / s for t, s in zip(times[name], times["serial"]))
        k = len(ratios)
        result[name] = {"median_ms": 1e3 * statistics.median(times[name]),
                        "ratio_to_serial": statistics.median(ratios),
                        "p10_p90": [ratios[int(0.1 * (k - 1))], ratios[int(0.9 * (k - 1))]]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
