"""The benchmark workloads: unmodified models, as a researcher would write them.

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
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hftc.speed import MLP, LeNet5

# --------------------------------------------------------------------------- PointNet


class STN3d(nn.Module):
    """PointNet's input transform net: points -> a 3x3 matrix (identity-initialised offset)."""

    def __init__(self, widths=(64, 128, 1024), fc=(512, 256)):
        super().__init__()
        self.width = widths[2]
        self.conv1 = nn.Conv1d(3, widths[0], 1)
        self.conv2 = nn.Conv1d(widths[0], widths[1], 1)
        self.conv3 = nn.Conv1d(widths[1], widths[2], 1)
        self.fc1 = nn.Linear(widths[2], fc[0])
        self.fc2 = nn.Linear(fc[0], fc[1])
        self.fc3 = nn.Linear(fc[1], 9)
        self.bn1 = nn.BatchNorm1d(widths[0])
        self.bn2 = nn.BatchNorm1d(widths[1])
        self.bn3 = nn.BatchNorm1d(widths[2])
        self.bn4 = nn.BatchNorm1d(fc[0])
        self.bn5 = nn.BatchNorm1d(fc[1])

    def forward(self, x):
        batchsize = x.size(0)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        x = torch.max(x, 2, keepdim=True)[0]
        x = x.view(-1, self.width)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        x = self.fc3(x)
        iden = torch.eye(3, dtype=x.dtype, device=x.device).view(1, 9).repeat(batchsize, 1)
        return (x + iden).view(-1, 3, 3)


class PointNetCls(nn.Module):
    """The PointNet classifier (Qi et al. 2017, as in HFTA's benchmark), no feature transform."""

    def __init__(self, num_classes=40, widths=(64, 128, 1024), fc=(512, 256), dropout=0.3):
        super().__init__()
        self.width = widths[2]
        self.stn = STN3d(widths, fc)
        self.conv1 = nn.Conv1d(3, widths[0], 1)
        self.conv2 = nn.Conv1d(widths[0], widths[1], 1)
        self.conv3 = nn.Conv1d(widths[1], widths[2], 1)
        self.bn1 = nn.BatchNorm1d(widths[0])
        self.bn2 = nn.BatchNorm1d(widths[1])
        self.bn3 = nn.BatchNorm1d(widths[2])
        self.fc1 = nn.Linear(widths[2], fc[0])
        self.fc2 = nn.Linear(fc[0], fc[1])
        self.fc3 = nn.Linear(fc[1], num_classes)
        self.dropout = nn.Dropout(p=dropout)
        self.bn4 = nn.BatchNorm1d(fc[0])
        self.bn5 = nn.BatchNorm1d(fc[1])

    def forward(self, x):
        trans = self.stn(x)
        x = torch.bmm(x.transpose(2, 1), trans).transpose(2, 1)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        x = torch.max(x, 2, keepdim=True)[0]
        x = x.view(-1, self.width)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.dropout(self.fc2(x))))
        return F.log_softmax(self.fc3(x), dim=1), trans


# --------------------------------------------------------------------------- ResNet-18


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or inplanes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs (3x3 stem, no max pool: the CIFAR-10 variant)."""

    def __init__(self, num_classes=10, widths=(64, 128, 256, 512)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, inplanes = [], widths[0]
        for stage, planes in enumerate(widths):
            for block in range(2):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(inplanes, planes, stride))
                inplanes = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


# --------------------------------------------------------------------------- MobileNetV2


class InvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio):
        super().__init__()
        hidden = inp * expand_ratio
        self.use_res = stride == 1 and inp == oup
        layers = []
        if expand_ratio != 1:
            layers += [nn.Conv2d(inp, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                       nn.ReLU6(inplace=True)]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, oup, 1, bias=False), nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0) for 32x32 inputs: stride 1 in the stem and the second stage."""

    SETTING = [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2),
               (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, num_classes=10, dropout=0.2):
        super().__init__()
        layers = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(inplace=True)]
        inp = 32
        for t, c, n, s in self.SETTING:
            for i in range(n):
                layers.append(InvertedResidual(inp, c, s if i == 0 else 1, t))
                inp = c
        layers += [nn.Conv2d(inp, 1280, 1, bias=False), nn.BatchNorm2d(1280),
                   nn.ReLU6(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(1280, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.classifier(x)


# --------------------------------------------------------------------------- Transformer


class SelfAttention(nn.Module):
    """Multi-head self-attention written with nn.Linear, matmul and softmax."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = F.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class EncoderLayer(nn.Module):
    """Post-norm Transformer encoder layer (as nn.TransformerEncoderLayer, dropout 0.1)."""

    def __init__(self, dim, heads, ffn, dropout=0.1):
        super().__init__()
        self.attn = SelfAttention(dim, heads)
        self.ln1 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, ffn)
        self.ff2 = nn.Linear(ffn, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self.drop(self.ff2(self.drop(F.relu(self.ff1(x))))))


class TransformerClassifier(nn.Module):
    """Token ids [B, T] -> embedding + learned positions -> 2 encoder layers -> mean -> classes."""

    def __init__(self, vocab=1000, seq=64, dim=128, heads=4, ffn=512, layers=2, num_classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.Sequential(*[EncoderLayer(dim, heads, ffn) for _ in range(layers)])
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos
        x = self.layers(x)
        return self.head(x.mean(dim=1))


class StockTransformerClassifier(nn.Module):
    """The same classifier with nn.TransformerEncoderLayer (hftc loops over models there)."""

    def __init__(self, vocab=1000, seq=64, dim=128, heads=4, ffn=512, layers=2, num_classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.Sequential(*[
            nn.TransformerEncoderLayer(dim, heads, ffn, dropout=0.1, batch_first=True)
            for _ in range(layers)])
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos
        x = self.layers(x)
        return self.head(x.mean(dim=1))


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
    Workload("resnet18", ResNet18, (3, 32, 32), 8, 10, sizes=(1, 2, 4),
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
