"""The tests' model zoo: the package's zoo (``hftc/bench/zoo.py``) at toy sizes, plus DCGAN
and a residual MLP, which only the tests use.

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

from hftc.bench.zoo import MLP, LeNet5, MobileNetV2, PointNetCls, ResNet

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


def lenet5_mnist(seed: int | None = None) -> LeNet5:
    with _seeded(seed):
        return LeNet5(in_channels=1)


def lenet5_cifar(seed: int | None = None) -> LeNet5:
    with _seeded(seed):
        return LeNet5(in_channels=3)


# --------------------------------------------------------------------------- ResNet


def resnet_small(seed: int | None = None) -> ResNet:
    """A CIFAR-style ResNet: 3x3 stem, three stages of BasicBlocks, avg pool, fc."""
    with _seeded(seed):
        return ResNet(blocks=(1, 1, 1), widths=(8, 16, 32), inplace=True, kaiming_init=True)


# --------------------------------------------------------------------------- MobileNetV2


def mobilenet_v2_small(seed: int | None = None, dropout: float = 0.2) -> MobileNetV2:
    """MobileNetV2 at a toy width, for 3x32x32 inputs."""
    with _seeded(seed):
        return MobileNetV2(dropout=dropout, setting=((1, 8, 1, 1), (4, 12, 2, 2), (4, 16, 2, 2)),
                           stem_channels=8, stem_stride=2, last_channel=32, kaiming_init=True)


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


def pointnet_cls(seed: int | None = None, dropout: float = 0.3) -> PointNetCls:
    """PointNet classifier: [B, 3, P] points -> ([B, k] log-probs, [B, 3, 3] transform)."""
    with _seeded(seed):
        return PointNetCls(num_classes=5, widths=(16, 32, 64), fc=(32, 16), dropout=dropout)


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


def mlp(seed: int | None = None) -> MLP:
    """The tiny MLP: 64-128-128-10."""
    with _seeded(seed):
        return MLP()


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


class WritesItsInput(nn.Module):
    """A forward that writes into its input (``x.mul_(2)``, ``relu_``), as the model alone
    would: whatever runs it more than once (a check, a tuning run, shape propagation)
    must run it on copies."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x.relu_())

