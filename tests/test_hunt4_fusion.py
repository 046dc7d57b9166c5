"""Regression tests of hunt 4 in the fusion core: calls bound as the models bind them,
mismatch errors that name both models' lines, per-model scalar arguments, padded widths
with different activations."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc
from hftc.errors import FusionArgumentError
from hftc.lowering import strategy


def _models_with_forward(forward, n=2):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

    Model.forward = forward
    torch.manual_seed(0)
    return [Model() for _ in range(n)]


def _keyword_only(self, *, x):
    return self.fc(x)


def _positional_only(self, x, /):
    return self.fc(x)


def _keyword_only_default(self, x, *, scale=2.0):
    return self.fc(x) * scale


@pytest.mark.parametrize("forward, args, kwargs", [
    (_keyword_only, (torch.randn(5, 4),), {}),
    (_positional_only, (), {"x": torch.randn(5, 4)}),
    (_keyword_only_default, (torch.randn(5, 4), 3.0), {}),
])
def test_fused_refuses_the_calls_the_models_refuse(forward, args, kwargs):
    """``fused(x)`` for ``forward(self, *, x)`` ran fused, though each model raises
    TypeError for ``m(x)``: a wrong script worked only fused."""
    models = _models_with_forward(forward)
    with pytest.raises(TypeError):
        models[0](*args, **kwargs)
    fused = hftc.fuse(copy.deepcopy(models))
    with pytest.raises(FusionArgumentError, match="refuses this call"):
        fused(*args, **kwargs)


@pytest.mark.parametrize("forward, args, kwargs", [
    (_keyword_only, (), {"x": torch.randn(5, 4)}),
    (_positional_only, (torch.randn(5, 4),), {}),
    (_keyword_only_default, (torch.randn(5, 4),), {"scale": 3.0}),
    (_keyword_only_default, (torch.randn(5, 4),), {}),
])
def test_fused_takes_the_calls_the_models_take(forward, args, kwargs):
    models = _models_with_forward(forward, n=3)
    fused = hftc.fuse(copy.deepcopy(models))
    out = fused(*args, **kwargs)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(*args, **kwargs))


def test_unchecked_program_is_not_reported_checked():
    """With check=False the strategy said "checked; not timed", the check line "not
    checked": the report contradicted itself."""
    models = [nn.Linear(4, 3) for _ in range(2)]
    fused = hftc.fuse(models, check=False, strategy="auto")
    fused(torch.randn(2, 4))
    assert fused.plan.reason == strategy.NOT_TIMED_UNCHECKED
    assert "(checked;" not in str(fused.last_program().report)
    checked = hftc.fuse([nn.Linear(4, 3) for _ in range(2)], strategy="auto")
    checked(torch.randn(2, 4))
    assert checked.plan.reason == strategy.NOT_TIMED


class _SkipConfig:
    def __init__(self, use_skip):
        self.use_skip = use_skip


class _ConfiguredBlock(nn.Module):
    def __init__(self, use_skip):
        super().__init__()
        self.cfg = _SkipConfig(use_skip)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if self.cfg.use_skip:
            h = h + x
        return h


@pytest.mark.parametrize("flags", [(False, True), (True, False)])
def test_mismatch_at_the_output_names_both_lines(flags):
    """A config flag that adds an op at the end of forward: the model without it was
    "at a line not known" (the output node had no line); both sides name the user's
    file:line now, the output its ``return``."""
    import inspect

    with pytest.raises(hftc.errors.MismatchError) as caught:
        hftc.fuse([_ConfiguredBlock(flag) for flag in flags])(torch.randn(2, 4))
    message = str(caught.value)
    assert "not known" not in message
    lines, start = inspect.getsourcelines(_ConfiguredBlock.forward)
    skip = start + next(k for k, ln in enumerate(lines) if "h = h + x" in ln)
    ret = start + next(k for k, ln in enumerate(lines) if "return h" in ln)
    assert f"test_hunt4_fusion.py:{skip} in forward: `h = h + x`" in message
    assert f"test_hunt4_fusion.py:{ret} in forward: `return h`" in message


class _NormedBlock(nn.Module):
    def __init__(self, use_norm):
        super().__init__()
        self.use_norm = use_norm
        self.fc, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        h = self.fc(x)
        if self.use_norm:
            h = self.norm(h)
        return h


def test_mismatch_of_a_module_against_the_output_names_both_lines():
    """A flag that adds a module at the end: no line was named for either side."""
    import inspect

    with pytest.raises(hftc.errors.MismatchError) as caught:
        hftc.fuse([_NormedBlock(False), _NormedBlock(True)])
    lines, start = inspect.getsourcelines(_NormedBlock.forward)
    norm = start + next(k for k, ln in enumerate(lines) if "h = self.norm(h)" in ln)
    ret = start + next(k for k, ln in enumerate(lines) if "return h" in ln)
    assert f"test_hunt4_fusion.py:{norm} in forward: `h = self.norm(h)`" in str(caught.value)
    assert f"test_hunt4_fusion.py:{ret} in forward: `return h`" in str(caught.value)


# --------------------------------------------------------------------------- per-model numbers

_NUMBER_OPS = {
    "where_other": lambda m, h: torch.where(h > 0, h, m.value),
    "where_input": lambda m, h: torch.where(h > 0, m.value, h),
    "masked_fill": lambda m, h: h.masked_fill(h < 0, m.value),
    "torch_masked_fill": lambda m, h: torch.masked_fill(h, h < 0, m.value),
    "full_like": lambda m, h: h * torch.full_like(h, m.value),
    "rsub": lambda m, h: torch.rsub(h, m.value),
    "addcmul": lambda m, h: torch.addcmul(h, h, h.tanh(), value=m.value),
    "addcmul_method": lambda m, h: h.addcmul(h.sigmoid(), h, value=m.value),
    "addcdiv": lambda m, h: torch.addcdiv(h, h, h.exp(), value=m.value),
    "normalize": lambda m, h: F.normalize(h * 1e-3, dim=-1, eps=m.value * 1e-3),
    "remainder": lambda m, h: torch.remainder(h, m.value + 0.5),
    "fmod": lambda m, h: h.fmod(m.value + 0.5),
    "xlogy": lambda m, h: torch.xlogy(m.value, h.abs() + 1),
}


class _NumberModel(nn.Module):
    def __init__(self, op, value):
        super().__init__()
        self.op, self.value = op, value
        self.fc = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(_NUMBER_OPS[self.op](self, self.fc(x)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("op", sorted(_NUMBER_OPS))
def test_per_model_numbers_fuse_each_models_own(op, n, dtype):
    """A number argument that differs per model (``torch.where(c, x, self.value)``,
    ``masked_fill``, ``full_like``, ``rsub``, ``addcmul(value=)``, ``F.normalize(eps=)``)
    was refused with a MismatchError; it fuses now, each model with its own value, forward
    and backward equal to the plain loop."""
    torch.manual_seed(0)
    values = [0.3, 0.7, 1.1, 0.05, 0.9][:n]
    models = [_NumberModel(op, v).to(dtype) for v in values]
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(4, 6, dtype=dtype)
    out = fused(x)
    assert "0 run model by model" in str(fused.last_program().report)
    out.pow(2).sum().backward()
    for i, m in enumerate(models):
        expected = m(x)
        expected.pow(2).sum().backward()
        torch.testing.assert_close(out[i], expected)
        torch.testing.assert_close(fused.fc.weight.grad[i], m.fc.weight.grad)
        torch.testing.assert_close(fused.head.weight.grad[i], m.head.weight.grad)


# --------------------------------------------------------------------------- padded widths


class _Wide(nn.Module):
    """fc1 -> relu or tanh (the user's choice, by a string) -> softmax(-1) -> fc2."""

    def __init__(self, width, act="relu", spelling="branch"):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, width), nn.Linear(width, 3)
        self.act, self.spelling = act, spelling
        self.fn = {"relu": F.relu, "tanh": torch.tanh, "leaky": F.leaky_relu}[act]
        if spelling == "module":
            self.activation = {"relu": nn.ReLU(), "tanh": nn.Tanh(), "leaky": nn.LeakyReLU()}[act]

    def forward(self, x):
        h = self.fc1(x)
        if self.spelling == "module":
            h = self.activation(h)
        elif self.spelling == "branch":
            h = h.relu() if self.act == "relu" else h.tanh()
        else:
            h = self.fn(h)
        return self.fc2(h.softmax(-1))


def _check_padded(fused, models, x):
    out = fused(x)
    out.pow(2).sum().backward()
    for i, m in enumerate(models):
        expected = m(x)
        expected.pow(2).sum().backward()
        torch.testing.assert_close(out[i], expected)
        width = m.fc1.out_features  # (the padded rows' gradients aside)
        torch.testing.assert_close(fused.fc1.weight.grad[i, :width], m.fc1.weight.grad)
        torch.testing.assert_close(fused.fc2.weight.grad[i, :, :width], m.fc2.weight.grad)


@pytest.mark.parametrize("spelling", ["branch", "function"])
@pytest.mark.parametrize("grouped", [False, True])
def test_padded_widths_with_differing_activations(spelling, grouped):
    """``W(8, "relu")`` and ``W(6, "tanh")`` with a softmax over the padded width:
    fuse_groups(pad_widths=True) formed one array of them, which then refused its first
    call (the real-units rewrite wanted one graph) and advised fuse_groups; each model's
    own activation is now kept in the rewritten forward, and both spellings fuse exactly."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        acts = ["relu", "tanh", "leaky" if spelling == "function" else "relu"]
        models = [_Wide(w, a, spelling) for w, a in zip((8, 6, 5), acts)]
        x = torch.randn(5, 4)
        if not grouped:
            _check_padded(hftc.fuse(copy.deepcopy(models), pad_widths=True), models, x)
            return
        groups = hftc.fuse_groups(copy.deepcopy(models), pad_widths=True)
        assert [0, 1] == groups[0][1][:2]  # relu and tanh in one array
        for fused, indices in groups:
            _check_padded(fused, [models[i] for i in indices], x)
    finally:
        torch.set_default_dtype(torch.float32)


def test_padded_widths_with_differing_activation_modules():
    """nn.ReLU in one model, nn.Tanh in another: pad_widths=True refused them at
    hftc.fuse ("pads widths only"), though without padding they fuse as differing ops."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        models = [_Wide(w, a, "module") for w, a in zip((8, 6, 5), ("relu", "tanh", "leaky"))]
        _check_padded(hftc.fuse(copy.deepcopy(models), pad_widths=True), models,
                      torch.randn(5, 4))
    finally:
        torch.set_default_dtype(torch.float32)
