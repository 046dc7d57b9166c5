"""EfficientNet's pieces and the word language model: hftc's fused training step against
the serial loop, one process, one thread, interleaved rounds.

    python benchmarks/se_depthwise.py [--n 4] [--rounds 15] [--only se,dw3,...]

A step is forward, backward of ``sum_i loss_i`` and zeroing the gradients (no optimizer:
hftc.optim is measured elsewhere).  Each round times both contenders (the order
alternating); the report is the median serial/fused ratio with the 10th-90th
percentile of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import hftc


class SqueezeExcitation(nn.Module):
    """torchvision's SqueezeExcitation: pool -> 1x1 conv -> SiLU -> 1x1 conv -> sigmoid -> scale."""

    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.SiLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class DepthwiseBN(nn.Module):
    """EfficientNet's depthwise stage: depthwise kxk conv, BatchNorm, SiLU."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=channels,
                              bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class MBConv(nn.Module):
    """An EfficientNet-B0 MBConv block: expand 1x1, depthwise 3x3, SE, project 1x1, residual."""

    def __init__(self, channels: int = 24, expand: int = 6, kernel: int = 3):
        super().__init__()
        hidden = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False),
                                    nn.BatchNorm2d(hidden), nn.SiLU())
        self.depthwise = DepthwiseBN(hidden, kernel)
        self.se = SqueezeExcitation(hidden, max(1, channels // 4))
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False),
                                     nn.BatchNorm2d(channels))

    def forward(self, x):
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class WordLanguageModel(nn.Module):
    """pytorch/examples' word_language_model: Embedding -> 2-layer LSTM/GRU -> Linear."""

    def __init__(self, kind: str = "LSTM", vocab: int = 1000, width: int = 128):
        super().__init__()
        self.encoder = nn.Embedding(vocab, width)
        self.rnn = getattr(nn, kind)(width, width, 2, dropout=0.2)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, tokens):
        output, _ = self.rnn(self.encoder(tokens))
        return self.decoder(output)


def square(y: torch.Tensor, models: int = 0) -> torch.Tensor:
    """The mean square of one model's output, or (``models`` > 0) the sum of the stacked
    outputs' per-model means (indexing ``out[i]`` would add N full-size zero gradients;
    a ``flatten`` of the fused layout's permuted view, a copy)."""
    return y.square().mean() if not models else y.square().mean(tuple(range(1, y.dim()))).sum()


def lm_loss(y: torch.Tensor, models: int = 0) -> torch.Tensor:
    """Next-word cross-entropy against word 0, per model as :func:`square`."""
    target = torch.zeros(y.shape[:-1].numel(), dtype=torch.long)
    losses = F.cross_entropy(y.reshape(-1, y.shape[-1]), target, reduction="none")
    return losses.mean() if not models else losses.view(models, -1).mean(1).sum()


def workloads(batch: int) -> dict:
    """name -> (model factory, input factory, loss)."""
    image = lambda c, s: lambda: torch.randn(batch, c, s, s)  # noqa: E731
    tokens = lambda: torch.randint(0, 1000, (35, batch))  # noqa: E731
    return {
        "se": (lambda: SqueezeExcitation(96, 24), image(96, 16), square),
        "dw3": (lambda: DepthwiseBN(96, 3), image(96, 16), square),
        "dw5": (lambda: DepthwiseBN(96, 5), image(96, 16), square),
        "mbconv": (lambda: MBConv(24), image(24, 16), square),
        "lstm_lm": (lambda: WordLanguageModel("LSTM"), tokens, lm_loss),
        "gru_lm": (lambda: WordLanguageModel("GRU"), tokens, lm_loss),
    }


def _step_serial(models, x, loss):
    total = sum(loss(m(x)) for m in models)
    total.backward()
    for m in models:
        m.zero_grad(set_to_none=True)


def _step_fused(fused, x, loss):
    out = fused(x)
    loss(out, out.shape[0]).backward()
    fused.zero_grad(set_to_none=True)


def _time(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def measure(name: str, n: int, rounds: int, batch: int, **fuse_options) -> dict:
    make, make_input, loss = workloads(batch)[name]
    torch.manual_seed(0)
    models = [make() for _ in range(n)]
    fused = hftc.fuse([make() for _ in range(n)], **fuse_options)
    x = make_input()
    serial = lambda: _step_serial(models, x, loss)  # noqa: E731
    fusedf = lambda: _step_fused(fused, x, loss)  # noqa: E731
    for fn in (serial, fusedf, serial, fusedf):  # compile and warm up
        fn()
    reps = max(1, int(0.2 / max(_time(serial, 1), 1e-4)))
    ratios, times = [], {"serial": [], "fused": []}
    for r in range(rounds):
        order = [("serial", serial), ("fused", fusedf)]
        result = {}
        for label, fn in (order if r % 2 == 0 else order[::-1]):
            result[label] = _time(fn, reps)
            times[label].append(result[label])
        ratios.append(result["serial"] / result["fused"])
    ratios.sort()
    return {"workload": name, "n": n, "serial_ms": 1e3 * statistics.median(times["serial"]),
            "fused_ms": 1e3 * statistics.median(times["fused"]),
            "ratio": statistics.median(ratios), "p10": ratios[int(0.1 * (len(ratios) - 1))],
            "p90": ratios[int(round(0.9 * (len(ratios) - 1)))], "fused": fused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--only", default="se,dw3,dw5,mbconv,lstm_lm,gru_lm")
    parser.add_argument("--source", action="store_true", help="print each fused program")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.only.split(","):
        row = measure(name, args.n, args.rounds, args.batch)
        print(f"{name:8s} N={row['n']}  serial {row['serial_ms']:7.2f} ms  fused "
              f"{row['fused_ms']:7.2f} ms  serial/fused {row['ratio']:.2f}x "
              f"[{row['p10']:.2f}, {row['p90']:.2f}]", flush=True)
        if args.source:
            print(row["fused"].last_program().source)


if __name__ == "__main__":
    main()
