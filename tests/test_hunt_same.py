"""Each model only its own, after fusing too: a plain attribute the models' forward reads,
set on the fused module or on one of its submodules after fusing, is refused (the fused
program, the models one by one and ``unfuse()`` were all built from each model's own
value, and nothing read the fused module's), naming the attribute, model 0's value, the
user's line and the buffer that can change between calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hftc


class Attention(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return self.q(x) * self.scale


class Tempered(nn.Module):  # a temperature the user's loop anneals
    def __init__(self, i: int):
        super().__init__()
        self.attn = Attention(1.0 + i)
        self.temperature = 1.0 + i

    def forward(self, x):
        return self.attn(x).tanh() / self.temperature


class Buffered(nn.Module):  # the way out the error names
    def __init__(self, t: float):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("temperature", torch.tensor(t, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) / self.temperature


def _x():
    return torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("strategy", ["auto", "model_loop"])
def test_a_models_attribute_set_on_the_fused_module_is_refused(strategy):
    torch.manual_seed(0)
    models = [Tempered(i).double() for i in range(3)]
    fused = hftc.fuse(copy.deepcopy(models), strategy=strategy)
    x = _x()
    fused(x)
    with pytest.raises(hftc.errors.FusionArgumentError) as info:
        fused.temperature = 0.5
    text = str(info.value)
    assert "fused.temperature = 0.5" in text and "model 0's is 1.0" in text
    assert "test_hunt_same.py" in text and "register_buffer('temperature'" in text
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"fused\.attn\.scale = 3\.0"):
        fused.attn.scale = 3.0
    assert "temperature" not in fused.__dict__ and "scale" not in fused.attn.__dict__
    out = fused(x)  # still each model's own
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
    # hftc's own options and names the models do not hold are set as on any module
    fused.check = False
    fused.note = "mine"
    fused.attn.note = 1
    assert fused.note == "mine" and fused.attn.note == 1


@pytest.mark.parametrize("strategy", ["auto", "fused", "model_loop"])
def test_a_buffer_changed_after_fusing_is_each_models_own(strategy):
    """What the error says to do: a buffer, set per model on the fused module."""
    torch.manual_seed(0)
    models = [Buffered(1.0 + i).double() for i in range(3)]
    fused = hftc.fuse(copy.deepcopy(models), strategy=strategy)
    x = _x()
    fused(x)
    fused.temperature.fill_(0.5)
    fused.temperature[2] = 4.0
    for m, t in zip(models, (0.5, 0.5, 4.0)):
        m.temperature.fill_(t)
    out = fused(x)
    for i, (m, own) in enumerate(zip(models, fused.unfuse())):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(own(x), m(x), rtol=1e-12, atol=1e-12)
