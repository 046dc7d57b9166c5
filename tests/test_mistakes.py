"""A user's first mistakes with a fused module get a message naming the fix (issue 46
item 1): a stock optimizer given one value per model, and a fallback's warning at the
user's line naming the op."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import hftc
from hftc.errors import FusionTypeError


def _fused():
    torch.manual_seed(0)
    return hftc.fuse([nn.Linear(4, 2) for _ in range(3)])


@pytest.mark.parametrize("cls, kwargs, name", [
    (torch.optim.SGD, {"lr": [0.1, 0.2, 0.3]}, "lr"),
    (torch.optim.Adam, {"lr": [1e-3, 2e-3, 3e-3]}, "lr"),
    (torch.optim.AdamW, {"weight_decay": [0.0, 0.1, 0.2]}, "weight_decay"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": (0.9, 0.8, 0.0)}, "momentum"),
])
def test_a_stock_optimizer_given_one_value_per_model_names_hftc_optim(cls, kwargs, name):
    fused = _fused()
    with pytest.raises(FusionTypeError, match=rf"torch\.optim\.{cls.__name__} takes one "
                                              rf"{name} .*use hftc\.optim\.{cls.__name__}\("
                                              rf"fused\.parameters\(\), {name}=\[\.\.\.\]\)"):
        cls(fused.parameters(), **kwargs)
    with pytest.raises(FusionTypeError, match="hftc.optim.SGD"):
        torch.optim.SGD(fused.parameters(), [0.1, 0.2, 0.3])  # lr by position


def test_stock_optimizers_otherwise_run_as_torch_runs_them():
    fused = _fused()
    opt = torch.optim.Adam(fused.parameters(), lr=1e-3, betas=(0.8, 0.99))
    assert opt.defaults["betas"] == (0.8, 0.99)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own, untouched
        torch.optim.SGD(fused.parameters(), lr=-1.0)
    per_model = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3])
    assert per_model is not None


def test_a_fallback_warns_at_the_users_line_naming_the_op():
    class ScaledByItem(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * self.fc.weight.abs().max().item()

    torch.manual_seed(0)
    fused = hftc.fuse([ScaledByItem() for _ in range(2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        fused(torch.randn(3, 4))
    [warning] = [w for w in caught if issubclass(w.category, hftc.FusionWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert "`Tensor.item()` returned different Python values" in str(warning.message)
