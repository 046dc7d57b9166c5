"""Real-style models through the tracing front-ends (symbolic and torch.export), found in
the export hunt.

- A forward that returns a buffer it updates in place (a step counter, an EMA that the
  caller logs) ran the models one by one with a FusionWarning blaming the user's
  forward: the first-call check restored the fused module's buffers before comparing,
  and the output it compared was a view of those very buffers, so it read the value from
  before the call.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from equivalence import check_equivalence

import hftc
from hftc.errors import FusionWarning

DTYPES = [torch.float64, torch.float32]


class StepCounted(nn.Module):
    """A model that counts its calls and keeps an EMA of its output (both buffers), and
    returns both so the training loop can log them (pytorch-lightning style metrics)."""

    def __init__(self, decay=0.9):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.decay = decay
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x):
        y = self.fc(x)
        self.steps += 1
        self.ema.mul_(self.decay).add_(y.detach().mean(0), alpha=1 - self.decay)
        return {"logits": y * self.steps, "steps": self.steps, "ema": self.ema}


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_returned_buffer_updated_in_forward_fuses(frontend, dtype, n):
    torch.manual_seed(n)
    models = [StepCounted(decay=0.5 + 0.1 * i) for i in range(n)]
    x = torch.randn(2, 4, dtype=dtype)
    example = (x,) if frontend == "export" else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionWarning)  # not "runs the models one by one"
        check_equivalence(models, x, dtype=dtype, steps=2, fuser=lambda ms, in_dims: hftc.fuse(
            ms, in_dims=in_dims, frontend=frontend, example_inputs=example))
