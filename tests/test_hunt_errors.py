"""A new user's first mistakes converting a loop to hftc (bug hunt "errors"): each one
gets an hftc warning or error naming the model, the parameter and what to write."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def _usage_warnings(call, times=8):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            call()
    return [w for w in caught if issubclass(w.category, hftc.UsageWarning)]


@pytest.mark.parametrize("edit", ["zero_", "load_state_dict", "init"])
def test_an_in_place_edit_of_a_model_given_to_fuse_warns_at_the_fused_forward(edit):
    """``models[1].load_state_dict(ckpt)`` (or ``nn.init``, ``w.zero_()``) after fusing
    reaches none of the fused module's copies, which ran the weights of the fusing
    silently; the next fused forwards warn once, naming the model, the parameter and
    the fused module's copy to change instead."""
    torch.manual_seed(0)
    models = [MLP() for _ in range(3)]
    x = torch.randn(5, 4)
    fused = hftc.fuse(models)
    assert _usage_warnings(lambda: fused(x)) == []  # untouched models: quiet
    with torch.no_grad():
        if edit == "zero_":
            models[1].b.bias.zero_()
        elif edit == "load_state_dict":
            models[1].load_state_dict(MLP().state_dict())
        else:
            nn.init.zeros_(models[1].a.weight)
    [warning] = _usage_warnings(lambda: fused(x))
    text = str(warning.message)
    name = {"zero_": "b.bias", "load_state_dict": "a.weight", "init": "a.weight"}[edit]
    assert f"model 1 given to hftc.fuse had its parameter `{name}` written in place" in text
    assert f"fused.get_parameter('{name}')[1].copy_(w)" in text
    assert "hftc.replace_models(fused, {1: model})" in text
    assert warning.filename == __file__
    # what it says: the fused module's copy changed, and model 1 runs the edited weights
    with torch.no_grad():
        for key, w in models[1].named_parameters():
            fused.get_parameter(key)[1].copy_(w)
    torch.testing.assert_close(fused(x)[1], models[1](x))


def test_replaced_models_and_the_fused_modules_own_training_are_quiet():
    """Training the fused module, and a model replace_models took out and then edited,
    are no edit of a model the fused module still runs."""
    torch.manual_seed(0)
    models = [MLP() for _ in range(3)]
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    fused = hftc.fuse(models)
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()
    assert _usage_warnings(step) == []
    hftc.replace_models(fused, {1: MLP()})
    with torch.no_grad():
        models[1].a.weight.zero_()  # no longer model 1 of the fused module
    assert _usage_warnings(step) == []
