"""A zoo of plain PyTorch models, written the way researchers write them.

Nothing here knows about hftc: the models use ``nn.Sequential`` where it is
natural and hand-written ``forward`` methods elsewhere, with the idioms that a
fuser has to see through (``x.view(x.size(0), -1)``, ``torch.flatten(x, 1)``,
``F.relu``, in-place residual adds, ``torch.max(...)[0]``, ``torch.bmm`` on
transposes, ``x.size()`` used to build tensors).  Widths are small so that one
forward pass on a CPU takes a few milliseconds at batch 4-8.

Every factory takes ``seed`` (``None`` draws from torch's global RNG, so two
calls give two different models) and returns a freshly initialised module.
``ZOO`` maps a name to ``(factory, input_shape)`` where ``input_shape(batch)``
is the shape of the one positional input for a batch of that size::

    factory, input_shape = ZOO["resnet"]
    models = [factory(seed=i) for i in range(3)]
    x = torch.randn(input_shape(4))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Run the body under ``torch.manual_seed(seed)`` without disturbing the global RNG."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------------------- LeNet-5


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.view(x.size(0), -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def lenet5_mnist(seed: int | None = None) -> LeNet5:
    with _seeded(seed):
        return LeNet5(in_channels=1)


def lenet5_cifar(seed: int | None = None) -> LeNet5:
    with _seeded(seed):
        return LeNet5(in_channels=3)


# --------------------------------------------------------------------------- ResNet


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x

        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)

        out = self.conv2(out)
        out = self.bn2(out)

        if self.downsample is not None:
            identity = self.downsample(x)

        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    """A CIFAR-style ResNet: 3x3 stem, three stages of BasicBlocks, avg pool, fc."""

    def __init__(
        self,
        layers: tuple[int, ...] = (1, 1, 1),
        widths: tuple[int, ...] = (8, 16, 32),
        num_classes: int = 10,
    ):
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = conv3x3(3, self.inplanes)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(widths[0], layers[0])
        self.layer2 = self._make_layer(widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(widths[2], layers[2], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[2] * BasicBlock.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * BasicBlock.expansion, stride),
                nn.BatchNorm2d(planes * BasicBlock.expansion),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * BasicBlock.expansion
        for _ in range(1, blocks):
            layers.append(BasicBlock(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)

        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)

        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


def resnet_small(seed: int | None = None) -> ResNet:
    with _seeded(seed):
        return ResNet()


# --------------------------------------------------------------------------- MobileNetV2


class ConvBNReLU(nn.Sequential):
    def __init__(
        self,
        in_planes: int,
        out_planes: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
    ):
        padding = (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(
                in_planes, out_planes, kernel_size, stride, padding, groups=groups, bias=False
            ),
            nn.BatchNorm2d(out_planes),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = self.stride == 1 and inp == oup

        layers: list[nn.Module] = []
        if expand_ratio != 1:
            # pointwise expansion
            layers.append(ConvBNReLU(inp, hidden_dim, kernel_size=1))
        layers.extend(
            [
                # depthwise
                ConvBNReLU(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
                # pointwise-linear bottleneck
                nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
                nn.BatchNorm2d(oup),
            ]
        )
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 at a toy width, for 3x32x32 inputs."""

    def __init__(self, num_classes: int = 10, dropout: float = 0.2):
        super().__init__()
        input_channel = 8
        last_channel = 32
        # t (expansion), c (channels), n (repeats), s (stride of the first repeat)
        inverted_residual_setting = [
            [1, 8, 1, 1],
            [4, 12, 2, 2],
            [4, 16, 2, 2],
        ]
        features: list[nn.Module] = [ConvBNReLU(3, input_channel, stride=2)]
        for t, c, n, s in inverted_residual_setting:
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(InvertedResidual(input_channel, c, stride, expand_ratio=t))
                input_channel = c
        features.append(ConvBNReLU(input_channel, last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(last_channel, num_classes),
        )

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


def mobilenet_v2_small(seed: int | None = None, dropout: float = 0.2) -> MobileNetV2:
    with _seeded(seed):
        return MobileNetV2(dropout=dropout)


# --------------------------------------------------------------------------- DCGAN

NZ = 16  # latent size
NGF = 8  # generator feature maps
NDF = 8  # discriminator feature maps
NC = 3  # image channels


def dcgan_weights_init(m: nn.Module) -> None:
    """The DCGAN paper's initialisation, as in the PyTorch DCGAN example."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    """[B, nz, 1, 1] latent -> [B, 3, 16, 16] image in [-1, 1]."""

    def __init__(self, nz: int = NZ, ngf: int = NGF, nc: int = NC):
        super().__init__()
        self.main = nn.Sequential(
            # nz x 1 x 1 -> (ngf*4) x 4 x 4
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # -> (ngf*2) x 8 x 8
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # -> nc x 16 x 16
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    """[B, 3, 16, 16] image -> [B] probability of being real."""

    def __init__(self, ndf: int = NDF, nc: int = NC):
        super().__init__()
        self.main = nn.Sequential(
            # nc x 16 x 16 -> ndf x 8 x 8
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # -> (ndf*2) x 4 x 4
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # -> 1 x 1 x 1
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


def dcgan_generator(seed: int | None = None) -> Generator:
    with _seeded(seed):
        net = Generator()
        net.apply(dcgan_weights_init)
        return net


def dcgan_discriminator(seed: int | None = None) -> Discriminator:
    with _seeded(seed):
        net = Discriminator()
        net.apply(dcgan_weights_init)
        return net


# --------------------------------------------------------------------------- PointNet


class STN3d(nn.Module):
    """The T-Net: predicts a kxk transform of the input points."""

    def __init__(self, k: int = 3, widths: tuple[int, int, int] = (16, 32, 64)):
        super().__init__()
        self.k = k
        self.width = widths[2]
        self.conv1 = nn.Conv1d(k, widths[0], 1)
        self.conv2 = nn.Conv1d(widths[0], widths[1], 1)
        self.conv3 = nn.Conv1d(widths[1], widths[2], 1)
        self.fc1 = nn.Linear(widths[2], widths[1])
        self.fc2 = nn.Linear(widths[1], widths[0])
        self.fc3 = nn.Linear(widths[0], k * k)
        self.relu = nn.ReLU()

        self.bn1 = nn.BatchNorm1d(widths[0])
        self.bn2 = nn.BatchNorm1d(widths[1])
        self.bn3 = nn.BatchNorm1d(widths[2])
        self.bn4 = nn.BatchNorm1d(widths[1])
        self.bn5 = nn.BatchNorm1d(widths[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batchsize = x.size()[0]
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        x = torch.max(x, 2, keepdim=True)[0]
        x = x.view(-1, self.width)

        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        x = self.fc3(x)

        iden = torch.eye(self.k, device=x.device, dtype=x.dtype).flatten()
        iden = iden.view(1, self.k * self.k).repeat(batchsize, 1)
        x = x + iden
        x = x.view(-1, self.k, self.k)
        return x


class PointNetCls(nn.Module):
    """PointNet classifier: [B, 3, P] points -> ([B, k] log-probs, [B, 3, 3] transform)."""

    def __init__(
        self, k: int = 5, widths: tuple[int, int, int] = (16, 32, 64), dropout: float = 0.3
    ):
        super().__init__()
        self.width = widths[2]
        self.stn = STN3d(widths=widths)
        self.conv1 = nn.Conv1d(3, widths[0], 1)
        self.conv2 = nn.Conv1d(widths[0], widths[1], 1)
        self.conv3 = nn.Conv1d(widths[1], widths[2], 1)
        self.bn1 = nn.BatchNorm1d(widths[0])
        self.bn2 = nn.BatchNorm1d(widths[1])
        self.bn3 = nn.BatchNorm1d(widths[2])
        self.fc1 = nn.Linear(widths[2], widths[1])
        self.fc2 = nn.Linear(widths[1], widths[0])
        self.fc3 = nn.Linear(widths[0], k)
        self.dropout = nn.Dropout(p=dropout)
        self.bn4 = nn.BatchNorm1d(widths[1])
        self.bn5 = nn.BatchNorm1d(widths[0])
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        trans = self.stn(x)
        x = x.transpose(2, 1)
        x = torch.bmm(x, trans)
        x = x.transpose(2, 1)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        x = torch.max(x, 2, keepdim=True)[0]
        x = x.view(-1, self.width)

        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.dropout(self.fc2(x))))
        x = self.fc3(x)
        return F.log_softmax(x, dim=1), trans


def pointnet_cls(seed: int | None = None, dropout: float = 0.3) -> PointNetCls:
    with _seeded(seed):
        return PointNetCls(dropout=dropout)


# --------------------------------------------------------------------------- MLPs


class ResidualBlock(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(ln(x))))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ResMLP(nn.Module):
    """Tokens [B, T, d_in] -> embed -> pre-norm residual blocks -> LN -> mean over T -> head."""

    def __init__(
        self, d_in: int = 16, dim: int = 32, hidden: int = 64, depth: int = 2, num_classes: int = 10
    ):
        super().__init__()
        self.embed = nn.Linear(d_in, dim)
        self.blocks = nn.Sequential(*[ResidualBlock(dim, hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = self.blocks(x)
        x = self.norm(x)
        x = x.mean(dim=1)
        return self.head(x)


def residual_mlp(seed: int | None = None) -> ResMLP:
    with _seeded(seed):
        net = ResMLP()
        # LayerNorm starts as the identity; give it weights so that a fuser that
        # mixes up models' LayerNorm parameters is caught.
        for m in net.modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.normal_(m.weight, 1.0, 0.1)
                nn.init.normal_(m.bias, 0.0, 0.1)
        return net


def mlp(seed: int | None = None) -> nn.Sequential:
    """The tiny MLP: 64-128-128-10."""
    with _seeded(seed):
        return nn.Sequential(
            nn.Linear(64, 128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )


# --------------------------------------------------------------------------- registry


class ZooEntry(NamedTuple):
    factory: Callable[..., nn.Module]
    input_shape: Callable[[int], tuple[int, ...]]


NUM_POINTS = 32

ZOO: dict[str, ZooEntry] = {
    "lenet5_mnist": ZooEntry(lenet5_mnist, lambda b: (b, 1, 28, 28)),
    "lenet5_cifar": ZooEntry(lenet5_cifar, lambda b: (b, 3, 32, 32)),
    "resnet": ZooEntry(resnet_small, lambda b: (b, 3, 32, 32)),
    "mobilenet_v2": ZooEntry(mobilenet_v2_small, lambda b: (b, 3, 32, 32)),
    "dcgan_generator": ZooEntry(dcgan_generator, lambda b: (b, NZ, 1, 1)),
    "dcgan_discriminator": ZooEntry(dcgan_discriminator, lambda b: (b, NC, 16, 16)),
    "pointnet_cls": ZooEntry(pointnet_cls, lambda b: (b, 3, NUM_POINTS)),
    "residual_mlp": ZooEntry(residual_mlp, lambda b: (b, 8, 16)),
    "mlp": ZooEntry(mlp, lambda b: (b, 64)),
}


def make_models(name: str, n: int, seed: int = 0, **kwargs) -> list[nn.Module]:
    """``n`` models of zoo entry ``name`` with seeds ``seed, seed + 1, ...``."""
    factory = ZOO[name].factory
    return [factory(seed=seed + i, **kwargs) for i in range(n)]


def make_input(
    name: str, batch: int, *, dtype: torch.dtype = torch.float32, seed: int | None = None
) -> torch.Tensor:
    """A random input batch for zoo entry ``name``."""
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return torch.randn(ZOO[name].input_shape(batch), generator=gen, dtype=dtype)
