"""Shared pieces of the optimizer / AMP / checkpoint tests.

``StackedModels`` stands in for ``hftc.fuse``'s output where a test is about
optimizers, not fusion: its parameters are the N models' parameters stacked
``[N, *shape]`` under the original names, and its forward runs each model with
``torch.func.functional_call`` on slice i, so model i's gradient is exactly its
own. It also has ``num_models``, ``source_parameter_names`` and ``unfuse()``, as
a ``hftc.FusedModule`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn


@pytest.fixture(autouse=True)
def single_thread():
    """Run a test with one intra-op thread (import it into a test module to apply it).

    The tests' tensors are tiny: extra threads only add overhead, and on a busy
    2-core machine a parallel region waiting for a descheduled thread made these
    tests 10-50x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(seed: int, dtype: torch.dtype = torch.float64,
               activation: type[nn.Module] = nn.Tanh) -> nn.Module:
    """A small model with 3-d, 2-d and 1-d parameters: input [B, 2, 8] -> logits [B, 5].

    With ``activation=nn.ReLU`` nothing bounds the logits, so a huge learning rate
    really overflows to inf / NaN (tanh would saturate and keep the loss finite).
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), activation(), nn.Flatten(), nn.Linear(18, 5))
    return model.to(dtype)


def make_models(n: int, dtype: torch.dtype = torch.float64, seed: int = 0,
                activation: type[nn.Module] = nn.Tanh) -> list[nn.Module]:
    return [make_model(seed + i, dtype, activation) for i in range(n)]


def make_batches(steps: int, dtype: torch.dtype = torch.float64, batch: int = 8,
                 seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 2, 8, generator=g, dtype=dtype),
             torch.randint(0, 5, (batch,), generator=g)) for _ in range(steps)]


class StackedModels(nn.Module):
    """N models of one architecture as one module with stacked parameters (see module doc)."""

    def __init__(self, models: Sequence[nn.Module]):
        super().__init__()
        self.num_models = len(models)
        self._template = [copy.deepcopy(models[0])]  # in a list: not a registered child
        holder = copy.deepcopy(models[0])
        per_model = [dict(m.named_parameters()) for m in models]
        for name, _ in models[0].named_parameters():
            stacked = torch.stack([params[name].detach() for params in per_model]).clone()
            owner, _, leaf = name.rpartition(".")
            holder.get_submodule(owner)._parameters[leaf] = nn.Parameter(stacked)
        for name, child in holder.named_children():
            self.add_module(name, child)
        for leaf, p in holder._parameters.items():
            self.register_parameter(leaf, p)
        self.source_parameter_names = [
            {id(p): name for name, p in m.named_parameters()} for m in models
        ]

    def model_parameters(self, i: int) -> dict[str, torch.Tensor]:
        return {name: p[i] for name, p in self.named_parameters()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        template = self._template[0]
        outs = [torch.func.functional_call(template, self.model_parameters(i), (x,))
                for i in range(self.num_models)]
        return torch.stack(outs)

    def unfuse(self) -> list[nn.Module]:
        models = []
        for i in range(self.num_models):
            m = copy.deepcopy(self._template[0])
            with torch.no_grad():
                for name, p in m.named_parameters():
                    p.copy_(self.model_parameters(i)[name])
            models.append(m)
        return models


def per_model_losses(fused: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[N] cross-entropy losses, each model's on the shared batch."""
    out = fused(x)
    return torch.stack([F.cross_entropy(out[i], y) for i in range(out.shape[0])])


def train_solo(model: nn.Module, opt: torch.optim.Optimizer, batches,
               after_step: Callable[[int, torch.Tensor], None] | None = None) -> list[float]:
    """Plain training with a stock optimizer; returns the losses."""
    losses = []
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(k, loss.detach())
    return losses


def train_fused(fused: nn.Module, opt: torch.optim.Optimizer, batches,
                after_step: Callable[[int, torch.Tensor], None] | None = None) -> list[list[float]]:
    """Fused training: sum of the per-model losses, one backward, one step."""
    losses = []
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = per_model_losses(fused, x, y)
        loss.sum().backward()
        opt.step()
        losses.append(loss.tolist())
        if after_step is not None:
            after_step(k, loss.detach())
    return losses


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 if both are all zero)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def tolerance(dtype: torch.dtype) -> float:
    return 1e-9 if dtype == torch.float64 else 1e-4


def assert_model_matches(fused: nn.Module, i: int, solo: nn.Module, rtol: float) -> None:
    """Model i's slice of every fused parameter equals the solo model's parameter."""
    fused_params = dict(fused.named_parameters())
    for name, p in solo.named_parameters():
        d = rel_diff(fused_params[name][i], p)
        assert d <= rtol, f"model {i}, {name}: relative difference {d:.3g} > {rtol:g}"


def assert_all_match(fused: nn.Module, solos: Sequence[nn.Module], rtol: float,
                     models: Sequence[int] | None = None) -> None:
    for i in (range(len(solos)) if models is None else models):
        assert_model_matches(fused, i, solos[i], rtol)
