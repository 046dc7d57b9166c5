"""What the default strategy ("auto": the first-call choice between the fused program and
the models one by one) costs and gives, per workload and N.

    python -m benchmarks.default_strategy [--rounds 8] [--only mlp,pointnet:2:4] [--json out.json]

Per workload and N: N stock models with N ``torch.optim.SGD`` (serial), ``hftc.fuse(...,
strategy="fused")`` (the fused program), ``strategy="model_loop"`` (the models one by
one) and ``hftc.fuse(...)`` (the default, from an empty cache, stepped until it has
chosen) each with ``hftc.optim.SGD``; then one training step each per round,
interleaved, one thread.  Reported: the median per-round ratios serial/fused,
serial/loop and serial/default with the 10th-90th percentiles, the default's choice, how
(timed on the first calls, or on extra steps where the models draw random numbers), after
how many calls, and what the choice cost (``plan.seconds``).  The real-model-style
workloads (a ConvNeXt-like block stack with stochastic depth, an EfficientNet-like net
with squeeze-and-excitation, a fast_neural_style TransformerNet with InstanceNorm and
upsampling) are small local copies.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import hftc
import hftc.lowering.strategy as strategy
import hftc.lowering.timing as timing
from hftc.bench.torchvision_ops import StochasticDepth
from hftc.bench.workloads import WORKLOADS


class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock: depthwise 7x7, LayerNorm (channels last), MLP, layer scale,
    stochastic depth."""

    def __init__(self, dim: int, p: float):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim, 1, 1), 1e-6))
        self.drop = StochasticDepth(p, "row")

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pw2(F.gelu(self.pw1(self.norm(y)))).permute(0, 3, 1, 2)
        return x + self.drop(self.gamma * y)


class ConvNeXtLike(nn.Module):
    def __init__(self, dims=(24, 48), depth=2, num_classes=10):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, stride=4)]
        for k, dim in enumerate(dims):
            if k:
                layers += [nn.GroupNorm(1, dims[k - 1]), nn.Conv2d(dims[k - 1], dim, 2, 2)]
            layers += [ConvNeXtBlock(dim, 0.1) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(s))))


class MBConv(nn.Module):
    """EfficientNet's block: expand 1x1, depthwise 3x3, SE, project 1x1, residual."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4):
        super().__init__()
        mid = cin * expand
        self.block = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.SiLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
            nn.SiLU(), SqueezeExcitation(mid, max(1, cin // 4)),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class EfficientNetLike(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.SiLU())
        self.blocks = nn.Sequential(MBConv(16, 16, 1), MBConv(16, 24, 2), MBConv(24, 24, 1),
                                    MBConv(24, 40, 2))
        self.head = nn.Linear(40, num_classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class ConvLayer(nn.Module):
    def __init__(self, cin, cout, kernel, stride, upsample=None):
        super().__init__()
        self.upsample = upsample
        self.pad = nn.ReflectionPad2d(kernel // 2)
        self.conv = nn.Conv2d(cin, cout, kernel, stride)

    def forward(self, x):
        if self.upsample:
            x = F.interpolate(x, mode="nearest", scale_factor=self.upsample)
        return self.conv(self.pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, 3, 1)
        self.in1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, 3, 1)
        self.in2 = nn.InstanceNorm2d(channels, affine=True)

    def forward(self, x):
        return x + self.in2(self.conv2(F.relu(self.in1(self.conv1(x)))))


class TransformerNet(nn.Module):
    """pytorch/examples fast_neural_style's TransformerNet, narrower (8-32 channels)."""

    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(
            ConvLayer(3, 8, 9, 1), nn.InstanceNorm2d(8, affine=True), nn.ReLU(),
            ConvLayer(8, 16, 3, 2), nn.InstanceNorm2d(16, affine=True), nn.ReLU(),
            ConvLayer(16, 32, 3, 2), nn.InstanceNorm2d(32, affine=True), nn.ReLU())
        self.res = nn.Sequential(*[ResidualBlock(32) for _ in range(2)])
        self.up = nn.Sequential(
            ConvLayer(32, 16, 3, 1, upsample=2), nn.InstanceNorm2d(16, affine=True), nn.ReLU(),
            ConvLayer(16, 8, 3, 1, upsample=2), nn.InstanceNorm2d(8, affine=True), nn.ReLU(),
            ConvLayer(8, 3, 9, 1))

    def forward(self, x):
        return self.up(self.res(self.down(x)))


#: name -> (factory, one sample's shape, batch, loss: "ce" or "mse", N values)
CASES = {name: (w.factory, w.input_shape, w.batch, "ce", w.int_input)
         for name, w in WORKLOADS.items()}
CASES.update({
    "convnext_like": (ConvNeXtLike, (3, 32, 32), 8, "ce", None),
    "efficientnet_like": (EfficientNetLike, (3, 32, 32), 8, "ce", None),
    "transformernet": (TransformerNet, (3, 32, 32), 2, "mse", None),
})
SIZES = {"mlp": (2, 4, 8, 32), "lenet5": (2, 4, 8), "pointnet": (2, 4), "resnet18": (2,),
         "mobilenet_v2": (2, 4), "transformer": (2, 4), "transformer_stock": (2, 4),
         "convnext_like": (2, 4), "efficientnet_like": (2, 4), "transformernet": (2, 4)}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def measure(name: str, n: int, rounds: int) -> dict:
    factory, shape, batch, loss_kind, int_input = CASES[name]
    torch.manual_seed(0)
    models = [factory() for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, int_input, (batch, *shape), generator=g) if int_input
         else torch.randn(batch, *shape, generator=g))
    lrs = [0.01 * (1 + i % 4) for i in range(n)]

    def loss_of(out):  # one model's loss (out: its output)
        out = out[0] if isinstance(out, tuple) else out
        if loss_kind == "mse":
            return out.square().mean()
        return F.cross_entropy(out, torch.zeros(batch, dtype=torch.long))

    serial = copy.deepcopy(models)
    serial_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
                   for m, lr in zip(serial, lrs)]

    def serial_step():
        for m, opt in zip(serial, serial_opts):
            opt.zero_grad(set_to_none=True)
            loss_of(m(x)).backward()
            opt.step()

    def fused_stepper(strategy):
        fused = hftc.fuse(copy.deepcopy(models), strategy=strategy)
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            out = fused(x)
            out = out[0] if isinstance(out, tuple) else out
            sum(loss_of(out[i]) for i in range(n)).backward()
            opt.step()
        return fused, step

    fused, fused_step = fused_stepper("fused")
    _, loop_step = fused_stepper("model_loop")
    auto, auto_step = fused_stepper("auto")
    fused_step()
    loop_step()
    timing._MEMORY.clear()  # an empty cache: the default times
    start = time.perf_counter()
    calls = 0
    while calls < 80:  # the default decides on its first calls (or on extra steps)
        auto_step()
        calls += 1
        if auto.plan.reason != strategy.TIMING_CALLS:
            break
    deciding_s = time.perf_counter() - start
    serial_step()
    times = {"serial": [], "fused": [], "loop": [], "auto": []}
    steps = {"serial": serial_step, "fused": fused_step, "loop": loop_step, "auto": auto_step}
    order = list(steps)
    for r in range(rounds + 1):
        for key in order if r % 2 == 0 else order[::-1]:
            begin = time.perf_counter()
            steps[key]()
            if r:  # round 0 warms up
                times[key].append(time.perf_counter() - begin)
    ratios = {k: [s / t for s, t in zip(times["serial"], times[k])]
              for k in ("fused", "loop", "auto")}
    return {
        "workload": name, "n": n, "rounds": rounds,
        **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
        **{f"{k}_ratio": statistics.median(v) for k, v in ratios.items()},
        **{f"{k}_p10": _percentile(v, 0.1) for k, v in ratios.items()},
        **{f"{k}_p90": _percentile(v, 0.9) for k, v in ratios.items()},
        "choice": auto.plan.chosen, "decide_s": auto.plan.seconds, "decide_calls": calls,
        "deciding_wall_s": deciding_s, "how": auto.plan.reason,
        "plan": str(auto.plan),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--only", default="")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["HFTC_CACHE_DIR"] = tempfile.mkdtemp(prefix="hftc-strategy-bench-")
    # "pointnet" (its SIZES) or "pointnet:2:4" (those N)
    cases = [(name, tuple(int(n) for n in sizes) or SIZES[name])
             for name, *sizes in (item.split(":") for item in
                                  (args.only.split(",") if args.only else list(SIZES)))]
    rows = []
    print("| workload | N | serial ms | serial/fused [p10-p90] | serial/loop [p10-p90] "
          "| serial/default [p10-p90] | default's choice (how, after calls) | choice cost s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, sizes in cases:
        for n in sizes:
            row = measure(name, n, args.rounds)
            rows.append(row)
            cells = " | ".join(f"{row[k + '_ratio']:.2f} [{row[k + '_p10']:.2f}-"
                               f"{row[k + '_p90']:.2f}]" for k in ("fused", "loop", "auto"))
            print(f"| {name} | {n} | {row['serial_ms']:.2f} | {cells} | {row['choice']} "
                  f"({row['how']}, {row['decide_calls']}) | {row['decide_s']:.2f} |",
                  flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
