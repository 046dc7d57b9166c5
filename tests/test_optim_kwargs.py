"""Stock optimizers' implementation flags on hftc's fused optimizers.

``foreach``, ``fused``, ``capturable`` and ``differentiable`` are keyword arguments of
``torch.optim.SGD/Adam/AdamW/RMSprop/Adagrad`` that pick how the update runs rather than
a value per model. hftc accepts every one its stock class accepts: ``foreach`` changes
nothing (on the CPU stock's foreach and for-loop updates are equal bit for bit, and
hftc's equal them), ``fused=True`` runs torch's fused kernels per model (stock
``fused=True`` bit for bit), and the defaults of ``capturable`` / ``differentiable`` are
accepted while ``True`` raises ``FusionArgumentError`` saying what to do instead.
Every test trains N models fused against N stock optimizers with the same flags.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from optim_helpers import (
    StackedModels,
    make_batches,
    make_models,
    single_thread,  # noqa: F401  (autouse fixture)
    train_fused,
    train_solo,
)

import hftc.optim as ho
from hftc.errors import FusionArgumentError

# name -> one stock kwargs dict per model (hyper-parameters that differ beyond lr, so
# Adam's fused=True takes its per-model kernel calls, stock's bit for bit).
CONFIGS = {
    "SGD": [dict(lr=0.1), dict(lr=0.05, momentum=0.9),
            dict(lr=0.02, momentum=0.5, dampening=0.3, weight_decay=0.01),
            dict(lr=0.03, momentum=0.9, nesterov=True, maximize=True)],
    "Adam": [dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.99), amsgrad=True),
             dict(lr=1e-3, weight_decay=0.1, maximize=True)],
    "AdamW": [dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.99), amsgrad=True),
              dict(lr=1e-3, weight_decay=0.1)],
    "RMSprop": [dict(lr=1e-2), dict(lr=1e-2, momentum=0.9, centered=True),
                dict(lr=1e-3, weight_decay=0.1, maximize=True)],
    "Adagrad": [dict(lr=1e-2), dict(lr=3e-2, lr_decay=0.01, initial_accumulator_value=0.1),
                dict(lr=1e-1, weight_decay=0.1, eps=1e-6, maximize=True)],
    "Adadelta": [dict(lr=1.0), dict(lr=0.5, rho=0.8, weight_decay=0.1),
                 dict(lr=0.1, eps=1e-5, maximize=True)],
    "Adamax": [dict(lr=2e-3), dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
               dict(lr=5e-3, eps=1e-6, maximize=True)],
    "NAdam": [dict(lr=2e-3), dict(lr=1e-2, betas=(0.8, 0.99), momentum_decay=1e-2),
              dict(lr=5e-3, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)],
    "RAdam": [dict(lr=1e-3), dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
              dict(lr=5e-3, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)],
}
HAS_FUSED = {"SGD", "Adam", "AdamW", "Adagrad"}
HAS_CAPTURABLE = {"Adam", "AdamW", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam"}
#: Stock's foreach and for-loop updates round differently (their denominators): hftc
#: runs the one each model's foreach picks.
FOREACH_CHANGES_VALUES = {"NAdam", "RAdam"}


def accepted_flags(name: str) -> list[dict]:
    flags = [dict(foreach=None), dict(foreach=True), dict(foreach=False),
             dict(differentiable=False)]
    if name in HAS_CAPTURABLE:
        flags.append(dict(capturable=False))
    if name in HAS_FUSED:
        flags += [dict(fused=None), dict(fused=False), dict(fused=True),
                  dict(fused=True, foreach=False)]
    return flags


CASES = [(name, flags) for name in CONFIGS for flags in accepted_flags(name)]


def fused_kwargs(name: str, configs: list[dict]) -> dict:
    """Per-model lists (lr included) for the fused constructor, stock defaults filled in."""
    defaults = {k: p.default
                for k, p in inspect.signature(getattr(torch.optim, name)).parameters.items()}
    keys = sorted(set().union(*configs))
    return {k: [c.get(k, defaults[k]) for c in configs] for k in keys}


def train_both(name: str, flags: dict, steps: int = 3, fused_flags: dict | None = None):
    """hftc's optimizer (``fused_flags``, default ``flags``) over N fused models and N
    stock optimizers (``flags``) over N plain ones, ``steps`` steps each (float64)."""
    configs = CONFIGS[name]
    models = make_models(len(configs))
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = getattr(ho, name)(fused.parameters(), **fused_kwargs(name, configs),
                            **(flags if fused_flags is None else fused_flags))
    batches = make_batches(steps)
    train_fused(fused, opt, batches)
    stocks = [getattr(torch.optim, name)(s.parameters(), **c, **flags)
              for s, c in zip(solos, configs)]
    for solo, stock in zip(solos, stocks):
        train_solo(solo, stock, batches)
    return fused, opt, solos, stocks


def assert_equal_models(fused, solos) -> None:
    params = dict(fused.named_parameters())
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            assert torch.equal(params[name][i], p), (i, name, (params[name][i] - p).abs().max())


@pytest.mark.parametrize("name,flags", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_accepted_flag_trains_as_stock_with_that_flag(name, flags):
    fused, opt, solos, stocks = train_both(name, flags)
    assert_equal_models(fused, solos)  # bit for bit, every flag
    stock_group = stocks[0].param_groups[0]
    for group in opt.param_groups:  # in every model's group, as torch keeps them
        for key, value in flags.items():
            assert key in stock_group and key in group
            assert group[key] == (bool(value) if key == "fused" else value), key


@pytest.mark.parametrize("name", sorted(HAS_FUSED))
def test_fused_true_runs_torchs_fused_kernel(name, monkeypatch):
    kernel = {"SGD": "_fused_sgd_", "Adagrad": "_fused_adagrad_", "Adam": "_fused_adam_",
              "AdamW": "_fused_adamw_"}[name]
    calls = []
    real = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    configs = CONFIGS[name]
    n = len(configs)
    fused = StackedModels(make_models(n))
    n_params = len(list(fused.parameters()))
    for flags, expected in ((dict(fused=True), 2 * n), ({}, 0)):
        calls.clear()
        opt = getattr(ho, name)(fused.parameters(), **fused_kwargs(name, configs), **flags)
        train_fused(fused, opt, make_batches(2))
        if name in ("SGD", "Adagrad"):  # one call per model and step, over all its params
            assert calls == [n_params] * expected, calls
        else:  # Adam's per-model calls (not only lr differs): one per parameter and model
            assert calls == [1] * (expected * n_params), calls


def test_stock_foreach_and_for_loop_are_equal_bit_for_bit():
    # The ground for "foreach changes nothing": stock's two implementations agree on the
    # CPU (measured for all these classes, float32 and float64), and hftc repeats them;
    # not for NAdam and RAdam, whose foreach hftc honours per model.
    for name in CONFIGS:
        a = train_both(name, dict(foreach=True))
        b = train_both(name, dict(foreach=False))
        same = all(torch.equal(pa, pb) for sa, sb in zip(a[2], b[2])
                   for pa, pb in zip(sa.parameters(), sb.parameters()))
        assert same is (name not in FOREACH_CHANGES_VALUES), name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_signature_takes_every_stock_keyword(name):
    stock = set(inspect.signature(getattr(torch.optim, name)).parameters)
    mine = set(inspect.signature(getattr(ho, name)).parameters)
    assert stock <= mine, stock - mine


def positional(cls: type) -> list[tuple[str, object]]:
    """The arguments ``cls`` takes by position after ``params``, with their defaults."""
    return [(k, p.default) for k, p in inspect.signature(cls).parameters.items()
            if p.kind is p.POSITIONAL_OR_KEYWORD and k != "params"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_positional_arguments_are_torchs_in_torchs_order(name):
    # hftc.optim.Adam(params, 1e-3) read 1e-3 as num_models: every argument torch takes
    # by position hftc takes at that position, and hftc's own (num_models) by keyword.
    stock, mine = getattr(torch.optim, name), getattr(ho, name)
    assert [k for k, _ in positional(mine)] == [k for k, _ in positional(stock)]
    for (key, default), (_, stock_default) in zip(positional(mine), positional(stock)):
        assert default == stock_default, key
    keyword_only = {k for k, p in inspect.signature(mine).parameters.items()
                    if p.kind is p.KEYWORD_ONLY}
    stock_keyword_only = {k for k, p in inspect.signature(stock).parameters.items()
                          if p.kind is p.KEYWORD_ONLY}
    assert keyword_only == stock_keyword_only | {"num_models"}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_arguments_given_by_position_train_as_stock_given_the_same(name):
    # lr = 3 for N = 3 models: once read as num_models, silently leaving lr at its default.
    n, lr = 3, 3.0
    models = make_models(n)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = getattr(ho, name)(fused.parameters(), lr)
    assert [g["lr"] for g in opt.param_groups] == [lr] * n
    batches = make_batches(3)
    train_fused(fused, opt, batches)
    for solo in solos:
        train_solo(solo, getattr(torch.optim, name)(solo.parameters(), lr), batches)
    assert_equal_models(fused, solos)
    # Every positional argument, stock's values but the defaults changed where that
    # changes the update (a momentum, a decay, centering, amsgrad, nesterov).
    changed = {"momentum": 0.5, "weight_decay": 0.01, "alpha": 0.9, "centered": True,
               "amsgrad": True, "lr_decay": 0.01, "initial_accumulator_value": 0.1,
               "betas": (0.8, 0.99), "eps": 1e-6, "dampening": 0.0, "nesterov": True,
               "rho": 0.8, "momentum_decay": 1e-2, "decoupled_weight_decay": True}
    args = [1e-2 if k == "lr" else changed.get(k, default)
            for k, default in positional(getattr(torch.optim, name))]
    models = make_models(n, seed=5)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = getattr(ho, name)(fused.parameters(), *args)
    train_fused(fused, opt, batches)
    for solo in solos:
        train_solo(solo, getattr(torch.optim, name)(solo.parameters(), *args), batches)
    assert_equal_models(fused, solos)


def test_num_models_is_keyword_only():
    p = torch.randn(3, 4, requires_grad=True)
    assert ho.Adam([p], num_models=3).num_models == 3
    with pytest.raises(TypeError):
        ho.SGD([p], 0.1, 0.0, 0.0, 0.0, False, 3)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_group_keys_are_stocks(name):
    p = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float64))
    mine = getattr(ho, name)([p]).param_groups[0]
    stock = getattr(torch.optim, name)([torch.nn.Parameter(torch.randn(3))]).param_groups[0]
    assert set(mine) == set(stock)
    assert mine["foreach"] is None and mine["differentiable"] is False
    if name in HAS_CAPTURABLE:
        assert mine["capturable"] is False
    if name in HAS_FUSED:
        assert mine["fused"] is False  # stock: None; both mean "not fused"


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_differentiable_true_is_refused_saying_what_to_do(name):
    p = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(FusionArgumentError, match="differentiable=True is not supported") as e:
        getattr(ho, name)([p], lr=[0.1, 0.2], differentiable=True)
    assert "Pass differentiable=False" in str(e.value)
    assert f"torch.optim.{name}(..., differentiable=True)" in str(e.value)


@pytest.mark.parametrize("name", sorted(HAS_CAPTURABLE - {"Adam", "AdamW"}))
def test_capturable_true_is_refused_saying_what_to_do(name):
    # Adam and AdamW take it (tests/test_optim_capturable.py).
    p = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(FusionArgumentError, match="capturable=True is not supported") as e:
        getattr(ho, name)([p], lr=[0.1, 0.2], capturable=True)
    assert "Pass capturable=False" in str(e.value)


@pytest.mark.parametrize("name,key", [("SGD", "capturable"), ("Adagrad", "capturable"),
                                      ("RMSprop", "fused"), ("Adadelta", "fused"),
                                      ("Adamax", "fused"), ("NAdam", "fused"),
                                      ("RAdam", "fused")])
def test_keywords_the_stock_class_lacks_are_a_type_error_as_in_torch(name, key):
    with pytest.raises(TypeError):
        getattr(torch.optim, name)([torch.randn(3, requires_grad=True)], **{key: False})
    with pytest.raises(TypeError):
        getattr(ho, name)([torch.randn(2, 3, requires_grad=True)], **{key: False})


@pytest.mark.parametrize("name", sorted(HAS_FUSED))
def test_fused_and_foreach_together_are_refused_as_in_torch(name):
    p = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(FusionArgumentError, match="fused=True and foreach=True"):
        getattr(ho, name)([p], fused=True, foreach=True)


def test_a_flag_per_model_is_refused():
    p = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(FusionArgumentError, match="foreach takes one bool"):
        ho.AdamW([p], lr=[1e-3, 2e-3], foreach=[True, False])


def test_adagrad_fused_off_the_cpu_is_refused():
    p = torch.empty(2, 3, device="meta", requires_grad=True)
    with pytest.raises(FusionArgumentError, match="CPU tensors only"):
        ho.Adagrad([p], fused=True)


def test_groups_that_disagree_on_fused_are_refused_at_the_step():
    models = make_models(2)
    fused = StackedModels(models)
    opt = ho.SGD(fused.parameters(), lr=[0.1, 0.2], momentum=0.9, fused=True)
    opt.param_groups[1]["fused"] = False
    train = make_batches(1)
    with pytest.raises(FusionArgumentError, match="disagree on fused"):
        train_fused(fused, opt, train)


def test_param_group_dicts_take_the_optimizers_flags_only():
    models = make_models(2)
    fused = StackedModels(models)
    params = list(fused.parameters())
    ok = ho.AdamW([{"params": params[:2], "weight_decay": 0.1, "foreach": None},
                   {"params": params[2:], "weight_decay": 0.0}], lr=[1e-3, 2e-3])
    assert ok.param_groups[0]["foreach"] is None
    with pytest.raises(FusionArgumentError, match="param group 0 sets fused=True"):
        ho.AdamW([{"params": params[:2], "fused": True}, {"params": params[2:]}],
                 lr=[1e-3, 2e-3])
    with pytest.raises(FusionArgumentError, match="differentiable=True is not supported"):
        ho.AdamW([{"params": params, "differentiable": True}], lr=[1e-3, 2e-3])


# ------------------------------------------------------------ state dicts


#: An implementation flag per optimizer class, each a value other than its default.
FLAG_CASES = [("SGD", dict(fused=True)), ("Adam", dict(fused=True)),
              ("Adagrad", dict(fused=True)), ("RMSprop", dict(foreach=True)),
              ("AdamW", dict(foreach=False)), ("Adadelta", dict(foreach=True)),
              ("Adamax", dict(foreach=True)), ("NAdam", dict(foreach=True)),
              ("RAdam", dict(foreach=True))]


@pytest.mark.parametrize("name,flags", FLAG_CASES)
def test_flags_survive_state_dict_and_the_loaded_optimizer_continues(name, flags):
    configs = CONFIGS[name]
    models = make_models(len(configs))
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = getattr(ho, name)(fused.parameters(), **fused_kwargs(name, configs), **flags)
    batches = make_batches(4)
    train_fused(fused, opt, batches[:2])
    saved = opt.state_dict()
    assert all(g[k] == v for g in saved["param_groups"] for k, v in flags.items())
    # Loaded into an optimizer built without the flags: torch's groups (and so the
    # implementation) come from the state dict, as stock's do.
    loaded = getattr(ho, name)(fused.parameters(), **fused_kwargs(name, configs))
    loaded.load_state_dict(saved)
    for group in loaded.param_groups:
        for key, value in flags.items():
            assert group[key] == value
    for p in loaded.param_groups[0]["params"]:
        step = loaded.state[p].get("step")
        if step is not None:  # still on the CPU in its own dtype (torch moves a fused one)
            assert step.device.type == "cpu" and step.dtype == opt.state[p]["step"].dtype
    train_fused(fused, loaded, batches[2:])
    stocks = [getattr(torch.optim, name)(s.parameters(), **c, **flags)
              for s, c in zip(solos, configs)]
    for solo, stock in zip(solos, stocks):
        train_solo(solo, stock, batches)
    assert_equal_models(fused, solos)


def test_loading_a_state_dict_that_is_differentiable_is_refused():
    p = torch.randn(2, 3, requires_grad=True)
    opt = ho.SGD([p], lr=[0.1, 0.2])
    saved = opt.state_dict()
    saved["param_groups"][1]["differentiable"] = True
    with pytest.raises(FusionArgumentError, match="load_state_dict: differentiable=True"):
        opt.load_state_dict(saved)


def test_state_dicts_and_pickles_without_the_keys_take_the_optimizers_values():
    # hftc before the flags were param-group keys: Adam kept fused in defaults only.
    p = torch.randn(2, 3, requires_grad=True)
    opt = ho.Adam([p], lr=[1e-3, 2e-3], fused=True)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        for key in ("foreach", "capturable", "fused"):
            del group[key]
    opt.load_state_dict(saved)
    assert all(g["fused"] is True and g["foreach"] is None for g in opt.param_groups)
    old = ho.RMSprop([p], lr=[1e-3, 2e-3])
    for group in old.param_groups:
        del group["foreach"], group["capturable"]
    del old.defaults["foreach"]
    again = pickle.loads(pickle.dumps(old))
    assert all(g["foreach"] is None and g["capturable"] is False for g in again.param_groups)
    assert pickle.loads(pickle.dumps(opt)).defaults["fused"] is True


# --------------------------------------------- fuse_optimizers / unfuse_optimizers


@pytest.mark.parametrize("name,flags", FLAG_CASES)
def test_fuse_optimizers_carries_the_flags(name, flags):
    configs = CONFIGS[name]
    models = make_models(len(configs))
    solos = [copy.deepcopy(m) for m in models]
    batches = make_batches(4)
    stocks = [getattr(torch.optim, name)(m.parameters(), **c, **flags)
              for m, c in zip(models, configs)]
    for m, stock in zip(models, stocks):
        train_solo(m, stock, batches[:2])  # already stepped: state carries over too
    fused = StackedModels(models)
    opt = ho.fuse_optimizers(fused, stocks)
    for group in opt.param_groups:
        for key, value in flags.items():
            assert group[key] == value
    train_fused(fused, opt, batches[2:])
    for solo, c in zip(solos, configs):
        train_solo(solo, getattr(torch.optim, name)(solo.parameters(), **c, **flags), batches)
    assert_equal_models(fused, solos)


def test_fuse_optimizers_refuses_what_hftc_cannot_honour():
    models = make_models(2)
    fused = StackedModels(models)
    with pytest.raises(FusionArgumentError, match=r"optimizers\[1\]: differentiable=True"):
        ho.fuse_optimizers(fused, [torch.optim.SGD(models[0].parameters()),
                                   torch.optim.SGD(models[1].parameters(),
                                                   differentiable=True)])
    with pytest.raises(FusionArgumentError, match=r"optimizers\[0\]: capturable=True"):
        ho.fuse_optimizers(fused, [torch.optim.RMSprop(m.parameters(), capturable=True)
                                   for m in models])
    with pytest.raises(FusionArgumentError, match="capturable flags differ"):
        ho.fuse_optimizers(fused, [torch.optim.Adam(models[0].parameters(), capturable=True),
                                   torch.optim.Adam(models[1].parameters())])
    with pytest.raises(FusionArgumentError, match="fused flags differ"):
        ho.fuse_optimizers(fused, [torch.optim.AdamW(models[0].parameters(), fused=True),
                                   torch.optim.AdamW(models[1].parameters())])


@pytest.mark.parametrize("name", sorted(HAS_FUSED))
def test_unfuse_optimizers_gives_stock_optimizers_with_the_flags(name):
    configs = CONFIGS[name]
    models = make_models(len(configs))
    fused = StackedModels(models)
    opt = getattr(ho, name)(fused.parameters(), **fused_kwargs(name, configs), fused=True)
    batches = make_batches(4)
    train_fused(fused, opt, batches[:2])
    plain = fused.unfuse()
    stocks = ho.unfuse_optimizers(fused, opt, plain)
    for stock in stocks:
        assert stock.defaults["fused"] is True and stock.param_groups[0]["fused"] is True
    for m, stock in zip(plain, stocks):
        train_solo(m, stock, batches[2:])
    train_fused(fused, opt, batches[2:])
    assert_equal_models(fused, plain)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stock_defaults_spelled_out_are_accepted_silently(name):
    import warnings

    stock_defaults = {k: p.default
                      for k, p in inspect.signature(getattr(torch.optim, name)).parameters.items()
                      if k in ("foreach", "fused", "capturable", "differentiable")}
    p = torch.randn(2, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = getattr(ho, name)([p], lr=[0.1, 0.2], **stock_defaults)
        p.grad = torch.ones_like(p)
        opt.step()
