"""hftc.compile_step's eager step with the models in order: each model's forward, loss and
backward in turn, then one fused optimizer step.

Against N stock models trained one after another with stock torch.optim, bit for bit
(per-model learning rates, a scheduler, dropout, batch norm's running statistics, a frozen
layer), float64 and float32, N = 1-3; the choice between it and the fused step (the rule on
given times, and a whole run from an empty strategy cache); and what keeps the fused step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc
from hftc.lowering.strategy import ONE_BY_ONE, StepOrder

LRS = [1e-2, 3e-2, 5e-2]


class SmallConvNet(nn.Module):
    """Conv, batch norm, dropout, a frozen linear and a trained head: what a step in order
    must keep as the serial loop does (running statistics, random draws, no gradient)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.frozen = nn.Linear(4 * 3 * 3, 16)
        self.frozen.requires_grad_(False)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, 5)
        self.unused = nn.Linear(3, 3)  # no gradient in any model: .grad stays None

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return F.log_softmax(self.head(self.drop(F.relu(self.frozen(x.flatten(1))))), dim=1)


def _batches(steps: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 1, 8, 8, generator=g, dtype=dtype),
             torch.randint(0, 5, (8,), generator=g)) for _ in range(steps)]


def _models(n: int, dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    return [SmallConvNet().to(dtype) for _ in range(n)]


def _serial(models, batches, lrs):
    """N stock models, N stock Adams with a StepLR each, one after another."""
    models = copy.deepcopy(models)
    opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=lr)
            for m, lr in zip(models, lrs)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    losses = []
    for k, (x, y) in enumerate(batches):
        torch.manual_seed(100 + k)  # the dropout draws, model after model
        row = []
        for m, opt in zip(models, opts):
            opt.zero_grad()
            loss = F.nll_loss(m(x), y)
            loss.backward()
            opt.step()
            row.append(loss.detach())
        for s in scheds:
            s.step()
        losses.append(torch.stack(row))
    return models, losses


def _stepped(models, batches, lrs, **fuse_options):
    fused = hftc.fuse(copy.deepcopy(models), **fuse_options)
    opt = hftc.optim.Adam([p for p in fused.parameters() if p.requires_grad], lr=lrs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = hftc.compile_step(fused, F.nll_loss, opt)
    losses = []
    for k, (x, y) in enumerate(batches):
        torch.manual_seed(100 + k)
        losses.append(step(x, y))
        sched.step()
    return fused, losses, step


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_models_in_order_train_as_the_serial_loop_bit_for_bit(dtype, n):
    models, batches, lrs = _models(n, dtype), _batches(5, dtype), LRS[:n]
    fused, losses, step = _stepped(models, batches, lrs, strategy="model_loop")
    # the first step runs the fused module's way (its program compiles), the rest in order
    assert step.order == StepOrder(ONE_BY_ONE, "the fused module runs the models one by one")
    serial, serial_losses = _serial(models, batches, lrs)
    for k, (got, want) in enumerate(zip(losses, serial_losses)):
        assert got.shape == (n,) and not got.requires_grad
        if k == 0:  # hftc.per_model's loss over the stacked outputs: sums in its own order
            torch.testing.assert_close(got, want)
        else:
            assert torch.equal(got, want), k
    state = fused.state_dict()
    for i, m in enumerate(serial):
        for name, t in m.state_dict().items():  # running statistics and batches tracked too
            assert torch.equal(state[name][i], t), (i, name)
        for name, p in m.named_parameters():
            got = fused.get_parameter(name).grad
            if p.grad is None:
                assert got is None, name  # the frozen and the unused layers
            else:
                assert torch.equal(got[i], p.grad), (i, name)


def test_a_timed_fused_module_s_choice_decides_the_step_order(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))  # nothing chosen before
    import hftc.lowering.timing as timing

    monkeypatch.setattr(timing, "_MEMORY", {})

    class Plain(nn.Module):  # no random draws: the fused module times its own calls
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 32), nn.Linear(32, 4)

        def forward(self, x):
            return F.log_softmax(self.fc2(torch.tanh(self.fc1(x))), dim=1)

    torch.manual_seed(0)
    models = [Plain().double() for _ in LRS]
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 6, generator=g, dtype=torch.float64),
                torch.randint(0, 4, (16,), generator=g)) for _ in range(70)]
    fused, losses, step = _stepped(models, batches, LRS, strategy="timed")
    assert fused.plan.reason != "timing the first calls"
    # the step times nothing of its own: it follows the fused module's one choice
    loop = fused.plan.chosen == "model_loop"
    assert step.order is not None and step.order.chosen == ("in_order" if loop else "fused")
    assert step.order.reason == ("the fused module runs the models one by one" if loop
                                 else f"the fused module's choice: {fused.plan}")
    # each step ran one way or the other: both the models' own answers
    serial, serial_losses = _serial(models, batches, LRS)
    for got, want in zip(losses, serial_losses):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    state = fused.state_dict()
    for i, m in enumerate(serial):
        for name, p in m.named_parameters():
            torch.testing.assert_close(state[name][i], p.detach(), rtol=1e-9, atol=1e-12)


def test_what_keeps_the_fused_step():
    models, batches = _models(3, torch.float32), _batches(3, torch.float32)
    fused, _, step = _stepped(models, batches, LRS, strategy="fused")
    assert step.order is None  # strategy="fused": nothing to choose

    fused = hftc.fuse(copy.deepcopy(models), strategy="model_loop")
    seen = []
    fused.head.weight.register_hook(lambda g: seen.append(g.shape))
    opt = hftc.optim.Adam([p for p in fused.parameters() if p.requires_grad], lr=LRS)
    step = hftc.compile_step(fused, F.nll_loss, opt)
    for x, y in batches:
        step(x, y)
    # the leaves of a step in order would take the gradients: the hook would never fire
    assert step.order == StepOrder("fused", "hooks on the fused parameters")
    assert seen == [(3, 5, 16)] * 3

    summed = hftc.compile_step(
        fused, lambda out, y: hftc.per_model(F.nll_loss)(out, y), opt, per_model_loss=False)
    for x, y in batches:
        summed(x, y)
    assert summed.order is None  # a loss of the N outputs: no model's own loss to run


def test_a_gradient_already_there_is_added_to_as_backward_does():
    models, ((x, y),) = _models(2, torch.float64), _batches(1, torch.float64)
    fused = hftc.fuse(copy.deepcopy(models), strategy="model_loop").eval()
    loop = fused._models_one_by_one()
    values, batched = fused._inputs((x,), {})
    for _ in range(2):  # no zero_grad between: the second backward adds
        losses = loop.forward_backward(fused, values, batched, lambda out: F.nll_loss(out, y))
    for i, m in enumerate(models):
        m.eval()
        for _ in range(2):
            F.nll_loss(m(x), y).backward()
        assert torch.equal(losses[i], F.nll_loss(m(x), y).detach())
        for name, p in m.named_parameters():
            got = fused.get_parameter(name).grad
            assert (got is None) if p.grad is None else torch.equal(got[i], p.grad), name


class TwoHeads(nn.Module):
    """PointNet-style: log-probabilities and a transform a regularizer reads."""

    def __init__(self):
        super().__init__()
        self.fc, self.head, self.transform = nn.Linear(64, 16), nn.Linear(16, 5), nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.fc(x.flatten(1)))
        return F.log_softmax(self.head(h), dim=1), self.transform(h).view(-1, 2, 2)


def _two_heads_loss(out, y):
    log_probs, transform = out
    return F.nll_loss(log_probs, y) + 1e-3 * transform.pow(2).mean()


def test_a_model_of_several_outputs_steps_in_order_as_the_serial_loop():
    torch.manual_seed(0)
    models, batches = [TwoHeads().double() for _ in LRS], _batches(4, torch.float64)
    fused = hftc.fuse(copy.deepcopy(models), strategy="model_loop")
    step = hftc.compile_step(fused, _two_heads_loss, hftc.optim.Adam(fused.parameters(), lr=LRS))
    serial = copy.deepcopy(models)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(serial, LRS)]
    for k, (x, y) in enumerate(batches):
        got = step(x, y)
        for i, (m, opt) in enumerate(zip(serial, opts)):
            opt.zero_grad()
            loss = _two_heads_loss(m(x), y)
            loss.backward()
            opt.step()
            if k == 0:  # the first step is the fused module's: hftc.per_model over its output
                torch.testing.assert_close(got[i], loss.detach())
            else:
                assert torch.equal(got[i], loss.detach()), (k, i)
    assert step.order.chosen == ONE_BY_ONE
    for i, m in enumerate(serial):
        for name, p in m.named_parameters():
            assert torch.equal(fused.state_dict()[name][i], p.detach()), (i, name)
