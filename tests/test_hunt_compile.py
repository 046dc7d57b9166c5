"""Hunt of the whole-step and compile paths on the CPU (hftc.compile_step, torch.compile)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4)).double()


def _train(mode: str, strategy: str | None, steps: int = 4) -> tuple[list[torch.Tensor], list]:
    """Losses and first-layer weights of 3 dropout MLPs after ``steps`` compile_step calls."""
    models = [_mlp(s) for s in range(3)]
    fused = hftc.fuse(models, **({"strategy": strategy} if strategy else {}))
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-1, 2e-1, 3e-2])
    step = hftc.compile_step(fused, F.mse_loss, opt, mode=mode)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for it in range(steps):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(5, 4, generator=gen, dtype=torch.float64)
        torch.manual_seed(1000 + it)
        losses.append(step(x, y))
    return losses, [p.detach().clone() for p in fused.parameters()]


def test_compile_mode_dropout_draws_as_eager_one_by_one():
    """mode="compile" promises eager's numbers within float tolerance; inductor's own RNG
    drew other dropout masks than the eager step (and so than the serial loop, which the
    one-by-one step matches bit for bit) from the first compiled step on."""
    models = [_mlp(s) for s in range(3)]
    originals = [copy.deepcopy(m) for m in models]
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(originals, [1e-1, 2e-1, 3e-2])]
    losses, params = _train("compile", "model_loop")
    gen = torch.Generator().manual_seed(0)
    for it in range(4):
        x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(5, 4, generator=gen, dtype=torch.float64)
        torch.manual_seed(1000 + it)
        ref = []
        for m, o in zip(originals, opts):
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            ref.append(loss.detach())
        torch.testing.assert_close(losses[it], torch.stack(ref), rtol=1e-12, atol=1e-12)
    for i, m in enumerate(originals):
        torch.testing.assert_close(params[0][i], m[0].weight.detach(), rtol=1e-12, atol=1e-12)


def test_compile_mode_dropout_draws_as_eager_fused():
    """The fused program's dropout under torch.compile draws what the eager fused step draws."""
    eager_losses, eager_params = _train("eager", "fused")
    comp_losses, comp_params = _train("compile", "fused")
    for a, b in zip(eager_losses, comp_losses):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(eager_params, comp_params):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


class _Checkpointed(nn.Module):
    """A user's model with torch.utils.checkpoint around a closure over its own layers."""

    def __init__(self, reentrant=False):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant)
        return self.b(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_model_loop_user_checkpoint_backward(reentrant):
    # The checkpoint recomputes in backward, after the call: the models' own weights
    # (slices of the stacked ones) must still be bound then, not the shells' placeholders.
    models = []
    for s in range(3):
        torch.manual_seed(s)
        models.append(_Checkpointed(reentrant).double())
    originals = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models, strategy="model_loop")
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=reentrant)
    out = fused(x)
    out.sum().backward()
    for i, m in enumerate(originals):
        torch.testing.assert_close(out[i], m(x))
        m(x).sum().backward()
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name).grad[i], p.grad)
    # a copy made after a call holds no view of the original's stacked tensors
    twin = copy.deepcopy(fused)
    with torch.no_grad():
        fused.get_parameter("a.weight").zero_()
    torch.testing.assert_close(twin(x), torch.stack([m(x) for m in originals]))
