"""The model zoo: plain PyTorch models, written the way researchers write them.

One definition of each model, shared by the benchmark workloads (``workloads.py``, at the
sizes docs/BENCHMARKS.md was measured on), ``hftc demo`` (``hftc/cli/speed.py``) and the tests
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
- the models users train (issue 29), the benchmark's only, each in the code shapes of
  its source and sized by arguments: ``ConvNeXt`` (torchvision's CNBlock, stochastic
  depth), ``EfficientNet`` (MBConv with squeeze-and-excitation), ``TransformerNet``
  (pytorch/examples fast_neural_style), ``RNNModel`` (word_language_model) and ``GPT``
  (nanoGPT).

Nothing here knows about hftc: a fuser has to see through these models as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

try:  # torchvision's op where it is installed; the stand-in traces and runs the same
    from torchvision.ops import StochasticDepth
except (ImportError, RuntimeError):  # not installed, or built for another torch
    from .torchvision_ops import StochasticDepth

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


# --------------------------------------------------------------------------- ConvNeXt
# torchvision.models.convnext, its code shapes kept (CNBlock's nn.Sequential with Permute
# modules, layer scale, StochasticDepth("row") with a linearly increasing p, in-place
# residual add, LayerNorm2d); the stage depths and widths are arguments.

class Permute(nn.Module):
    """torchvision.ops.misc.Permute."""

    def __init__(self, dims: list[int]):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class LayerNorm2d(nn.LayerNorm):
    """torchvision's LayerNorm2d: LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    """ConvNeXt block: depthwise 7x7, NHWC LayerNorm, Linear 4x, GELU, Linear, layer scale,
    stochastic depth, residual."""

    def __init__(self, dim, layer_scale, stochastic_depth_prob):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(in_features=dim, out_features=4 * dim, bias=True),
            nn.GELU(),
            nn.Linear(in_features=4 * dim, out_features=dim, bias=True),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")

    def forward(self, input):
        result = self.layer_scale * self.block(input)
        result = self.stochastic_depth(result)
        result += input
        return result


class ConvNeXt(nn.Module):
    """ConvNeXt: a patchify stem, stages of CNBlocks joined by LayerNorm2d + 2x2 stride-2
    convs, global average pool, LayerNorm2d + Linear head.

    ``block_setting``: (channels, blocks) per stage (ConvNeXt-Tiny: (96, 3), (192, 3),
    (384, 9), (768, 3)); ``stem_stride``: 4 in torchvision, 2 for 32x32 images.
    """

    TINY = ((96, 3), (192, 3), (384, 9), (768, 3))

    def __init__(self, block_setting=((32, 2), (64, 2), (128, 2)), stochastic_depth_prob=0.1,
                 layer_scale=1e-6, num_classes=10, stem_stride=2):
        super().__init__()
        first = block_setting[0][0]
        layers: list[nn.Module] = [nn.Sequential(
            nn.Conv2d(3, first, kernel_size=stem_stride, stride=stem_stride),
            LayerNorm2d(first, eps=1e-6))]
        total_stage_blocks = sum(count for _, count in block_setting)
        stage_block_id = 0
        for i, (channels, count) in enumerate(block_setting):
            stage = []
            for _ in range(count):
                # adjust stochastic depth probability based on the depth of the stage block
                sd_prob = stochastic_depth_prob * stage_block_id / (total_stage_blocks - 1.0)
                stage.append(CNBlock(channels, layer_scale, sd_prob))
                stage_block_id += 1
            layers.append(nn.Sequential(*stage))
            if i + 1 < len(block_setting):
                out = block_setting[i + 1][0]
                layers.append(nn.Sequential(LayerNorm2d(channels, eps=1e-6),
                                            nn.Conv2d(channels, out, kernel_size=2, stride=2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        last = block_setting[-1][0]
        self.classifier = nn.Sequential(LayerNorm2d(last, eps=1e-6), nn.Flatten(1),
                                        nn.Linear(last, num_classes))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        return self.classifier(x)


# --------------------------------------------------------------------------- EfficientNet
# torchvision.models.efficientnet (V1): Conv2dNormActivation, SqueezeExcitation
# (torchvision.ops.misc), MBConv with stochastic depth on the residual.


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """torchvision.ops.misc.Conv2dNormActivation: conv (no bias), BatchNorm, activation."""

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, groups=1,
                 activation_layer=nn.SiLU):
        layers = [nn.Conv2d(in_channels, out_channels, kernel_size, stride,
                            (kernel_size - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(out_channels)]
        if activation_layer is not None:
            layers.append(activation_layer(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """torchvision.ops.misc.SqueezeExcitation: pool, 1x1 conv, SiLU, 1x1 conv, sigmoid, scale."""

    def __init__(self, input_channels, squeeze_channels):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = nn.SiLU(inplace=True)
        self.scale_activation = nn.Sigmoid()

    def _scale(self, input):
        scale = self.avgpool(input)
        scale = self.fc1(scale)
        scale = self.activation(scale)
        scale = self.fc2(scale)
        return self.scale_activation(scale)

    def forward(self, input):
        scale = self._scale(input)
        return scale * input


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand, depthwise kxk, squeeze-and-excitation, 1x1 project;
    stochastic depth on the residual."""

    def __init__(self, expand_ratio, kernel, stride, input_channels, out_channels,
                 stochastic_depth_prob):
        super().__init__()
        self.use_res_connect = stride == 1 and input_channels == out_channels
        layers: list[nn.Module] = []
        expanded_channels = _make_divisible(input_channels * expand_ratio, 8)
        if expanded_channels != input_channels:
            layers.append(Conv2dNormActivation(input_channels, expanded_channels, 1))
        layers.append(Conv2dNormActivation(expanded_channels, expanded_channels, kernel, stride,
                                           groups=expanded_channels))
        squeeze_channels = max(1, input_channels // 4)
        layers.append(SqueezeExcitation(expanded_channels, squeeze_channels))
        layers.append(Conv2dNormActivation(expanded_channels, out_channels, 1,
                                           activation_layer=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")
        self.out_channels = out_channels

    def forward(self, input):
        result = self.block(input)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += input
        return result


class EfficientNet(nn.Module):
    """EfficientNet (V1): stem, MBConv stages, 1x1 head conv, pool, dropout, Linear.

    ``setting``: (expand ratio, kernel, stride, in channels, out channels, blocks) per
    stage (B0: (1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3), (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1), head 1280); the stochastic depth probability grows linearly
    with the block's index, as torchvision's.
    """

    B0 = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2),
          (6, 3, 2, 40, 80, 3), (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4),
          (6, 3, 1, 192, 320, 1))
    SMALL = ((1, 3, 1, 16, 16, 1), (4, 3, 2, 16, 24, 2), (4, 5, 2, 24, 40, 2),
             (4, 3, 2, 40, 80, 2), (4, 5, 1, 80, 96, 1))

    def __init__(self, setting=SMALL, stochastic_depth_prob=0.2, num_classes=10, dropout=0.2,
                 last_channel=384, stem_stride=1):
        super().__init__()
        layers: list[nn.Module] = [Conv2dNormActivation(3, setting[0][3], 3, stem_stride)]
        total_stage_blocks = sum(s[5] for s in setting)
        stage_block_id = 0
        for expand, kernel, stride, inp, out, count in setting:
            stage = []
            for i in range(count):
                # adjust stochastic depth probability based on the depth of the stage block
                sd_prob = stochastic_depth_prob * float(stage_block_id) / total_stage_blocks
                stage.append(MBConv(expand, kernel, stride if i == 0 else 1,
                                    inp if i == 0 else out, out, sd_prob))
                stage_block_id += 1
            layers.append(nn.Sequential(*stage))
        layers.append(Conv2dNormActivation(setting[-1][4], last_channel, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True),
                                        nn.Linear(last_channel, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                init_range = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -init_range, init_range)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


# --------------------------------------------------------------------------- fast_neural_style
# pytorch/examples fast_neural_style/neural_style/transformer_net.py; the channel widths
# and the number of residual blocks are arguments (the real net: (32, 64, 128), 5).


class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super().__init__()
        reflection_padding = kernel_size // 2
        self.reflection_pad = nn.ReflectionPad2d(reflection_padding)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        out = self.reflection_pad(x)
        out = self.conv2d(out)
        return out


class ResidualBlock(nn.Module):
    """introduced in: https://arxiv.org/abs/1512.03385"""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = nn.InstanceNorm2d(channels, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x):
        residual = x
        out = self.relu(self.in1(self.conv1(x)))
        out = self.in2(self.conv2(out))
        out = out + residual
        return out


class UpsampleConvLayer(nn.Module):
    """Upsamples the input and then does a convolution (nearest upsampling, as the real net)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, upsample=None):
        super().__init__()
        self.upsample = upsample
        reflection_padding = kernel_size // 2
        self.reflection_pad = nn.ReflectionPad2d(reflection_padding)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        x_in = x
        if self.upsample:
            x_in = F.interpolate(x_in, mode="nearest", scale_factor=self.upsample)
        out = self.reflection_pad(x_in)
        out = self.conv2d(out)
        return out


class TransformerNet(nn.Module):
    """Image -> stylised image of the same size (Johnson et al. 2016)."""

    def __init__(self, channels=(32, 64, 128), residual_blocks=5):
        super().__init__()
        c1, c2, c3 = channels
        # Initial convolution layers
        self.conv1 = ConvLayer(3, c1, kernel_size=9, stride=1)
        self.in1 = nn.InstanceNorm2d(c1, affine=True)
        self.conv2 = ConvLayer(c1, c2, kernel_size=3, stride=2)
        self.in2 = nn.InstanceNorm2d(c2, affine=True)
        self.conv3 = ConvLayer(c2, c3, kernel_size=3, stride=2)
        self.in3 = nn.InstanceNorm2d(c3, affine=True)
        # Residual layers
        self.res = nn.Sequential(*[ResidualBlock(c3) for _ in range(residual_blocks)])
        # Upsampling Layers
        self.deconv1 = UpsampleConvLayer(c3, c2, kernel_size=3, stride=1, upsample=2)
        self.in4 = nn.InstanceNorm2d(c2, affine=True)
        self.deconv2 = UpsampleConvLayer(c2, c1, kernel_size=3, stride=1, upsample=2)
        self.in5 = nn.InstanceNorm2d(c1, affine=True)
        self.deconv3 = ConvLayer(c1, 3, kernel_size=9, stride=1)
        # Non-linearities
        self.relu = nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.relu(self.in3(self.conv3(y)))
        y = self.res(y)
        y = self.relu(self.in4(self.deconv1(y)))
        y = self.relu(self.in5(self.deconv2(y)))
        y = self.deconv3(y)
        return y


# --------------------------------------------------------------------------- word_language_model
# pytorch/examples word_language_model/model.py's RNNModel (LSTM): sequence-first token ids
# [T, B] -> log-probabilities [T*B, ntoken] and the new hidden state.


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder.

    ``forward(input, hidden=None)``: ``hidden`` None is the zero state (what
    ``init_hidden`` returns; the benchmark starts every batch from it).
    """

    def __init__(self, rnn_type="LSTM", ntoken=2000, ninp=200, nhid=200, nlayers=2,
                 dropout=0.2, tie_weights=False):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden=None):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


# --------------------------------------------------------------------------- nanoGPT
# karpathy/nanoGPT model.py: pre-norm blocks, CausalSelfAttention with
# F.scaled_dot_product_attention(is_causal=True), GELU MLP, wte tied to lm_head,
# GPT-2 initialisation.  ``forward(idx)`` returns every position's logits (nanoGPT's
# training branch; the benchmark takes the loss outside, as for every workload).


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout, bias):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
            is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, n_embd, dropout, bias):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, n_embd, n_head, dropout, bias):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = GPTMLP(n_embd, dropout, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT: token ids [B, T] -> logits [B, T, vocab]; by default shakespeare_char's
    vocabulary (65) and a reduced width and depth (its config: 6 layers, 6 heads, 384)."""

    def __init__(self, vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128,
                 dropout=0.0, bias=True):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([GPTBlock(n_embd, n_head, dropout, bias) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, \
            f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)
