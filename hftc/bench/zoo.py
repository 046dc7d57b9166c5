"""The model zoo: plain PyTorch models, written the way researchers write them.

One definition of each model, shared by the benchmark workloads (``workloads.py``, at the
sizes docs/BENCHMARKS.md was measured on), ``hftc demo`` (``hftc/speed.py``) and the tests
(``tests/zoo.py``, at toy sizes).  The defaults build the benchmark's model; the tests
pick their variant with arguments:

- ``MLP`` (64-128-128-10) and ``LeNet5``: the same in both (the tests also take
  ``LeNet5(in_channels=3)``);
- ``ResNet``: ResNet-18 (``resnet18``) in the benchmark; the tests' is 1 block x 3
  stages of widths 8-32, with torchvision's in-place idioms (``inplace=True``) and
  initialisation (``kaiming_init=True``);
- ``MobileNetV2``: width 1.0 with CIFAR strides in the benchmark; the tests' has a toy
  ``setting``, 8-32 channels and ``kaiming_init=True``;
- ``PointNetCls``: conv widths 64-128-1024 and fc 512-256 in the benchmark, 16-32-64 and
  32-16 in the tests;
- ``TransformerClassifier`` and ``StockTransformerClassifier``: the benchmark's only.

Nothing here knows about hftc: a fuser has to see through these models as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- MLP, LeNet-5


class MLP(nn.Module):
    """The 3-layer MLP of the benchmarks: 64-128-128-10."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class LeNet5(nn.Module):
    """LeNet-5 for 1x28x28 (MNIST, padded first conv) or 3x32x32 (CIFAR) images."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        # MNIST images are 28x28; padding 2 makes the classic 32x32 geometry.
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2 if in_channels == 1 else 0)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.view(x.size(0), -1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


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
    """PointNet classifier: [B, 3, P] points -> ([B, k] log-probs, [B, 3, 3] transform).

    Qi et al. 2017 as in HFTA's benchmark, without the feature transform.
    """

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


# --------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    """Two 3x3 convs and a residual; ``inplace``: torchvision's ``nn.ReLU(inplace=True)``
    and ``out += shortcut``, else ``F.relu`` and ``out + shortcut``."""

    def __init__(self, inplanes, planes, stride=1, inplace=False):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or inplanes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        self.relu = nn.ReLU(inplace=True) if inplace else None

    def forward(self, x):
        if self.relu is None:
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return F.relu(out + self.shortcut(x))
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return self.relu(out)


class ResNet(nn.Module):
    """A CIFAR-style ResNet: 3x3 stem, stages of BasicBlocks, avg pool, fc.

    ``blocks[i]`` blocks of width ``widths[i]`` in stage ``layer{i+1}``, each stage after
    the first starting with stride 2; no max pool.  ``inplace``: torchvision's in-place
    ReLU modules, ``out += shortcut`` and an ``nn.AdaptiveAvgPool2d``; ``kaiming_init``:
    torchvision's Kaiming-normal (fan-out) convolution weights.
    """

    def __init__(self, blocks=(2, 2, 2, 2), widths=(64, 128, 256, 512), num_classes=10,
                 inplace=False, kaiming_init=False):
        super().__init__()
        self.num_stages = len(widths)
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True) if inplace else None
        inplanes = widths[0]
        for stage, (planes, count) in enumerate(zip(widths, blocks)):
            layers = []
            for block in range(count):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(inplanes, planes, stride, inplace))
                inplanes = planes
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1)) if inplace else None
        self.fc = nn.Linear(widths[-1], num_classes)

        if kaiming_init:
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.bn1(self.conv1(x))
        x = F.relu(x) if self.relu is None else self.relu(x)
        for stage in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{stage}")(x)
        x = F.adaptive_avg_pool2d(x, 1) if self.avgpool is None else self.avgpool(x)
        return self.fc(torch.flatten(x, 1))


def resnet18(num_classes: int = 10) -> ResNet:
    """ResNet-18 for 32x32 inputs (3x3 stem, no max pool: the CIFAR-10 variant)."""
    return ResNet(num_classes=num_classes)


# --------------------------------------------------------------------------- MobileNetV2


class InvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio):
        super().__init__()
        hidden = inp * expand_ratio
        self.use_res = stride == 1 and inp == oup
        layers = []
        if expand_ratio != 1:
            # pointwise expansion
            layers += [nn.Conv2d(inp, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                       nn.ReLU6(inplace=True)]
        layers += [
            # depthwise
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            # pointwise-linear bottleneck
            nn.Conv2d(hidden, oup, 1, bias=False), nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 for 32x32 inputs; by default width 1.0 with stride 1 in the stem and the
    second stage (the CIFAR variant).

    ``setting``: (expansion t, channels c, repeats n, stride s of the first repeat) per
    stage; ``kaiming_init``: torchvision's initialisation (Kaiming-normal convolutions,
    N(0, 0.01) classifier weights, zero classifier bias).
    """

    SETTING = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2),
               (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, num_classes=10, dropout=0.2, setting=SETTING, stem_channels=32,
                 stem_stride=1, last_channel=1280, kaiming_init=False):
        super().__init__()
        layers = [nn.Conv2d(3, stem_channels, 3, stem_stride, 1, bias=False),
                  nn.BatchNorm2d(stem_channels), nn.ReLU6(inplace=True)]
        inp = stem_channels
        for t, c, n, s in setting:
            for i in range(n):
                layers.append(InvertedResidual(inp, c, s if i == 0 else 1, t))
                inp = c
        layers += [nn.Conv2d(inp, last_channel, 1, bias=False), nn.BatchNorm2d(last_channel),
                   nn.ReLU6(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last_channel, num_classes))

        if kaiming_init:
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out")
                elif isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, 0, 0.01)
                    nn.init.zeros_(m.bias)

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
