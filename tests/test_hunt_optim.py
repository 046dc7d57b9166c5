"""Fused optimizers and schedulers against stock ``torch.optim``: the cases a bug hunt
found wrong, each checked against N stock optimizers on the original models."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from optim_helpers import single_thread  # noqa: F401  (autouse fixture)
from torch import nn
from torch.optim import lr_scheduler

import hftc
from hftc.errors import FusionArgumentError

N = 3
LRS = [0.01, 0.02, 0.03]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).double()


def _models() -> list[nn.Module]:
    torch.manual_seed(0)
    return [_net() for _ in range(N)]


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (5,), generator=g)) for _ in range(steps)]


def _matrices_and_rest(module: nn.Module, stacked: bool) -> list[list[nn.Parameter]]:
    """nanoGPT's grouping (matrices / biases and norms), by each model's own dims."""
    model_dims = [(p, p.dim() - int(stacked)) for p in module.parameters()]
    return [[p for p, d in model_dims if d >= 2], [p for p, d in model_dims if d < 2]]


def _fused_step(fused, opt, x, y) -> None:
    opt.zero_grad()
    hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
    opt.step()


# ---------------------------------------------------------------- group dicts + schedulers

@pytest.mark.parametrize("make_scheduler", [
    lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
    lambda o: lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
], ids=["OneCycleLR", "CyclicLR"])
def test_cycled_momentum_over_a_group_with_its_own_momentum_is_refused(make_scheduler):
    """Stock OneCycleLR / CyclicLR write the cycled momentum into every param group; a
    fused group dict's own momentum kept its value instead (a silently different step)."""
    fused = hftc.fuse(_models())
    groups = _matrices_and_rest(fused, stacked=True)
    opt = hftc.optim.SGD([{"params": groups[0], "momentum": 0.5}, {"params": groups[1]}],
                         lr=LRS, momentum=0.9)
    sched = make_scheduler(opt)
    with pytest.raises(FusionArgumentError, match=r"param_groups\[0\]\['momentum'\].*"
                                                  r"param group 0: 0.5.*cycle_momentum=False"):
        for x, y in _batches(3):  # CyclicLR starts at its max momentum, 0.9: then cycles
            _fused_step(fused, opt, x, y)
            sched.step()


def test_fused_stock_groups_with_their_own_betas_under_onecycle_are_refused():
    """fuse_optimizers of AdamW with decay / no-decay groups whose betas differ, then a
    OneCycleLR (it cycles beta1 in every stock group): refused, not a different step."""
    models = _models()
    fused = hftc.fuse(models)
    stock = [torch.optim.AdamW([{"params": g[0], "betas": (0.8, 0.99)},
                                {"params": g[1], "weight_decay": 0.0}], lr=lr)
             for lr, g in zip(LRS, (_matrices_and_rest(m, stacked=False) for m in models))]
    opt = hftc.optim.fuse_optimizers(fused, stock)
    lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    x, y = _batches(1)[0]
    with pytest.raises(FusionArgumentError, match="betas"):
        _fused_step(fused, opt, x, y)


def test_onecycle_with_group_dicts_that_keep_momentum_trains_as_stock():
    """Group dicts that set only weight decay: OneCycleLR's momentum reaches every
    parameter, as in stock, and a mid-training state_dict resumes to the same bits."""
    models = _models()
    solos = copy.deepcopy(models)

    def groups(module, stacked):
        matrices, rest = _matrices_and_rest(module, stacked)
        return [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    def schedule(o):
        return lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)

    stock = [torch.optim.SGD(groups(m, False), lr=lr, momentum=0.9) for m, lr in zip(solos, LRS)]
    stock_sched = [schedule(o) for o in stock]
    fused = hftc.fuse(copy.deepcopy(models))
    opt = hftc.optim.SGD(groups(fused, True), lr=LRS, momentum=0.9)
    sched = schedule(opt)
    batches = _batches(6)
    saved = None
    for k, (x, y) in enumerate(batches):
        for m, o, s in zip(solos, stock, stock_sched):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
            s.step()
        _fused_step(fused, opt, x, y)
        sched.step()
        if k == 2:
            saved = io.BytesIO()
            torch.save({"m": fused.state_dict(), "o": opt.state_dict(),
                        "s": sched.state_dict()}, saved)
    by_name = dict(fused.named_parameters())
    for i, m in enumerate(solos):
        for name, p in m.named_parameters():
            torch.testing.assert_close(by_name[name][i], p, rtol=1e-12, atol=1e-14)
    saved.seek(0)
    ck = torch.load(saved, weights_only=False)
    again = hftc.fuse(_models())
    again.load_state_dict(ck["m"])
    opt2 = hftc.optim.SGD(groups(again, True), lr=LRS, momentum=0.9)
    sched2 = schedule(opt2)
    opt2.load_state_dict(ck["o"])
    sched2.load_state_dict(ck["s"])
    for x, y in batches[3:]:
        _fused_step(again, opt2, x, y)
        sched2.step()
    for name, p in again.named_parameters():
        assert torch.equal(p, by_name[name]), name


# ---------------------------------------------------------------- MixedOptimizer + cycling

def _train_mixed_against_stock(makers, make_scheduler, steps=5):
    models = _models()[:len(makers)]
    solos = copy.deepcopy(models)
    stock = [make(m) for make, m in zip(makers, solos)]
    stock_sched = [make_scheduler(o) for o in stock]
    fused = hftc.fuse(models)
    opt = hftc.optim.fuse_optimizers(fused, [make(m) for make, m in zip(makers, models)])
    sched = make_scheduler(opt)
    for x, y in _batches(steps):
        for m, o, s in zip(solos, stock, stock_sched):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
            s.step()
        _fused_step(fused, opt, x, y)
        sched.step()
    by_name = dict(fused.named_parameters())
    for i, m in enumerate(solos):
        for name, p in m.named_parameters():
            torch.testing.assert_close(by_name[name][i], p, rtol=1e-12, atol=1e-12)
    return opt, stock


_ONE_CYCLE = lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)  # noqa: E731
_CYCLIC = lambda o: lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2)  # noqa: E731


@pytest.mark.parametrize("make_scheduler", [_ONE_CYCLE, _CYCLIC], ids=["OneCycleLR", "CyclicLR"])
@pytest.mark.parametrize("makers", [
    [lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
     lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5)],
    [lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
     lambda m: torch.optim.NAdam(m.parameters(), lr=0.02),
     lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True)],
], ids=["momentum", "betas"])
def test_mixed_classes_sharing_a_momentum_key_cycle_it_as_stock(makers, make_scheduler):
    """OneCycleLR / CyclicLR (cycle_momentum=True, their default) on a MixedOptimizer
    raised torch's "optimizer must support momentum or beta1" (its defaults named
    neither), though each stock optimizer takes it: now they cycle as stock does."""
    opt, stock = _train_mixed_against_stock(makers, make_scheduler)
    key = "betas" if "betas" in stock[0].defaults else "momentum"
    assert [g[key] for g in opt.param_groups] == [o.param_groups[0][key] for o in stock]


@pytest.mark.parametrize("make_scheduler", [_ONE_CYCLE, _CYCLIC], ids=["OneCycleLR", "CyclicLR"])
def test_mixed_sgd_and_adam_under_cycle_momentum_get_a_clear_error(make_scheduler):
    """SGD cycles momentum, Adam betas[0]: torch's one key for all groups cannot do both;
    refused naming the classes and models and what to pass, not torch's bare message."""
    models = _models()[:2]
    fused = hftc.fuse(models)
    opt = hftc.optim.fuse_optimizers(fused, [
        torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adam(models[1].parameters(), lr=0.01)])
    with pytest.raises(FusionArgumentError, match=r"SGD: models \[0\]; Adam: models \[1\].*"
                                                  r"cycle_momentum=False") as info:
        make_scheduler(opt)
    assert "test_hunt_optim.py" in str(info.value)  # the user's line
    _train_mixed_against_stock(  # and cycle_momentum=False trains as stock
        [lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
         lambda m: torch.optim.Adam(m.parameters(), lr=0.01)],
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10, cycle_momentum=False))


# ---------------------------------------------------------------- group keys fuse_optimizers drops

def test_fuse_optimizers_refuses_groups_that_differ_in_a_key_it_would_drop():
    """timm's layer decay puts ``lr_scale`` in each group (its schedulers multiply each
    group's lr by it): the fused model dict kept group 0's 0.5 for every parameter and
    dropped the head's 1.0, silently. Refused, naming the model, key and values."""
    models = _models()
    fused = hftc.fuse(models)
    stock = [torch.optim.AdamW([{"params": m[0].parameters(), "lr_scale": 0.5},
                                {"params": m[3].parameters(), "lr_scale": 1.0}], lr=0.01)
             for m in models]
    with pytest.raises(FusionArgumentError, match=r"optimizers\[0\]'s \(model 0's\) param "
                                                  r"groups differ in 'lr_scale' \(0.5, 1.0\)"):
        hftc.optim.fuse_optimizers(fused, stock)
    labelled = [torch.optim.AdamW([{"params": m[0].parameters(), "name": "backbone"},
                                   {"params": m[3].parameters(), "name": "head"}], lr=0.01)
                for m in models]  # a label changes no step: taken (group 0's kept)
    assert hftc.optim.fuse_optimizers(fused, labelled).param_groups[1]["name"] == "backbone"


def test_fuse_optimizers_keeps_group_keys_that_agree_and_one_optimizer_per_group_trains():
    """The same extra key in every group is kept; the way out the error names, one stock
    optimizer per group fused on its own, trains as the stock pairs."""
    models = _models()
    solos = copy.deepcopy(models)
    fused = hftc.fuse(models)
    same = hftc.optim.fuse_optimizers(fused, [torch.optim.AdamW(
        [{"params": m[0].parameters(), "tag": "all"}, {"params": m[3].parameters(), "tag": "all"}],
        lr=0.01) for m in models])
    assert [g["tag"] for g in same.param_groups] == ["all"] * N

    def pair(m):
        return [torch.optim.AdamW(m[0].parameters(), lr=0.005),
                torch.optim.AdamW(list(m[1].parameters()) + list(m[3].parameters()), lr=0.01)]

    stock = [pair(m) for m in solos]
    pairs = [pair(m) for m in models]
    backbone = hftc.optim.fuse_optimizers(fused, [p[0] for p in pairs])
    head = hftc.optim.fuse_optimizers(fused, [p[1] for p in pairs])
    for x, y in _batches(3):
        for m, opts in zip(solos, stock):
            for o in opts:
                o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            for o in opts:
                o.step()
        backbone.zero_grad()
        head.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        backbone.step()
        head.step()
    by_name = dict(fused.named_parameters())
    for i, m in enumerate(solos):
        for name, p in m.named_parameters():
            torch.testing.assert_close(by_name[name][i], p, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- unfuse_optimizers of a subset

def test_unfuse_optimizers_of_a_head_only_optimizer_holds_only_the_head():
    """A fused optimizer over some of the parameters (the head, or one of a backbone /
    head pair): unfuse_optimizers built each stock optimizer over model.parameters(), so
    it also stepped the backbone (twice, beside the backbone's own optimizer)."""
    models = _models()
    solos = copy.deepcopy(models)
    fused = hftc.fuse(models)
    backbone_names, head_names = ["0.weight", "0.bias", "1.weight", "1.bias"], ["3.weight", "3.bias"]
    backbone = hftc.optim.SGD([fused.get_parameter(n) for n in backbone_names], lr=0.1,
                              momentum=0.9)
    head = hftc.optim.Adam([fused.get_parameter(n) for n in head_names], lr=LRS)
    stock = [(torch.optim.SGD([m.get_parameter(n) for n in backbone_names], lr=0.1, momentum=0.9),
              torch.optim.Adam([m.get_parameter(n) for n in head_names], lr=lr))
             for m, lr in zip(solos, LRS)]
    batches = _batches(6)

    def stock_step(m, opts, x, y):
        for o in opts:
            o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        for o in opts:
            o.step()

    for x, y in batches[:3]:
        for m, opts in zip(solos, stock):
            stock_step(m, opts, x, y)
        backbone.zero_grad()
        head.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        backbone.step()
        head.step()
    alone = fused.unfuse()
    back_backbone = hftc.optim.unfuse_optimizers(fused, backbone, alone)
    back_head = hftc.optim.unfuse_optimizers(fused, head, alone)
    for i, m in enumerate(alone):
        assert [p for g in back_head[i].param_groups for p in g["params"]] == \
            [m.get_parameter(n) for n in head_names]
    for x, y in batches[3:]:
        for m, opts in zip(solos, stock):
            stock_step(m, opts, x, y)
        for m, opts in zip(alone, zip(back_backbone, back_head)):
            stock_step(m, opts, x, y)
    for m, solo in zip(alone, solos):
        for (name, p), q in zip(m.named_parameters(), solo.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)


# ---------------------------------------------------------------- Rprop / ASGD

@pytest.mark.parametrize("cls, kwargs", [(torch.optim.Rprop, {"lr": 0.01}),
                                         (torch.optim.ASGD, {"lr": 0.05, "t0": 2,
                                                             "weight_decay": 0.1})],
                         ids=["Rprop", "ASGD"])
def test_rprop_and_asgd_are_refused_by_fuse_optimizers_naming_the_stock_class_on_fused(
        cls, kwargs):
    """fuse_optimizers refuses them (no fused class); the error now names what works:
    the stock class on the stacked parameters, elementwise, trains each model as alone."""
    models = _models()
    solos = copy.deepcopy(models)
    fused = hftc.fuse(models)
    with pytest.raises(hftc.errors.FusionTypeError,
                       match=rf"torch.optim.{cls.__name__}\(fused.parameters\(\), \.\.\.\)"):
        hftc.optim.fuse_optimizers(fused, [cls(m.parameters(), **kwargs) for m in models])
    stock = [cls(m.parameters(), **kwargs) for m in solos]
    opt = cls(fused.parameters(), **kwargs)
    for x, y in _batches(5):
        for m, o in zip(solos, stock):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        _fused_step(fused, opt, x, y)
    by_name = dict(fused.named_parameters())
    for i, m in enumerate(solos):
        for name, p in m.named_parameters():
            torch.testing.assert_close(by_name[name][i], p, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- tensor lr in param groups

def test_fuse_optimizers_takes_groups_with_equal_tensor_learning_rates():
    """Two groups each given lr=torch.tensor(0.01) (one value): refused as "different
    learning rates ([tensor(0.0100), tensor(0.0100)])", the set of lrs holding two
    tensors by identity. Now fused, and trained as the stock optimizers train."""
    models = _models()
    solos = copy.deepcopy(models)

    def make(m, lr):  # (in the parameters' dtype: stock's step size is lr's dtype)
        return torch.optim.Adam(
            [{"params": m[0].parameters(), "lr": torch.tensor(lr, dtype=torch.float64)},
             {"params": m[3].parameters(), "lr": torch.tensor(lr, dtype=torch.float64),
              "weight_decay": 0.1}])

    stock = [make(m, lr) for m, lr in zip(solos, LRS)]
    fused = hftc.fuse(models)
    opt = hftc.optim.fuse_optimizers(fused, [make(m, lr) for m, lr in zip(models, LRS)])
    assert [g["lr"] for g in opt.param_groups] == LRS
    for x, y in _batches(4):
        for m, o in zip(solos, stock):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        _fused_step(fused, opt, x, y)
    by_name = dict(fused.named_parameters())
    for i, m in enumerate(solos):
        for name, p in m.named_parameters():
            torch.testing.assert_close(by_name[name][i], p, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- schedulers' per-group args

@pytest.mark.parametrize("make_scheduler", [
    lambda o, v: lr_scheduler.OneCycleLR(o, max_lr=v, total_steps=5),
    lambda o, v: lr_scheduler.CyclicLR(o, base_lr=v, max_lr=0.5),
], ids=["OneCycleLR-max_lr", "CyclicLR-base_lr"])
def test_a_tensor_of_n_values_for_a_per_group_scheduler_argument_is_refused(make_scheduler):
    """hftc.optim takes lr=torch.tensor([...N]); torch's schedulers take per-group values
    as a list and gave the tensor whole to every group: the step then failed (OneCycleLR:
    "lr[0] must be a number, got a tensor of shape [3]", CyclicLR: torch's "fill_ only
    supports 0-dimension value tensor"). Refused at the scheduler, asking for a list."""
    fused = hftc.fuse(_models())
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(FusionArgumentError, match=r"Tensor of 3 values\) at .*"
                                                  r"test_hunt_optim.py.*\.tolist\(\)"):
        make_scheduler(opt, torch.tensor([0.1, 0.2, 0.3]))
    sched = make_scheduler(opt, [0.1, 0.2, 0.3])  # the list works, per model
    x, y = _batches(1)[0]
    _fused_step(fused, opt, x, y)
    sched.step()
    assert len({g["lr"] for g in opt.param_groups}) == N


# ---------------------------------------------------------------- pickled ReduceLROnPlateau

@pytest.mark.parametrize("round_trip", [
    copy.deepcopy,
    lambda obj: torch.load(_saved(obj), weights_only=False),
], ids=["deepcopy", "torch.save"])
def test_a_pickled_per_model_plateau_scheduler_steps_its_own_optimizer(round_trip):
    """copy.deepcopy / torch.save of {optimizer, hftc.optim.ReduceLROnPlateau}, as a
    stock pair pickles: its per-model schedulers' optimizer views lost their optimizer
    (torch's Optimizer pickles defaults, state and param_groups only) and the next step
    raised AttributeError '_ModelGroups' object has no attribute '_optimizer'."""
    fused = hftc.fuse(_models())
    opt = hftc.optim.SGD(fused.parameters(), lr=LRS)
    sched = hftc.optim.ReduceLROnPlateau(opt, patience=[0, 1, 0])
    sched.step([1.0, 1.0, 1.0])
    copied = round_trip({"opt": opt, "sched": sched})
    for metrics in ([2.0, 2.0, 0.5], [3.0, 3.0, 0.6]):
        copied["sched"].step(metrics)
    stock = [torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr) for lr in LRS]
    plateaus = [lr_scheduler.ReduceLROnPlateau(o, patience=p) for o, p in zip(stock, [0, 1, 0])]
    for metrics in ([1.0, 1.0, 1.0], [2.0, 2.0, 0.5], [3.0, 3.0, 0.6]):
        for s, m in zip(plateaus, metrics):
            s.step(m)
    assert [g["lr"] for g in copied["opt"].param_groups] == [o.param_groups[0]["lr"] for o in stock]
    assert copied["sched"].get_last_lr() == [s.get_last_lr()[0] for s in plateaus]
    assert [g["lr"] for g in opt.param_groups] == LRS  # the original untouched


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_fuse_optimizers_in_another_order_than_the_models_names_whose_parameter_it_is():
    """Optimizers given in reverse order: the error said only "not a parameter of model
    0"; it now names the model and parameter it is, and the order to give."""
    models = _models()
    fused = hftc.fuse(models)
    with pytest.raises(FusionArgumentError, match=r"not a parameter of model 0: it is model 2's "
                                                  r"'0.weight' \(give the optimizers in the order"):
        hftc.optim.fuse_optimizers(fused, [torch.optim.SGD(m.parameters(), lr=0.1)
                                           for m in models[::-1]])


def test_replace_models_keeps_a_head_only_optimizer_on_the_head():
    """hftc.replace_models re-forms each fused optimizer through unfuse_optimizers: a
    head-only fused Adam came back holding every parameter, and trained the backbone."""
    models = _models()
    fused = hftc.fuse(models)
    head_names = ["3.weight", "3.bias"]
    head = hftc.optim.Adam([fused.get_parameter(n) for n in head_names], lr=LRS)
    x, y = _batches(1)[0]
    _fused_step(fused, head, x, y)
    hftc.replace_models(fused, {1: _net()})
    names = {id(p): n for n, p in fused.named_parameters()}
    assert [names[id(p)] for p in head.param_groups[0]["params"]] == head_names
    backbone = {n: p.detach().clone() for n, p in fused.named_parameters() if n not in head_names}
    _fused_step(fused, head, x, y)
    for n, p in fused.named_parameters():
        if n not in head_names:
            assert torch.equal(p, backbone[n]), n


def test_per_model_plateau_on_a_stock_optimizer_over_fused_parameters_says_what_to_build():
    """A stock Adam over fused.parameters() has one group for all models: the error was
    "patience has 3 values but there are 1 models" for 3 fused models."""
    fused = hftc.fuse(_models())
    opt = torch.optim.Adam(fused.parameters(), lr=0.01)
    with pytest.raises(hftc.errors.FusionTypeError,
                       match=r"torch.optim.adam.Adam has 1 param group\(s\), not one per "
                             r"model. Build hftc.optim.Adam\(fused.parameters\(\)"):
        hftc.optim.ReduceLROnPlateau(opt, patience=[0, 1, 2])


@pytest.mark.parametrize("name", ["SGD", "Adam", "LBFGS"])
def test_add_param_group_is_hftcs_refusal_naming_the_users_line(name):
    # (a NotImplementedError still, as before; now hftc's class, with the line and the way)
    from hftc.errors import FusionNotImplementedError
    fused = hftc.fuse([torch.nn.Linear(3, 2) for _ in range(2)])
    opt = getattr(hftc.optim, name)(fused.parameters(), lr=0.1)
    with pytest.raises(FusionNotImplementedError, match=(
            rf"add_param_group at .*test_hunt_optim.py:\d+.*groups cannot be added.*"
            rf"hftc\.optim\.{name}\(fused\.parameters\(\)")) as caught:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert isinstance(caught.value, NotImplementedError)
    assert len(opt.param_groups) == 2  # left as it was
