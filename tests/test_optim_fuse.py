"""``fuse_optimizers``, and fused optimizers on modules made by ``hftc.fuse``.

Stock optimizers are built on the original models, some step alone first (a
different number of steps per model), then the models and optimizers are fused
and train on; each model must end where its stock optimizer alone takes it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from optim_helpers import (
    StackedModels,
    assert_all_match,
    make_batches,
    make_models,
    single_thread,  # noqa: F401  (autouse fixture)
    tolerance,
    train_fused,
    train_solo,
)

import hftc
import hftc.optim as ho

FUSERS = {"stacked": StackedModels, "hftc.fuse": hftc.fuse}

STOCK = {
    "sgd": (torch.optim.SGD, ho.SGD, [
        dict(lr=0.1, momentum=0.9), dict(lr=0.05), dict(lr=0.02, momentum=0.9, nesterov=True)]),
    "adam": (torch.optim.Adam, ho.Adam, [
        dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.99), amsgrad=True),
        dict(lr=1e-3, weight_decay=0.1)]),
    "adamw": (torch.optim.AdamW, ho.AdamW, [
        dict(lr=1e-2), dict(lr=3e-2, weight_decay=0.1), dict(lr=1e-3, amsgrad=True)]),
    "rmsprop": (torch.optim.RMSprop, ho.RMSprop, [
        dict(lr=1e-2, momentum=0.9), dict(lr=3e-3, centered=True), dict(lr=1e-3)]),
    "adagrad": (torch.optim.Adagrad, ho.Adagrad, [
        dict(lr=1e-2), dict(lr=3e-2, lr_decay=0.01, initial_accumulator_value=0.1),
        dict(lr=1e-1)]),
    "adadelta": (torch.optim.Adadelta, ho.Adadelta, [
        dict(lr=1.0), dict(lr=0.5, rho=0.8, weight_decay=0.1), dict(lr=0.1, maximize=True)]),
    "adamax": (torch.optim.Adamax, ho.Adamax, [
        dict(lr=2e-3), dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        dict(lr=5e-3, maximize=True)]),
    # Each model's foreach travels with it (stock NAdam's and RAdam's two updates round
    # differently).
    "nadam": (torch.optim.NAdam, ho.NAdam, [
        dict(lr=2e-3), dict(lr=1e-2, momentum_decay=1e-2, weight_decay=0.1, foreach=True),
        dict(lr=5e-3, weight_decay=0.1, decoupled_weight_decay=True)]),
    "radam": (torch.optim.RAdam, ho.RAdam, [
        dict(lr=1e-3, foreach=True), dict(lr=1e-2, betas=(0.9, 0.5), weight_decay=0.1),
        dict(lr=5e-3, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)]),
}


def continue_fused(case: str, fuser, pre_steps: list[int], dtype=torch.float64, steps=5):
    stock_cls, fused_cls, configs = STOCK[case]
    n = len(configs)
    models = make_models(n, dtype)
    opts = [stock_cls(m.parameters(), **c) for m, c in zip(models, configs)]
    warmup = make_batches(max(pre_steps) or 1, dtype, seed=99)
    for m, o, k in zip(models, opts, pre_steps):
        train_solo(m, o, warmup[:k])
    fused = fuser(models)
    opt = ho.fuse_optimizers(fused, opts)
    assert type(opt) is fused_cls
    batches = make_batches(steps, dtype)
    train_fused(fused, opt, batches)
    for m, o in zip(models, opts):  # the originals carry on alone
        train_solo(m, o, batches)
    return fused, opt, models


@pytest.mark.parametrize("fuser", sorted(FUSERS))
@pytest.mark.parametrize("case", sorted(STOCK))
def test_fused_from_stock_optimizers_that_already_stepped(case, fuser):
    fused, opt, models = continue_fused(case, FUSERS[fuser], pre_steps=[3, 1, 0])
    assert_all_match(fused, models, 1e-9)
    if "step" in opt.state[next(fused.parameters())]:
        assert opt.state[next(fused.parameters())]["step"].tolist() == [8.0, 6.0, 5.0]


@pytest.mark.parametrize("case", sorted(STOCK))
def test_fused_from_fresh_stock_optimizers(case):
    fused, opt, models = continue_fused(case, StackedModels, pre_steps=[0, 0, 0])
    assert_all_match(fused, models, 1e-9)
    _, _, configs = STOCK[case]
    for group, config in zip(opt.param_groups, configs):
        for key, value in config.items():
            assert group[key] == value, key


def test_float32_through_hftc_fuse():
    fused, _, models = continue_fused("adam", hftc.fuse, pre_steps=[2, 2, 0],
                                      dtype=torch.float32)
    assert_all_match(fused, models, tolerance(torch.float32))


def test_scheduler_keys_are_carried_over():
    models = make_models(2)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m, lr in zip(models, [0.1, 0.2])]
    for o in opts:
        torch.optim.lr_scheduler.StepLR(o, step_size=2)
    opt = ho.fuse_optimizers(StackedModels(models), opts)
    assert [g["initial_lr"] for g in opt.param_groups] == [0.1, 0.2]
    assert opt.param_groups[0]["foreach"] is None  # the stock key, as stock keeps it


def test_errors_name_what_is_wrong():
    models = make_models(3)
    fused = StackedModels(models)
    sgd = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    with pytest.raises(ValueError, match="got 2 optimizers for 3 fused models"):
        ho.fuse_optimizers(fused, sgd[:2])
    # Mixed classes fuse (tests/test_optim_mixed.py); an unsupported one among them does not.
    mixed = sgd[:2] + [torch.optim.Rprop(models[2].parameters())]
    with pytest.raises(TypeError, match="does not support Rprop: optimizers\\[2\\] \\(model 2\\)"):
        ho.fuse_optimizers(fused, mixed)
    with pytest.raises(TypeError, match="does not support Rprop"):
        ho.fuse_optimizers(fused, [torch.optim.Rprop(m.parameters()) for m in models])
    swapped = [sgd[0], torch.optim.SGD(models[0].parameters(), lr=0.1), sgd[2]]
    with pytest.raises(ValueError, match="optimizers\\[1\\] holds a parameter .* not a "
                                         "parameter of model 1"):
        ho.fuse_optimizers(fused, swapped)
    two_groups = [torch.optim.SGD([{"params": m[0].parameters()},
                                   {"params": m[3].parameters(), "lr": 0.01}], lr=0.1)
                  for m in models]
    with pytest.raises(ValueError, match="optimizers\\[0\\] has 1 param groups and "
                                         "optimizers\\[1\\] 2"):
        ho.fuse_optimizers(fused, [sgd[0], two_groups[1], sgd[2]])
    with pytest.raises(ValueError, match="optimizers\\[0\\]'s param groups have different "
                                         "learning rates"):
        ho.fuse_optimizers(fused, two_groups)
    subset = torch.optim.SGD(models[1][3].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimize different parameters"):
        ho.fuse_optimizers(fused, [sgd[0], subset, sgd[2]])
    with pytest.raises(TypeError, match="needs a fused module"):
        ho.fuse_optimizers(models[0], sgd)


def test_hftc_fuse_with_per_model_adam_and_unfuse():
    # The public contract end to end: fuse, train with hftc.optim, unfuse.
    dtype = torch.float64
    lrs = [1e-3, 3e-3, 1e-2]
    models = make_models(3, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models)
    opt = ho.Adam(fused.parameters(), lr=lrs, weight_decay=0.0)
    batches = make_batches(6, dtype)
    train_fused(fused, opt, batches)
    for solo, lr in zip(solos, lrs):
        train_solo(solo, torch.optim.Adam(solo.parameters(), lr=lr), batches)
    for i, (model, solo) in enumerate(zip(fused.unfuse(), solos)):
        for (name, p), q in zip(model.named_parameters(), solo.parameters()):
            err = (p - q).abs().max() / q.abs().max()
            assert err <= 1e-9, (i, name, err.item())


@pytest.mark.parametrize("fuser", sorted(FUSERS))
def test_stock_optimizers_with_param_groups(fuser):
    """Each model's stock AdamW over two groups (weight decay on weights, none on biases,
    as nanoGPT builds it), some already stepped: the fused optimizer carries each group's
    values and state on, and every model equals its stock optimizer carrying on alone."""
    models = make_models(3)
    decay = [0.1, 0.0, 0.3]

    def grouped(m, wd, lr):
        named = list(m.named_parameters())
        return torch.optim.AdamW(
            [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": wd},
             {"params": [p for n, p in named if not n.endswith("weight")],
              "weight_decay": 0.0}], lr=lr)

    opts = [grouped(m, wd, lr) for m, wd, lr in zip(models, decay, [1e-2, 3e-2, 5e-3])]
    warmup = make_batches(3, seed=99)
    for m, o, k in zip(models, opts, [3, 1, 0]):
        train_solo(m, o, warmup[:k])
    fused = FUSERS[fuser](models)
    opt = ho.fuse_optimizers(fused, opts)
    batches = make_batches(4)
    train_fused(fused, opt, batches)
    for m, o in zip(models, opts):
        train_solo(m, o, batches)
    assert_all_match(fused, models, 1e-9)
    assert [g["weight_decay"] for g in opt.param_groups] == decay


@pytest.mark.parametrize("make", [
    lambda p: ho.SGD(p, lr=[0.1, 0.05], momentum=[0.9, 0.5], nesterov=True),
    lambda p: ho.Adam(p, lr=[1e-2, 3e-2], betas=[(0.9, 0.99), (0.8, 0.9)], amsgrad=True),
    lambda p: ho.AdamW(p, lr=[1e-2, 3e-2], weight_decay=[0.1, 0.0]),
    lambda p: ho.RMSprop(p, lr=[1e-2, 3e-3], momentum=0.9, centered=True),
    lambda p: ho.Adagrad(p, lr=[0.1, 0.2]),
    lambda p: ho.Adadelta(p, lr=[1.0, 0.5], rho=[0.9, 0.8], weight_decay=[0.0, 0.1]),
    lambda p: ho.Adamax(p, lr=[2e-3, 1e-2], betas=[(0.9, 0.999), (0.8, 0.99)]),
    lambda p: ho.NAdam(p, lr=[2e-3, 1e-2], momentum_decay=[4e-3, 1e-2],
                       decoupled_weight_decay=[False, True], weight_decay=0.1),
    lambda p: ho.RAdam(p, lr=[1e-3, 1e-2], betas=[(0.9, 0.999), (0.9, 0.5)], maximize=True),
], ids=["sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "radam"])
def test_unfuse_optimizers_continues_each_model_as_the_fused_one(make):
    """fused.unfuse() gave the models back, but their optimizers' state (momentum, Adam's
    moments) had no public way back: hftc.optim.unfuse_optimizers gives N stock optimizers
    that continue each model exactly as the fused optimizer does."""
    torch.manual_seed(0)
    fused = hftc.fuse([torch.nn.Linear(4, 3).double() for _ in range(2)])
    opt = make(fused.parameters())
    x = torch.randn(6, 4, dtype=torch.float64)

    def step(model, optimizer, weight):
        optimizer.zero_grad()
        (weight * model(x) ** 2).sum().backward()
        optimizer.step()

    for _ in range(2):
        step(fused, opt, torch.tensor([1.0, 2.0], dtype=torch.float64).view(2, 1, 1))
    models = fused.unfuse()
    stock = ho.unfuse_optimizers(fused, opt, models)
    assert [type(o).__name__ for o in stock] == [type(opt).__name__] * 2
    for _ in range(2):
        step(fused, opt, torch.tensor([1.0, 2.0], dtype=torch.float64).view(2, 1, 1))
        for i, (m, o) in enumerate(zip(models, stock)):
            step(m, o, i + 1.0)
    for i, m in enumerate(models):
        torch.testing.assert_close(m.weight, fused.weight[i], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(m.bias, fused.bias[i], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", ["adadelta", "adamax", "nadam", "radam"])
def test_unfuse_then_fuse_optimizers_continues_bit_for_bit(case):
    """fused optimizer -> unfuse_optimizers -> N stock optimizers (stock's state keys,
    each model's foreach) -> fuse_optimizers -> fused again: the round trip changes
    nothing, past RAdam's first rectified step (6) and with NAdam's mu_product."""
    stock_cls, fused_cls, configs = STOCK[case]
    models = make_models(len(configs))
    fused = StackedModels(models)
    stocks = [stock_cls(m.parameters(), **c) for m, c in zip(models, configs)]
    opt = ho.fuse_optimizers(fused, stocks)
    twin = copy.deepcopy(fused)  # trains on uninterrupted
    twin_opt = ho.fuse_optimizers(twin, [stock_cls(m.parameters(), **c)
                                         for m, c in zip(models, configs)])
    batches = make_batches(10)
    train_fused(fused, opt, batches[:7])
    plain = fused.unfuse()
    back = ho.unfuse_optimizers(fused, opt, plain)
    for i, (stock, config) in enumerate(zip(back, configs)):
        assert type(stock) is stock_cls
        assert stock.param_groups[0]["foreach"] == config.get("foreach"), i
        p0 = next(plain[i].parameters())
        assert set(stock.state[p0]) == {
            "adadelta": {"step", "square_avg", "acc_delta"},
            "adamax": {"step", "exp_avg", "exp_inf"},
            "nadam": {"step", "mu_product", "exp_avg", "exp_avg_sq"},
            "radam": {"step", "exp_avg", "exp_avg_sq"}}[case]
        assert stock.state[p0]["step"].item() == 7.0
    again = StackedModels(plain)
    opt_again = ho.fuse_optimizers(again, back)
    train_fused(again, opt_again, batches[7:])
    train_fused(twin, twin_opt, batches)
    for (name, p), q in zip(twin.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name


def test_fused_from_resumed_stock_nadams_keeps_their_float64_mu_product():
    # Stock NAdam's load_state_dict casts mu_product to the parameters' dtype (float64
    # here, the default dtype float32): fuse_optimizers widens the fused one to it, so
    # each model goes on multiplying in stock's dtype.
    configs = STOCK["nadam"][2]
    models = make_models(len(configs))
    opts = [torch.optim.NAdam(m.parameters(), **c) for m, c in zip(models, configs)]
    for m, o in zip(models, opts):
        train_solo(m, o, make_batches(2, seed=99))
    resumed = [torch.optim.NAdam(m.parameters(), **c) for m, c in zip(models, configs)]
    for o, r in zip(opts, resumed):
        r.load_state_dict(copy.deepcopy(o.state_dict()))
    p0 = next(models[0].parameters())
    assert resumed[0].state[p0]["mu_product"].dtype == torch.float64
    fused = StackedModels(models)
    opt = ho.fuse_optimizers(fused, resumed)
    assert opt.state[next(fused.parameters())]["mu_product"].dtype == torch.float64
    batches = make_batches(5)
    train_fused(fused, opt, batches)
    for m, o in zip(models, resumed):
        train_solo(m, o, batches)
    params = dict(fused.named_parameters())
    for i, m in enumerate(models):
        for name, p in m.named_parameters():
            assert torch.equal(params[name][i], p), (i, name)


class MnistNet(torch.nn.Module):
    """pytorch/examples' mnist/main.py Net, narrower (1x10x10 inputs)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3, 1)
        self.conv2 = torch.nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = torch.nn.Dropout(0.25)
        self.dropout2 = torch.nn.Dropout(0.5)
        self.fc1 = torch.nn.Linear(72, 16)
        self.fc2 = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.relu(self.conv1(x))
        x = torch.nn.functional.relu(self.conv2(x))
        x = torch.nn.functional.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(torch.nn.functional.relu(self.fc1(x)))
        return torch.nn.functional.log_softmax(self.fc2(x), dim=1)


def test_mnist_example_with_adadelta_step_lr_and_nll_loss_per_model():
    """pytorch/examples' MNIST recipe for N models at once: hftc.fuse, Adadelta with each
    model's lr, StepLR(step_size=1, gamma=0.7), F.nll_loss per model for training and
    with reduction="sum" for the test loss; each model as its stock loop trains it.
    (Eval mode: dropout's draws are the fused model's own, not the loop's.)"""
    F = torch.nn.functional
    dtype, lrs = torch.float64, [1.0, 0.5, 0.1]
    torch.manual_seed(0)
    models = [MnistNet().to(dtype).eval() for _ in lrs]
    solos = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models)
    opt = ho.Adadelta(fused.parameters(), lr=lrs)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 1, 10, 10, generator=g, dtype=dtype),
                torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    for x, y in batches:
        opt.zero_grad()
        hftc.per_model(F.nll_loss)(fused(x), y).sum().backward()
        opt.step()
        scheduler.step()
    stock_lrs = []
    for solo, lr in zip(solos, lrs):
        stock = torch.optim.Adadelta(solo.parameters(), lr=lr)
        stock_scheduler = torch.optim.lr_scheduler.StepLR(stock, step_size=1, gamma=0.7)
        for x, y in batches:
            stock.zero_grad()
            F.nll_loss(solo(x), y).backward()
            stock.step()
            stock_scheduler.step()
        stock_lrs.append(stock.param_groups[0]["lr"])
    assert [group["lr"] for group in opt.param_groups] == stock_lrs
    assert_all_match(fused, solos, 1e-9)
    x_test = torch.randn(32, 1, 10, 10, generator=g, dtype=dtype)
    y_test = torch.randint(0, 10, (32,), generator=g)
    with torch.no_grad():
        test_loss = hftc.per_model(F.nll_loss, reduction="sum")(fused(x_test), y_test)
        want = torch.stack([F.nll_loss(s(x_test), y_test, reduction="sum") for s in solos])
    torch.testing.assert_close(test_loss, want, rtol=1e-9, atol=0)
