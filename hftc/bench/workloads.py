"""The benchmark workloads: unmodified models (``zoo.py``), as a researcher would write them.

Each :class:`Workload` says how to build one model, one batch of inputs and
targets, and the loss of one model's output.  The sizes follow the issue
(MLP 64-128-128-10 and LeNet-5 at batch 64, ResNet-18 and MobileNetV2 at 32x32,
a PointNet classifier, a 2-layer Transformer encoder at sequence length 64);
where the 2-core CPU this suite was written on cannot afford the full size, the
batch, the number of points or the values of N are reduced, and ``note`` says so
(docs/BENCHMARKS.md repeats the notes next to the numbers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .zoo import (
    MLP,
    LeNet5,
    MobileNetV2,
    PointNetCls,
    StockTransformerClassifier,
    TransformerClassifier,
    resnet18,
)

# --------------------------------------------------------------------------- the table


def _first(out):
    """A model's prediction: PointNet returns (log-probs, transform)."""
    return out[0] if isinstance(out, tuple) else out


@dataclass
class Workload:
    """One model family of the benchmark and how to feed and score it."""

    name: str
    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]          # one sample, without the batch dim
    batch: int
    num_classes: int
    sizes: tuple[int, ...]                # values of N in the full run
    quick_sizes: tuple[int, ...]          # values of N in --quick
    rounds: int = 10                      # timed rounds in the full run
    warmup: int = 2                       # untimed steps after the first, per contender
    compile_sizes: tuple[int, ...] = ()   # values of N for hftc+compile in the full run
    log_probs: bool = False               # the model ends in log_softmax: NLL loss
    int_input: int | None = None          # token ids in [0, int_input) instead of floats
    note: str = ""
    extra: dict = field(default_factory=dict)
    #: What changes on a GPU (``on("cuda")``): the full sizes the CPU cannot afford.
    gpu: dict = field(default_factory=dict)

    def on(self, device: str | torch.device) -> Workload:
        """This workload as run on ``device``: on a GPU, with its ``gpu`` overrides."""
        if torch.device(device).type == "cpu" or not self.gpu:
            return self
        return dataclasses.replace(self, **self.gpu, gpu={})

    def inputs(self, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        g = generator or torch.Generator().manual_seed(0)
        if self.int_input is not None:
            x = torch.randint(0, self.int_input, (self.batch, *self.input_shape), generator=g)
        else:
            x = torch.randn(self.batch, *self.input_shape, generator=g)
        y = torch.randint(0, self.num_classes, (self.batch,), generator=g)
        return x, y

    def loss(self, out, y: Tensor) -> Tensor:
        """One model's loss (stock contenders): cross-entropy, or NLL of log-probs."""
        out = _first(out)
        return F.nll_loss(out, y) if self.log_probs else F.cross_entropy(out, y)

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        return F.nll_loss if self.log_probs else F.cross_entropy


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("mlp", MLP, (64,), 64, 10, sizes=(1, 2, 4, 8, 16, 32, 64),
             quick_sizes=(1, 8, 32), rounds=15, compile_sizes=(4, 32)),
    Workload("lenet5", LeNet5, (1, 28, 28), 64, 10, sizes=(1, 2, 4, 8, 16, 32),
             quick_sizes=(1, 16), rounds=10, compile_sizes=(16,)),
    Workload("pointnet", PointNetCls, (3, 128), 8, 40, sizes=(1, 2, 4, 8),
             quick_sizes=(1, 4), rounds=8, log_probs=True, compile_sizes=(4,),
             note="128 points and batch 8 instead of 1024 points and batch 32 (CPU time: "
                  "the full size is 28 GFLOP per model step)",
             gpu={"input_shape": (3, 1024), "batch": 32, "sizes": (1, 2, 4, 8, 16, 32),
                  "note": "1024 points, batch 32"}),
    Workload("resnet18", resnet18, (3, 32, 32), 8, 10, sizes=(1, 2, 4),
             quick_sizes=(2,), rounds=6, warmup=1,
             note="batch 8 (CPU time: 27 GFLOP per model step); N <= 4; no torch.compile "
                  "(minutes of compile per N)",
             gpu={"batch": 128, "sizes": (1, 2, 4, 8, 16), "rounds": 8, "compile_sizes": (4,),
                  "note": "batch 128"}),
    Workload("mobilenet_v2", MobileNetV2, (3, 32, 32), 8, 10, sizes=(1, 2, 4),
             quick_sizes=(2,), rounds=5, warmup=1,
             note="batch 8 (CPU time); N <= 4; no torch.compile (minutes of compile per N)",
             gpu={"batch": 128, "sizes": (1, 2, 4, 8, 16), "rounds": 8, "compile_sizes": (4,),
                  "note": "batch 128"}),
    Workload("transformer", TransformerClassifier, (64,), 16, 10, sizes=(1, 2, 4, 8, 16),
             quick_sizes=(1, 4), rounds=8, int_input=1000, compile_sizes=(4,),
             gpu={"batch": 64, "sizes": (1, 2, 4, 8, 16, 32),
                  "note": "d_model 128, 4 heads, FFN 512, vocab 1000, batch 64"},
             note="d_model 128, 4 heads, FFN 512, vocab 1000, batch 16; attention written "
                  "with nn.Linear + matmul + softmax"),
    Workload("transformer_stock", StockTransformerClassifier, (64,), 16, 10, sizes=(1, 4),
             quick_sizes=(), rounds=4, int_input=1000,
             note="nn.TransformerEncoderLayer, fused by hftc's attention rules "
                  "(nn.MultiheadAttention as batched matmuls over N*heads); no hand-fused "
                  "version"),
]}
