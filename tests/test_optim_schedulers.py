"""Stock torch.optim.lr_scheduler classes on a fused optimizer: one schedule per model.

Each test schedules the fused optimizer with a stock scheduler (model i = param
group i) and each solo model's stock optimizer with the same scheduler built for
model i alone, then asserts equal learning-rate histories and equal weights.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from optim_helpers import (
    StackedModels,
    assert_all_match,
    make_batches,
    make_models,
    per_model_losses,
    single_thread,  # noqa: F401  (autouse fixture)
)
from test_optim import CASES, NEW_CASES, fused_kwargs
from torch.optim import lr_scheduler as sched

import hftc.optim as ho

DTYPE = torch.float64


def run(fused_cls, stock_cls, configs, make_fused_sched, make_solo_sched, steps=10,
        metrics=None, dtype=DTYPE):
    """Train fused and solo with schedules; return (fused, solos, fused lrs, solo lrs).

    ``metrics[k]`` (N values) is passed to the schedulers' ``step`` if given
    (ReduceLROnPlateau), else ``step()`` takes no argument.
    """
    n = len(configs)
    models = make_models(n, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = fused_cls(fused.parameters(), **fused_kwargs(stock_cls, configs))
    scheduler = make_fused_sched(opt)
    batches = make_batches(steps, dtype)
    fused_lrs = []
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        per_model_losses(fused, x, y).sum().backward()
        opt.step()
        scheduler.step(metrics[k]) if metrics is not None else scheduler.step()
        fused_lrs.append([g["lr"] for g in opt.param_groups])
    solo_lrs = []
    for i, (solo, config) in enumerate(zip(solos, configs)):
        solo_opt = stock_cls(solo.parameters(), **config)
        solo_sched = make_solo_sched(solo_opt, i)
        lrs = []
        for k, (x, y) in enumerate(batches):
            solo_opt.zero_grad()
            torch.nn.functional.cross_entropy(solo(x), y).backward()
            solo_opt.step()
            solo_sched.step(metrics[k][i]) if metrics is not None else solo_sched.step()
            lrs.append(solo_opt.param_groups[0]["lr"])
        solo_lrs.append(lrs)
    fused_lrs = [list(col) for col in zip(*fused_lrs)]  # [model][step]
    return fused, solos, fused_lrs, solo_lrs


def check(fused, solos, fused_lrs, solo_lrs):
    assert fused_lrs == solo_lrs
    assert len({tuple(lrs) for lrs in fused_lrs}) > 1, "the models' schedules should differ"
    assert_all_match(fused, solos, 1e-9)


SGD_CONFIGS = [dict(lr=0.1, momentum=0.9), dict(lr=0.05), dict(lr=0.02, momentum=0.5)]
ADAM_CONFIGS = [dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.99)), dict(lr=5e-3, amsgrad=True)]


def test_lambda_lr_with_one_lambda_per_model():
    lambdas = [lambda e: 0.9**e, lambda e: 1.0 / (1 + e), lambda e: 1.0 if e < 5 else 0.1]
    check(*run(ho.Adam, torch.optim.Adam, ADAM_CONFIGS,
               lambda opt: sched.LambdaLR(opt, lambdas),
               lambda opt, i: sched.LambdaLR(opt, lambdas[i])))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", NEW_CASES)
def test_per_model_schedules_of_adadelta_adamax_nadam_radam_are_stocks_bit_for_bit(case, dtype):
    # Adadelta with StepLR(step_size=1, gamma=0.7): pytorch/examples' MNIST and siamese
    # scripts (each model its own lr); the others with one LambdaLR lambda per model.
    fused_cls, stock_cls, configs = CASES[case]
    if case == "adadelta":
        make_fused = lambda opt: sched.StepLR(opt, step_size=1, gamma=0.7)  # noqa: E731
        make_solo = lambda opt, i: sched.StepLR(opt, step_size=1, gamma=0.7)  # noqa: E731
    else:
        lambdas = [lambda e: 0.9**e, lambda e: 1.0 / (1 + e), lambda e: 1.0 if e < 5 else 0.1,
                   lambda e: min(1.0, (e + 1) / 4)][:len(configs)]
        make_fused = lambda opt: sched.LambdaLR(opt, lambdas)  # noqa: E731
        make_solo = lambda opt, i: sched.LambdaLR(opt, lambdas[i])  # noqa: E731
    fused, solos, fused_lrs, solo_lrs = run(fused_cls, stock_cls, configs, make_fused,
                                            make_solo, dtype=dtype)
    check(fused, solos, fused_lrs, solo_lrs)
    params = dict(fused.named_parameters())
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            assert torch.equal(params[name][i], p), (case, i, name)


def test_step_lr():
    check(*run(ho.SGD, torch.optim.SGD, SGD_CONFIGS,
               lambda opt: sched.StepLR(opt, step_size=3, gamma=0.5),
               lambda opt, i: sched.StepLR(opt, step_size=3, gamma=0.5)))


def test_multi_step_lr():
    check(*run(ho.RMSprop, torch.optim.RMSprop,
               [dict(lr=1e-2), dict(lr=3e-3, momentum=0.9), dict(lr=1e-3, centered=True)],
               lambda opt: sched.MultiStepLR(opt, milestones=[2, 5], gamma=0.3),
               lambda opt, i: sched.MultiStepLR(opt, milestones=[2, 5], gamma=0.3)))


def test_cosine_annealing_lr():
    check(*run(ho.AdamW, torch.optim.AdamW,
               [dict(lr=1e-2), dict(lr=3e-2, weight_decay=0.1), dict(lr=1e-3)],
               lambda opt: sched.CosineAnnealingLR(opt, T_max=6, eta_min=1e-4),
               lambda opt, i: sched.CosineAnnealingLR(opt, T_max=6, eta_min=1e-4)))


def test_one_cycle_lr_cycles_sgd_momentum_per_model():
    # Model 1 starts without momentum: OneCycleLR gives it one, and its buffer
    # starts as stock SGD starts it.
    max_lr, base_m, max_m = [0.1, 0.05, 0.2], [0.8, 0.85, 0.7], [0.9, 0.95, 0.99]
    fused, solos, fused_lrs, solo_lrs = run(
        ho.SGD, torch.optim.SGD, SGD_CONFIGS,
        lambda opt: sched.OneCycleLR(opt, max_lr=max_lr, total_steps=12,
                                     base_momentum=base_m, max_momentum=max_m),
        lambda opt, i: sched.OneCycleLR(opt, max_lr=max_lr[i], total_steps=12,
                                        base_momentum=base_m[i], max_momentum=max_m[i]))
    check(fused, solos, fused_lrs, solo_lrs)


def test_one_cycle_lr_cycles_adam_beta1_per_model():
    max_lr, base_m, max_m = [1e-2, 3e-2, 5e-3], [0.8, 0.85, 0.7], [0.9, 0.95, 0.99]
    fused_opts = []

    def make(opt):
        s = sched.OneCycleLR(opt, max_lr=max_lr, total_steps=12, base_momentum=base_m,
                             max_momentum=max_m, anneal_strategy="linear")
        fused_opts.append(opt)
        return s

    fused, solos, fused_lrs, solo_lrs = run(
        ho.Adam, torch.optim.Adam, ADAM_CONFIGS, make,
        lambda opt, i: sched.OneCycleLR(opt, max_lr=max_lr[i], total_steps=12,
                                        base_momentum=base_m[i], max_momentum=max_m[i],
                                        anneal_strategy="linear"))
    check(fused, solos, fused_lrs, solo_lrs)
    # The schedule moved each model's beta1 (and kept its beta2).
    groups = fused_opts[0].param_groups
    assert [g["betas"][1] for g in groups] == [0.999, 0.99, 0.999]
    assert len({g["betas"][0] for g in groups}) == 3


def test_sequential_lr():
    def make(opt):
        return sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.1, total_iters=3),
                                        sched.ExponentialLR(opt, gamma=0.9)], milestones=[3])

    check(*run(ho.Adagrad, torch.optim.Adagrad,
               [dict(lr=1e-2), dict(lr=3e-2, lr_decay=0.01), dict(lr=1e-1)],
               make, lambda opt, i: make(opt)))


# Per-model metric tables that plateau at different times.
PLATEAU_METRICS = [
    [1.0, 5.0, 2.0], [0.9, 5.0, 2.0], [0.9, 4.0, 2.0], [0.9, 4.0, 2.0], [0.9, 4.0, 1.0],
    [0.8, 4.0, 1.0], [0.8, 4.0, 1.0], [0.8, math.nan, 1.0], [0.8, math.nan, 1.0], [0.7, 3.0, 1.0],
]


def test_reduce_lr_on_plateau_is_per_model():
    patience = [1, 0, 2]
    fused, solos, fused_lrs, solo_lrs = run(
        ho.SGD, torch.optim.SGD, SGD_CONFIGS,
        lambda opt: ho.ReduceLROnPlateau(opt, factor=0.5, patience=patience),
        lambda opt, i: sched.ReduceLROnPlateau(opt, factor=0.5, patience=patience[i]),
        metrics=PLATEAU_METRICS)
    check(fused, solos, fused_lrs, solo_lrs)
    # Each model was reduced on its own (0.1 -> ..., 0.05 -> ..., 0.02 -> ...).
    assert all(lrs[-1] < lrs[0] for lrs in fused_lrs)


def test_reduce_lr_on_plateau_takes_a_tensor_of_metrics_and_checks_its_length():
    opt = ho.SGD(StackedModels(make_models(3)).parameters(), lr=[0.1, 0.2, 0.3])
    plateau = ho.ReduceLROnPlateau(opt, mode="max", patience=0, factor=0.5)
    plateau.step(torch.tensor([1.0, 1.0, 1.0]))
    plateau.step(torch.tensor([2.0, 0.5, 1.0]))
    assert plateau.get_last_lr() == [0.1, 0.1, 0.15]
    with pytest.raises(ValueError, match="got 2 metrics but there are 3 models"):
        plateau.step([1.0, 2.0])
    with pytest.raises(ValueError, match="patience has 2 values but there are 3 models"):
        ho.ReduceLROnPlateau(opt, patience=[1, 2])
    with pytest.raises(TypeError, match="not an Optimizer"):
        ho.ReduceLROnPlateau(object())


def test_stock_reduce_lr_on_plateau_with_one_metric_per_model_points_to_hftcs():
    """torch's ReduceLROnPlateau on a fused optimizer takes one metric for all models; given
    N it failed inside torch ('only one element tensors can be converted'). It says to use
    hftc.optim.ReduceLROnPlateau; one metric still reduces every model's rate together."""
    from hftc.errors import FusionArgumentError

    opt = ho.SGD(StackedModels(make_models(3)).parameters(), lr=[0.1, 0.2, 0.3])
    stock = sched.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    for metrics in ([1.0, 2.0, 3.0], torch.tensor([1.0, 2.0, 3.0])):
        with pytest.raises(FusionArgumentError, match="hftc.optim.ReduceLROnPlateau"):
            stock.step(metrics)
    stock.step(1.0)
    stock.step(torch.tensor(2.0))
    assert stock.get_last_lr() == [0.05, 0.1, 0.15]


@pytest.mark.parametrize("build, text", [
    (lambda opt: sched.OneCycleLR(opt, max_lr=[0.1, 0.2], total_steps=10),
     r"OneCycleLR on a fused optimizer of 3 models: max_lr must have the same length"),
    (lambda opt: sched.LambdaLR(opt, [lambda e: 1.0] * 2),
     r"LambdaLR on a fused optimizer of 3 models: Expected 3 lr_lambdas, but got 2"),
    (lambda opt: sched.CyclicLR(opt, base_lr=[0.01] * 4, max_lr=0.1),
     r"CyclicLR on a fused optimizer of 3 models"),
])
def test_a_scheduler_given_another_number_of_values_than_models_says_param_groups_are_models(
        build, text):
    """torch's "max_lr has 2 values, param_groups has 3" on a fused optimizer, a builtin
    ValueError that does not say a fused optimizer's param groups are its models: an
    hftc error that says so (still a ValueError, torch's message kept)."""
    from hftc.errors import FusionArgumentError

    opt = ho.SGD(StackedModels(make_models(3)).parameters(), lr=[0.1, 0.2, 0.3],
                 momentum=0.9)
    with pytest.raises(FusionArgumentError, match=text) as caught:
        build(opt)
    assert "param_groups[i] of a fused optimizer is model i: give one value per model " \
           "(3 values" in str(caught.value)
    sched.OneCycleLR(opt, max_lr=[0.1, 0.2, 0.3], total_steps=10)  # N values: torch's own
    stock = torch.optim.SGD(make_models(1)[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="max_lr must have the same length") as caught:
        sched.OneCycleLR(stock, max_lr=[0.1, 0.2], total_steps=10)
    assert not isinstance(caught.value, FusionArgumentError)  # other optimizers: torch's


@pytest.mark.parametrize("build, name", [
    (lambda opt: sched.StepLR(opt, step_size=1, gamma=[0.7, 0.5, 0.9]), "gamma"),
    (lambda opt: sched.ExponentialLR(opt, gamma=torch.tensor([0.7, 0.5, 0.9])), "gamma"),
    (lambda opt: sched.CosineAnnealingLR(opt, T_max=[5, 10, 20]), "T_max"),
    (lambda opt: sched.ReduceLROnPlateau(opt, factor=(0.1, 0.5, 0.2)), "factor"),
])
def test_a_shared_scheduler_argument_given_one_value_per_model_names_lambda_lr(build, name):
    """pytorch/examples' MNIST ``StepLR(opt, step_size=1, gamma=args.gamma)`` converted with
    one gamma per model, as hftc.optim takes its hyper-parameters: torch built it and
    failed at the first decaying ``step()`` inside torch ("can't multiply sequence by
    non-int"). Refused when built, at the user's line, naming the LambdaLR that does it;
    that LambdaLR then gives each model its own StepLR schedule."""
    from hftc.errors import FusionArgumentError

    opt = ho.SGD(StackedModels(make_models(3)).parameters(), lr=[0.1, 0.2, 0.3])
    with pytest.raises(FusionArgumentError, match=rf"(?s)\({name}=.*test_optim_schedulers\.py:"
                       rf"\d+: `.*`: torch's \w+ takes one {name} for all param groups.*"
                       r"LambdaLR\(opt, "):
        build(opt)
    if name != "gamma":
        return
    gammas = [0.7, 0.5, 0.9]
    fused, solos, fused_lrs, solo_lrs = run(
        ho.SGD, torch.optim.SGD, SGD_CONFIGS,
        lambda opt: sched.LambdaLR(opt, [lambda e, g=g: g ** (e // 2) for g in gammas]),
        lambda opt, i: sched.StepLR(opt, step_size=2, gamma=gammas[i]))
    for got, want in zip(fused_lrs, solo_lrs):
        assert got == pytest.approx(want, rel=1e-12)
    assert_all_match(fused, solos, 1e-9)
