"""hftc.optim.slicing: a fused optimizer split back into stock ones, and fused again, exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.optim.slicing import fused_param_names, load_model_slice


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


# (stock class, per-model keyword lists): the flags that change which buffers stock keeps.
CASES = [
    (torch.optim.SGD, [dict(lr=0.1, momentum=0.9), dict(lr=0.05), dict(lr=0.2, momentum=0.5, nesterov=True)]),
    (torch.optim.Adam, [dict(lr=1e-2), dict(lr=3e-3, amsgrad=True), dict(lr=1e-3, weight_decay=0.1)]),
    (torch.optim.AdamW, [dict(lr=1e-2), dict(lr=3e-3, betas=(0.8, 0.9)), dict(lr=1e-3, amsgrad=True)]),
    (torch.optim.RMSprop, [dict(lr=1e-2), dict(lr=1e-3, momentum=0.9), dict(lr=1e-3, centered=True)]),
    (torch.optim.Adagrad, [dict(lr=1e-1), dict(lr=1e-2, initial_accumulator_value=0.1), dict(lr=0.05)]),
]


def _steps(fused, opt, xs, y):
    for x in xs:
        opt.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()


@pytest.mark.parametrize("cls,kwargs", CASES, ids=[c.__name__ for c, _ in CASES])
def test_split_and_refuse_is_exact(cls, kwargs):
    torch.manual_seed(0)
    models = [Net().double() for _ in kwargs]
    xs = [torch.randn(8, 5, dtype=torch.float64) for _ in range(6)]
    y = torch.randint(0, 3, (8,))

    def fresh():
        ms = copy.deepcopy(models)
        fused = hftc.fuse(ms)
        return fused, hftc.optim.fuse_optimizers(fused, [cls(m.parameters(), **kw)
                                                         for m, kw in zip(ms, kwargs)])

    ref, ref_opt = fresh()
    _steps(ref, ref_opt, xs, y)

    fused, opt = fresh()
    _steps(fused, opt, xs[:3], y)
    # Split into stock optimizers on the unfused models, in a new order, and fuse again.
    order = [2, 0, 1]
    names = fused_param_names(fused, opt)
    state = opt.state_dict()
    unfused = fused.unfuse()
    stock = [load_model_slice(state, names, i, cls(unfused[i].parameters(), **kwargs[i]),
                              unfused[i]) for i in range(len(kwargs))]
    again = hftc.fuse([unfused[i] for i in order])
    again_opt = hftc.optim.fuse_optimizers(again, [stock[i] for i in order])
    _steps(again, again_opt, xs[3:], y)
    for j, i in enumerate(order):
        for k, v in ref.model_state_dict(i).items():
            torch.testing.assert_close(again.model_state_dict(j)[k], v, rtol=0, atol=1e-12)

    # A stock optimizer from the split continues its model alone like the fused one did.
    alone = unfused[1]
    torch.manual_seed(0)
    for x in xs[3:]:
        stock[1].zero_grad()
        F.cross_entropy(alone(x), y).backward()
        stock[1].step()
    for k, v in ref.model_state_dict(1).items():
        torch.testing.assert_close(alone.state_dict()[k], v, rtol=0, atol=1e-9)


def test_errors_name_the_problem():
    fused = hftc.fuse([Net(), Net()])
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2], momentum=0.9)
    names = fused_param_names(fused, opt)
    other = Net()
    with pytest.raises(IndexError, match="out of range"):
        load_model_slice(opt.state_dict(), names, 5, torch.optim.SGD(other.parameters(), lr=1), other)
    half = torch.optim.SGD(list(other.parameters())[:1], lr=1)
    with pytest.raises(ValueError, match="not among"):
        load_model_slice(opt.state_dict(), names, 0, half, other)
