"""Stand-ins for torchvision ops that real models call, for machines without torchvision.

They follow torchvision's code and semantics (``torchvision.ops.stochastic_depth``) so that
the benchmark's and the tests' models trace as the real ones do: the functions are wrapped
with ``torch.fx.wrap`` as torchvision wraps them, and symbolic tracing keeps each call as
one leaf node.  Where torchvision is installed, use its ops: hftc fuses both.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import Tensor, nn

__all__ = ["StochasticDepth", "stochastic_depth"]


def stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """Randomly drop a residual branch ("Deep Networks with Stochastic Depth").

    ``mode="row"`` drops each sample's branch independently, ``"batch"`` the whole
    batch's at once; survivors are scaled by ``1 / (1 - p)``.  Identity when not
    training or ``p == 0``.
    """
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ("batch", "row"):
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    """The module form of :func:`stochastic_depth` (``torchvision.ops.StochasticDepth``)."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, input: Tensor) -> Tensor:
        return stochastic_depth(input, self.p, self.mode, self.training)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(p={self.p}, mode={self.mode})"
