"""``fuse_optimizers`` of stock optimizers of different classes (issue 34 item 2).

SGD / Adam / AdamW / RMSprop models in one fused array, each with its own per-model
scheduler: every parameter and every piece of optimizer state must equal what N stock
optimizers give.  Given the same gradients (``inject``: each model's own gradient from
its solo backward, stacked into the fused parameters' ``.grad``) the fused step is
stock's bit for bit; trained end to end through ``hftc.fuse`` the gradients differ by
float rounding of the fused forward, so there a tolerance applies.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from optim_helpers import single_thread  # noqa: F401  (autouse fixture)
from torch import nn

import hftc
import hftc.optim as ho
from hftc.errors import FusionArgumentError, FusionTypeError

#: name -> a stock optimizer over some parameters, one configuration per class variant.
STOCK = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.02),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adam_betas": lambda p: torch.optim.Adam(p, lr=2e-3, betas=(0.8, 0.99), weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    "rmsprop_plain": lambda p: torch.optim.RMSprop(p, lr=3e-3, alpha=0.9),
}

#: Model orders: classes interleaved (gathered rows), in blocks (views), several N.
ORDERS = {
    "sgd_adam": ["sgd", "adam"],
    "interleaved4": ["adam", "sgd", "adamw", "sgd_nesterov"],
    "blocks5": ["sgd", "sgd_plain", "adam", "adam_betas", "sgd_nesterov"],
    "all6": ["rmsprop", "sgd", "adamw", "adam", "rmsprop_plain", "sgd_plain"],
}


class MLP(nn.Module):
    """A pytorch/examples-style MLP: [B, 6] -> [B, 4]."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class SmallCNN(nn.Module):
    """A small conv net with BatchNorm: [B, 2, 6, 6] -> [B, 4]."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)  # as ResNet's, before a BN
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 4)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(x.flatten(1))


ARCHS = {"mlp": (MLP, (6,)), "cnn": (SmallCNN, (2, 6, 6))}


def make(arch: str, n: int, dtype: torch.dtype) -> list[nn.Module]:
    cls, _ = ARCHS[arch]
    models = []
    for i in range(n):
        torch.manual_seed(100 + i)
        models.append(cls().to(dtype))
    return models


def batches(arch: str, steps: int, dtype: torch.dtype, seed: int = 7):
    _, shape = ARCHS[arch]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, *shape, generator=g, dtype=dtype),
             torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]


def schedulers(kind: str, opt: torch.optim.Optimizer, models: list[int]):
    """Per-model schedules: on the fused optimizer one scheduler over all groups (group i is
    model i), on stock optimizer i the same scheduler over its one group."""
    if kind == "steplr":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    lambdas = [(lambda s, i=i: 0.9 ** s * (1.0 + 0.25 * i)) for i in models]
    return torch.optim.lr_scheduler.LambdaLR(opt, lambdas if len(models) > 1 else lambdas[0])


def solo_step(model, opt, x, y) -> dict[str, torch.Tensor]:
    """One stock training step; returns the gradients it used (by parameter name)."""
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    opt.step()
    return grads


def inject(fused: nn.Module, grads: list[dict[str, torch.Tensor]]) -> None:
    """Give each stacked parameter the models' own gradients, ``[N, ...]``."""
    for name, p in fused.named_parameters():
        p.grad = torch.stack([g[name] for g in grads])


def assert_state_equal(stock: torch.optim.Optimizer, model: nn.Module,
                       other: torch.optim.Optimizer, other_model: nn.Module,
                       exact: bool, rtol: float = 0.0, where: str = "") -> None:
    """Same class, hyper-parameters, and per-parameter state (keys and values)."""
    assert type(other) is type(stock), where
    for key in ("lr", "momentum", "betas", "weight_decay", "alpha", "nesterov", "amsgrad"):
        if key in stock.param_groups[0]:
            assert other.param_groups[0][key] == stock.param_groups[0][key], (where, key)
    theirs = dict(other_model.named_parameters())
    for name, p in model.named_parameters():
        mine_state, their_state = stock.state[p], other.state[theirs[name]]
        assert set(mine_state) == set(their_state), (where, name)
        for key, value in mine_state.items():
            got = their_state[key]
            if not isinstance(value, torch.Tensor):
                assert got == value, (where, name, key)
            elif exact:
                assert torch.equal(got.to(value.dtype), value), (where, name, key)
            else:
                scale = value.abs().max().item() or 1.0
                err = (got.to(value.dtype) - value).abs().max().item()
                assert err <= rtol * scale, (where, name, key, err / scale)


def assert_params(fused: nn.Module, solos: list[nn.Module], exact: bool,
                  rtol: float = 0.0) -> None:
    stacked = dict(fused.named_parameters())
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            got = stacked[name][i]
            if exact:
                assert torch.equal(got, p), f"model {i}, {name}: not bit for bit"
            else:
                err = (got - p).abs().max().item() / p.abs().max().item()
                assert err <= rtol, f"model {i}, {name}: relative difference {err:.3g}"


def setup(arch: str, order: list[str], dtype: torch.dtype, pre_steps: list[int]):
    """N models with stock optimizers, some stepped alone first; their deep copies
    (the reference) and the fused module with the fused optimizer."""
    models = make(arch, len(order), dtype)
    opts = [STOCK[name](m.parameters()) for name, m in zip(order, models)]
    warmup = batches(arch, max(pre_steps) or 1, dtype, seed=99)
    for m, o, k in zip(models, opts, pre_steps):
        for x, y in warmup[:k]:
            solo_step(m, o, x, y)
    solos = copy.deepcopy(models)
    solo_opts = [STOCK[name](m.parameters()) for name, m in zip(order, solos)]
    for o, o_from in zip(solo_opts, opts):
        o.load_state_dict(o_from.state_dict())
    fused = hftc.fuse(models)
    return fused, ho.fuse_optimizers(fused, opts), solos, solo_opts


@pytest.mark.parametrize("sched", ["steplr", "lambdalr"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_mixed_classes_step_as_stock_bit_for_bit(order, arch, dtype, sched):
    """Given each model's own gradients, 10 steps with per-model schedules leave every
    parameter, every state tensor and every lr exactly as N stock optimizers do."""
    classes = ORDERS[order]
    n = len(classes)
    pre = [k % 3 for k in range(n)]  # some stock optimizers stepped before fusing
    fused, opt, solos, solo_opts = setup(arch, classes, dtype, pre)
    assert isinstance(opt, ho.MixedOptimizer)
    sched_fused = schedulers(sched, opt, list(range(n)))
    sched_solo = [schedulers(sched, o, [i]) for i, o in enumerate(solo_opts)]
    for x, y in batches(arch, 10, dtype):
        inject(fused, [solo_step(m, o, x, y) for m, o in zip(solos, solo_opts)])
        opt.step()
        opt.zero_grad()
        sched_fused.step()
        for s in sched_solo:
            s.step()
    assert all(p.grad is None for p in fused.parameters())
    assert [g["lr"] for g in opt.param_groups] == [o.param_groups[0]["lr"] for o in solo_opts]
    assert_params(fused, solos, exact=True)
    models = fused.unfuse()
    back = ho.unfuse_optimizers(fused, opt, models)
    for i, (o, m) in enumerate(zip(back, models)):
        assert_state_equal(solo_opts[i], solos[i], o, m, exact=True, where=f"model {i}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_mixed_classes_train_through_hftc_fuse(arch, dtype):
    """End to end: fused forward and backward of the per-model losses, one mixed step,
    per-model LambdaLR; each model ends where its stock optimizer alone takes it."""
    classes = ORDERS["all6"]
    n = len(classes)
    fused, opt, solos, solo_opts = setup(arch, classes, dtype, [0] * n)
    sched_fused = schedulers("lambdalr", opt, list(range(n)))
    sched_solo = [schedulers("lambdalr", o, [i]) for i, o in enumerate(solo_opts)]
    for x, y in batches(arch, 10, dtype):
        for m, o in zip(solos, solo_opts):
            solo_step(m, o, x, y)
        opt.zero_grad()
        out = fused(x)
        torch.stack([F.cross_entropy(out[i], y) for i in range(n)]).sum().backward()
        opt.step()
        sched_fused.step()
        for s in sched_solo:
            s.step()
    rtol = 1e-9 if dtype == torch.float64 else 1e-4
    assert_params(fused, solos, exact=False, rtol=rtol)
    models = fused.unfuse()
    for i, (o, m) in enumerate(zip(ho.unfuse_optimizers(fused, opt, models), models)):
        assert_state_equal(solo_opts[i], solos[i], o, m, exact=False, rtol=rtol * 10,
                           where=f"model {i}")


def train_injected(fused, opt, solos, solo_opts, data, sched_fused=None, sched_solo=()):
    """Steps of the stock optimizers, and the fused one on their gradients."""
    for x, y in data:
        inject(fused, [solo_step(m, o, x, y) for m, o in zip(solos, solo_opts)])
        opt.step()
        opt.zero_grad()
        if sched_fused is not None:
            sched_fused.step()
        for s in sched_solo:
            s.step()


def test_state_dict_round_trip_continues_bit_for_bit():
    """A checkpoint (state_dict) loaded back, after the training went on, continues as the
    training would have from there; a state dict of other classes or models is refused."""
    classes = ORDERS["interleaved4"]
    fused, opt, solos, solo_opts = setup("mlp", classes, torch.float64, [1, 0, 2, 0])
    sched = schedulers("lambdalr", opt, list(range(4)))
    train_injected(fused, opt, copy.deepcopy(solos), copy.deepcopy(solo_opts),
                   batches("mlp", 3, torch.float64), sched)
    saved = copy.deepcopy({"model": fused.state_dict(), "opt": opt.state_dict(),
                           "sched": sched.state_dict()})
    torch.manual_seed(11)
    grads = [[{n: torch.randn_like(p) for n, p in solos[0].named_parameters()}
              for _ in range(4)] for _ in range(4)]

    def go():
        for step_grads in grads:
            inject(fused, step_grads)
            opt.step()
            sched.step()
        return {k: v.clone() for k, v in fused.state_dict().items()}
    first = go()
    fused.load_state_dict(saved["model"])
    opt.load_state_dict(copy.deepcopy(saved["opt"]))
    sched.load_state_dict(saved["sched"])
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in saved["opt"]["param_groups"]]
    second = go()
    for key in first:
        assert torch.equal(first[key], second[key]), key

    other = ["adam", "adam", "adamw", "sgd"]
    fused2, opt2, _, _ = setup("mlp", other, torch.float64, [0] * 4)
    with pytest.raises(FusionArgumentError, match=r"each model must keep its class"):
        opt2.load_state_dict(saved["opt"])
    single = ho.Adam(fused2.parameters(), lr=1e-3)
    with pytest.raises(FusionArgumentError, match=r"not a MixedOptimizer's"):
        opt.load_state_dict(single.state_dict())


def test_unfuse_then_fuse_again_continues_each_model():
    """unfuse_optimizers gives each model its own stock class with its state; those train
    on alone exactly as the fused array does, and fuse_optimizers of them continues it."""
    classes = ORDERS["all6"]
    fused, opt, solos, solo_opts = setup("cnn", classes, torch.float64, [2, 0, 1, 0, 2, 1])
    train_injected(fused, opt, solos, solo_opts, batches("cnn", 4, torch.float64))
    models = fused.unfuse()
    back = ho.unfuse_optimizers(fused, opt, models)
    assert [type(o) for o in back] == [type(o) for o in solo_opts]
    refused = hftc.fuse(models)
    again = ho.fuse_optimizers(refused, back)
    assert isinstance(again, ho.MixedOptimizer)
    assert again.part_rows() == [[0, 4], [1, 5], [2], [3]]
    twin = copy.deepcopy(solos)  # the unfused optimizers, stepped on the same gradients
    twin_opts = [type(o)(m.parameters()) for o, m in zip(solo_opts, twin)]
    for o, o_from in zip(twin_opts, back):
        o.load_state_dict(o_from.state_dict())
    data = batches("cnn", 4, torch.float64, seed=5)
    train_injected(refused, again, solos, solo_opts, data)
    assert_params(refused, solos, exact=True)
    for x, y in data:
        for m, o in zip(models, back):
            solo_step(m, o, x, y)
    for i, (m, solo) in enumerate(zip(models, solos)):
        for (name, p), q in zip(m.named_parameters(), solo.parameters()):
            assert torch.equal(p, q), (i, name)


@pytest.mark.parametrize("keep", [[3, 0, 4], [1], [4, 2, 1, 0]])
def test_keep_models_mid_training_equals_the_subset_alone(keep):
    """hftc.keep_models cuts the mixed optimizer (and the per-model LambdaLR) in place; the
    kept models train on as they do alone, a class whose models are all dropped is gone."""
    classes = ORDERS["blocks5"]
    fused, opt, solos, solo_opts = setup("mlp", classes, torch.float64, [0, 1, 0, 2, 1])
    sched = schedulers("lambdalr", opt, list(range(5)))
    sched_solo = [schedulers("lambdalr", o, [i]) for i, o in enumerate(solo_opts)]
    train_injected(fused, opt, solos, solo_opts, batches("mlp", 4, torch.float64), sched,
                   sched_solo)
    hftc.keep_models(fused, keep, optimizers=[opt], schedulers=[sched])
    assert opt.num_models == len(keep)
    assert sorted(i for rows in opt.part_rows() for i in rows) == list(range(len(keep)))
    assert [type(p).__name__ for p in opt.parts()] == list(dict.fromkeys(
        "SGD" if classes[i].startswith("sgd") else "Adam" for i in sorted(keep)))
    solos = [solos[i] for i in keep]
    solo_opts = [solo_opts[i] for i in keep]
    train_injected(fused, opt, solos, solo_opts, batches("mlp", 4, torch.float64, seed=3),
                   sched, [sched_solo[i] for i in keep])
    assert_params(fused, solos, exact=True)
    models = fused.unfuse()
    for i, (o, m) in enumerate(zip(ho.unfuse_optimizers(fused, opt, models), models)):
        assert_state_equal(solo_opts[i], solos[i], o, m, exact=True, where=f"model {i}")


def test_skipped_models_keep_parameters_and_state():
    """step(skip_models=...) (what hftc.amp.GradScaler passes) leaves a skipped model of
    any class exactly as it was, and steps the others."""
    fused, opt, solos, solo_opts = setup("mlp", ORDERS["interleaved4"], torch.float64,
                                         [1, 1, 1, 1])
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    state_before = copy.deepcopy(opt.state_dict()["hftc"]["mixed"])
    data = batches("mlp", 1, torch.float64)
    inject(fused, [solo_step(m, o, *data[0]) for m, o in zip(solos, solo_opts)])
    opt.step(skip_models=[True, False, False, True])
    after = fused.state_dict()
    for key in before:
        for i in (0, 3):
            assert torch.equal(after[key][i], before[key][i]), (key, i)
    stacked = dict(fused.named_parameters())
    for i in (1, 2):
        for name, p in solos[i].named_parameters():
            assert torch.equal(stacked[name][i], p), (i, name)
    state_after = opt.state_dict()["hftc"]["mixed"]
    for part_before, part_after in zip(state_before, state_after):
        for j, model in enumerate(part_before["rows"]):
            if model not in (0, 3):
                continue
            for pid, st in part_before["state"]["state"].items():
                for key, value in st.items():
                    now = part_after["state"]["state"][pid][key]
                    assert torch.equal(now[j], value[j]), (model, key)


def test_unsupported_or_uncapturable_mixes_are_refused_naming_the_model():
    models = make("mlp", 3, torch.float64)
    fused = hftc.fuse(models)
    sgd = torch.optim.SGD(models[0].parameters(), lr=0.1)
    adam = torch.optim.Adam(models[2].parameters())
    lbfgs = torch.optim.LBFGS(models[1].parameters())
    with pytest.raises(FusionTypeError, match=r"does not support LBFGS: optimizers\[1\] "
                                              r"\(model 1\) is a torch\.optim\.lbfgs\.LBFGS "
                                              r"\(nor fuse it with the other models' Adam, SGD"):
        ho.fuse_optimizers(fused, [sgd, lbfgs, adam])
    capturable = torch.optim.Adam(models[1].parameters(), capturable=True)
    with pytest.raises(FusionArgumentError, match=r"optimizers\[1\] \(model 1, Adam\) has "
                                                  r"capturable=True"):
        ho.fuse_optimizers(fused, [sgd, capturable, adam])
    partial = torch.optim.Adam(models[1].fc2.parameters())
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(SGD\) and optimizers\[1\] \(Adam\) "
                                         r"optimize different parameters \(only in 0: "
                                         r"\['fc1.bias', 'fc1.weight', 'norm.bias', 'norm.weight'\]"):
        ho.fuse_optimizers(fused, [sgd, partial, torch.optim.SGD(models[2].parameters())])
    opt = ho.fuse_optimizers(fused, [sgd, torch.optim.SGD(models[1].parameters()), adam])
    from hftc.optim.slicing import fused_param_names, load_model_slice
    with pytest.raises(FusionTypeError, match=r"model 2 was trained with Adam, and the "
                                              r"optimizer given for it is a SGD"):
        load_model_slice(opt.state_dict(), fused_param_names(fused, opt), 2,
                         torch.optim.SGD(models[2].parameters()), models[2])


def test_param_group_dicts_in_a_mix():
    """nanoGPT's AdamW groups (decay / no-decay) next to a one-group SGD: each class keeps
    its own groups, bit for bit, and unfuse_optimizers gives them back."""
    def nanogpt_groups(m):
        return [{"params": [m.fc1.weight, m.fc2.weight], "weight_decay": 0.1},
                {"params": [m.fc1.bias, m.fc2.bias, m.norm.weight, m.norm.bias],
                 "weight_decay": 0.0}]
    makers = [lambda m: torch.optim.AdamW(nanogpt_groups(m), lr=1e-2),
              lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
              lambda m: torch.optim.AdamW(nanogpt_groups(m), lr=3e-3, betas=(0.9, 0.95))]
    models = make("mlp", 3, torch.float32)
    solos = copy.deepcopy(models)
    fused = hftc.fuse(models)
    opt = ho.fuse_optimizers(fused, [f(m) for f, m in zip(makers, models)])
    solo_opts = [f(m) for f, m in zip(makers, solos)]
    train_injected(fused, opt, solos, solo_opts, batches("mlp", 6, torch.float32))
    assert_params(fused, solos, exact=True)
    plain = fused.unfuse()
    back = ho.unfuse_optimizers(fused, opt, plain)
    assert [len(o.param_groups) for o in back] == [2, 1, 2]
    assert [g["weight_decay"] for g in back[2].param_groups] == [0.1, 0.0]
    for i in range(3):
        assert_state_equal(solo_opts[i], solos[i], back[i], plain[i], exact=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_mixed_classes_with_fused_adam(dtype, device):
    """Adam with fused=True beside SGD and RMSprop (foreach on the GPU): the mixed array is
    bit for bit each class's own fused optimizer over its models, and stock's to rounding.
    (On an H200 the fused kernel refused step counts kept on the host.)"""
    order = ["adam_fused", "sgd", "adam_fused", "rmsprop", "sgd"]
    makers = {**STOCK, "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True)}
    models = [m.to(device) for m in make("cnn", len(order), dtype)]
    solos = copy.deepcopy(models)
    by_class: dict[str, list[int]] = {}
    for i, name in enumerate(order):
        by_class.setdefault(name.split("_")[0], []).append(i)
    alone = {c: copy.deepcopy([models[i] for i in rows]) for c, rows in by_class.items()}
    fused = hftc.fuse(models)
    opt = ho.fuse_optimizers(fused, [makers[n](m.parameters()) for n, m in zip(order, models)])
    solo_opts = [makers[n](m.parameters()) for n, m in zip(order, solos)]
    per_class = {}
    for c, rows in by_class.items():
        f = hftc.fuse(alone[c])
        per_class[c] = (f, ho.fuse_optimizers(
            f, [makers[order[i]](m.parameters()) for i, m in zip(rows, alone[c])]))
    for x, y in batches("cnn", 10, dtype):
        grads = [solo_step(m, o, x.to(device), y.to(device)) for m, o in zip(solos, solo_opts)]
        inject(fused, grads)
        opt.step()
        for c, rows in by_class.items():
            inject(per_class[c][0], [grads[i] for i in rows])
            per_class[c][1].step()
    stacked = dict(fused.named_parameters())
    for c, rows in by_class.items():
        for name, p in per_class[c][0].named_parameters():
            assert torch.equal(stacked[name][rows], p), (c, name)
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            torch.testing.assert_close(stacked[name][i], p.detach())


def test_deepcopy_and_pickle_continue_bit_for_bit():
    """copy.deepcopy / pickle of (fused, optimizer) carry each class's part and its state."""
    import pickle

    fused, opt, solos, solo_opts = setup("mlp", ORDERS["interleaved4"], torch.float64,
                                         [1, 0, 1, 0])
    train_injected(fused, opt, solos, solo_opts, batches("mlp", 2, torch.float64))
    copies = [copy.deepcopy((fused, opt)), pickle.loads(pickle.dumps((fused, opt)))]
    for fused_copy, opt_copy in copies:
        solos_copy, solo_opts_copy = copy.deepcopy((solos, solo_opts))
        train_injected(fused_copy, opt_copy, solos_copy, solo_opts_copy,
                       batches("mlp", 3, torch.float64, seed=3))
        assert_params(fused_copy, solos_copy, exact=True)
