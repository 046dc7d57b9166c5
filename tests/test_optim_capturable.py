"""Capturable fused optimizers: per-model values and step counts as device tensors.

``hftc.optim.Adam/AdamW(capturable=True)`` and ``hftc.optim.SGD`` on CUDA run a step that
a CUDA graph can capture: no host sync, coefficient tensors made once, and
``refresh_hyperparameters()`` copies the current ``param_groups`` values (schedulers')
into them in place before a replay.  Each model must train exactly as its stock
optimizer does: Adam as stock ``Adam(capturable=True)`` (on the CPU, where torch refuses
capturable, with torch's device check widened to the CPU), SGD as stock SGD.
"""

from __future__ import annotations

import copy

import pytest
import torch
from optim_helpers import single_thread  # noqa: F401  (autouse fixture)

import hftc.optim as ho
from hftc.errors import FusionArgumentError

DTYPES = [torch.float64, torch.float32]
SHAPES = [(5, 7), (7,), (3, 3, 2, 2)]

ADAM_CONFIGS = [
    dict(lr=1e-2, betas=(0.9, 0.999)),
    dict(lr=3e-2, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True),
    dict(lr=1e-3, eps=1e-6, maximize=True),
    dict(lr=5e-3, betas=(0.5, 0.9), weight_decay=0.01),
]
SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.02, momentum=0.5, dampening=0.3, weight_decay=0.01, maximize=True),
    dict(lr=0.03, momentum=0.9, nesterov=True, weight_decay=1e-3),
]


@pytest.fixture
def stock_capturable_on_cpu(monkeypatch):
    """torch refuses Adam(capturable=True) on the CPU (a check of the device only)."""
    import torch.optim.adam as stock_adam

    monkeypatch.setattr(stock_adam, "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cpu", "cuda"])


@pytest.fixture
def sgd_capturable_on_cpu(monkeypatch):
    """hftc's SGD is capturable on CUDA; here, its capturable step on the CPU."""
    monkeypatch.setattr(ho.SGD, "_capturable", lambda self: not self._flag("fused"))


def per_model_lists(configs: list[dict], stock_cls) -> dict:
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(stock_cls).parameters.items()}
    keys = sorted(set().union(*configs))
    return {k: [c.get(k, defaults[k]) for c in configs] for k in keys}


def make_pair(fused_cls, stock_cls, configs, dtype, device="cpu", seed=0, **flags):
    g = torch.Generator().manual_seed(seed)
    n = len(configs)
    start = [torch.randn((n, *s), generator=g, dtype=dtype) for s in SHAPES]
    fused = [p.clone().to(device).requires_grad_() for p in start]
    solos = [[p[i].clone().to(device).requires_grad_() for p in start] for i in range(n)]
    opt = fused_cls(fused, **per_model_lists(configs, stock_cls), **flags)
    stock = [stock_cls(ps, **c, **flags) for ps, c in zip(solos, configs)]
    return fused, solos, opt, stock


def step_both(fused, solos, opt, stock, g, before_step=None):
    grads = [torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) for p in fused]
    for p, grad in zip(fused, grads):
        p.grad = grad.clone()
    if before_step is not None:
        before_step()
    opt.step()
    for i, (params, o) in enumerate(zip(solos, stock)):
        for q, grad in zip(params, grads):
            q.grad = grad[i].clone()
        o.step()


def assert_equal(fused, solos):
    for i, params in enumerate(solos):
        for k, (p, q) in enumerate(zip(fused, params)):
            assert torch.equal(p[i], q), (i, k, (p[i] - q).abs().max().item())


def coefficient_tensors(opt) -> list[tuple[int, torch.Tensor]]:
    return [(table.data_ptr(), table.clone())
            for _, coef in opt._coefficient_cache.values() for table in coef._cache.values()]


# ------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_capturable_adam_is_stock_capturable_bit_for_bit(cls, dtype, stock_capturable_on_cpu):
    configs = ADAM_CONFIGS if cls == "Adam" else [
        {**c, "weight_decay": c.get("weight_decay", 0.05)} for c in ADAM_CONFIGS]
    fused, solos, opt, stock = make_pair(getattr(ho, cls), getattr(torch.optim, cls), configs,
                                         dtype, capturable=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        step_both(fused, solos, opt, stock, g)
    assert_equal(fused, solos)
    for p in fused:
        step = opt.state[p]["step"]
        assert step.shape == (len(configs),) and step.dtype == torch.float32
        assert step.device == p.device and step.tolist() == [6.0] * len(configs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_capturable_sgd_step_is_stock_sgd_bit_for_bit(dtype, sgd_capturable_on_cpu):
    # Models without a momentum, with one (first step: the buffer is the gradient),
    # nesterov, maximize: all through masks, with no host sync.
    fused, solos, opt, stock = make_pair(ho.SGD, torch.optim.SGD, SGD_CONFIGS, dtype)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        step_both(fused, solos, opt, stock, g)
    assert_equal(fused, solos)


# ------------------------------------------------- coefficients made once, refreshed


@pytest.mark.parametrize("cls", ["Adam", "SGD"])
def test_refresh_writes_scheduled_values_into_the_same_tensors(cls, stock_capturable_on_cpu,
                                                               sgd_capturable_on_cpu):
    # Per-model schedulers change lr (and SGD's momentum, as OneCycleLR does) between
    # steps; refresh_hyperparameters() puts the new values into the tensors the step
    # reads (same memory: a captured graph would read them), and the step that follows
    # is each stock model's with its scheduled values.
    configs = ADAM_CONFIGS if cls == "Adam" else SGD_CONFIGS[1:]
    flags = {"capturable": True} if cls == "Adam" else {}
    fused, solos, opt, stock = make_pair(getattr(ho, cls), getattr(torch.optim, cls),
                                         configs, torch.float64, **flags)
    n = len(configs)
    gammas = [0.5, 0.9, 0.7, 0.3][:n]
    # One lambda per param group: per model, on the fused optimizer.
    fused_sched = torch.optim.lr_scheduler.LambdaLR(
        opt, [lambda epoch, gamma=gamma: gamma ** epoch for gamma in gammas])
    stock_sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda epoch, gamma=gamma: gamma ** epoch)
                   for o, gamma in zip(stock, gammas)]
    g = torch.Generator().manual_seed(1)
    step_both(fused, solos, opt, stock, g)
    before = coefficient_tensors(opt)
    assert before
    for k in range(3):
        fused_sched.step()
        for i, s in enumerate(stock_sched):
            s.step()
            if cls == "SGD":
                momentum = 0.8 - 0.1 * k
                stock[i].param_groups[0]["momentum"] = momentum
                opt.param_groups[i]["momentum"] = momentum
        opt.refresh_hyperparameters()
        after = coefficient_tensors(opt)
        assert [ptr for ptr, _ in after] == [ptr for ptr, _ in before]
        assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(after, before))
        coef = next(c for _, c in opt._coefficient_cache.values())
        lr_row = "neg_lr" if cls == "SGD" else "lr"
        want = [(-1.0 if cls == "SGD" else 1.0) * group["lr"] for group in opt.param_groups]
        assert coef.row(lr_row) == want
        assert coef(lr_row, fused[0]).flatten().tolist() == want  # the tensor the step reads
        step_both(fused, solos, opt, stock, g)
        assert coefficient_tensors(opt)[0][0] == before[0][0]
    assert_equal(fused, solos)


def test_refresh_of_a_step_that_is_not_capturable_is_refused():
    p = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(FusionArgumentError, match="not capturable.*capturable=True"):
        ho.Adam([p], lr=[0.1, 0.2]).refresh_hyperparameters()
    with pytest.raises(FusionArgumentError, match="SGD: with its parameters on a CUDA device"):
        ho.SGD([p], lr=[0.1, 0.2]).refresh_hyperparameters()


def test_refresh_refuses_a_change_that_picks_other_ops(stock_capturable_on_cpu):
    p = torch.randn(2, 3, requires_grad=True)
    opt = ho.Adam([p], lr=[0.1, 0.2], capturable=True)
    p.grad = torch.randn(2, 3)
    opt.step()
    opt.param_groups[1]["lr"] = 0.05
    opt.refresh_hyperparameters()  # a value: fine
    opt.param_groups[1]["amsgrad"] = True
    with pytest.raises(FusionArgumentError,
                       match=r"amsgrad changed .*\[False, False\] -> \[False, True\].*capture"):
        opt.refresh_hyperparameters()
    opt.param_groups[1]["amsgrad"] = False
    opt.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(FusionArgumentError, match="weight_decay changed"):
        opt.refresh_hyperparameters()


def test_capturable_and_fused_together_are_refused():
    p = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(FusionArgumentError, match="capturable=True and fused=True"):
        ho.Adam([p], lr=[0.1, 0.2], capturable=True, fused=True)


# ------------------------------------------------------------------ state dicts


def test_capturable_state_dict_resumes_exactly_and_keeps_steps_on_the_device(
        stock_capturable_on_cpu):
    fused, solos, opt, stock = make_pair(ho.Adam, torch.optim.Adam, ADAM_CONFIGS,
                                         torch.float32, capturable=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        step_both(fused, solos, opt, stock, g)
    saved = copy.deepcopy(opt.state_dict())
    resumed = ho.Adam(fused, lr=0.5, capturable=True)
    resumed.load_state_dict(saved)
    for p in fused:
        assert resumed.state[p]["step"].device == p.device
        assert resumed.state[p]["step"].dtype == torch.float32
    for _ in range(3):
        step_both(fused, solos, resumed, stock, g)
    assert_equal(fused, solos)


def test_a_non_capturable_state_dict_loads_into_a_capturable_optimizer(
        stock_capturable_on_cpu):
    fused, solos, opt, stock = make_pair(ho.Adam, torch.optim.Adam, ADAM_CONFIGS,
                                         torch.float64)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        step_both(fused, solos, opt, stock, g)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        group["capturable"] = True
    resumed = ho.Adam(fused, capturable=True)
    resumed.load_state_dict(saved)
    capturable_stock = []
    for o, params in zip(stock, solos):
        c = torch.optim.Adam(params, capturable=True)
        state = o.state_dict()
        for group in state["param_groups"]:
            group["capturable"] = True
        c.load_state_dict(state)
        capturable_stock.append(c)
    for _ in range(2):
        step_both(fused, solos, resumed, capturable_stock, g)
    assert_equal(fused, solos)


# ------------------------------------------------------------------ CUDA graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cls", ["Adam", "SGD"])
def test_a_captured_step_replays_with_each_schedulers_values(cls):
    configs = ADAM_CONFIGS if cls == "Adam" else SGD_CONFIGS
    flags = {"capturable": True} if cls == "Adam" else {}
    fused, solos, opt, stock = make_pair(getattr(ho, cls), getattr(torch.optim, cls), configs,
                                         torch.float32, device="cuda", **flags)
    g = torch.Generator().manual_seed(1)
    grads = [torch.zeros_like(p) for p in fused]
    for p, grad in zip(fused, grads):
        p.grad = grad
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up steps, stock's too
            new = [torch.randn(p.shape, generator=g).cuda() for p in fused]
            for grad, value in zip(grads, new):
                grad.copy_(value)
            opt.step()
            for i, (params, o) in enumerate(zip(solos, stock)):
                for q, value in zip(params, new):
                    q.grad = value[i].clone()
                o.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for k in range(4):
        for i in range(len(configs)):
            lr = configs[i]["lr"] * 0.5 ** (k + 1)
            opt.param_groups[i]["lr"] = lr
            stock[i].param_groups[0]["lr"] = lr
        new = [torch.randn(p.shape, generator=g).cuda() for p in fused]
        for grad, value in zip(grads, new):
            grad.copy_(value)
        opt.refresh_hyperparameters()
        graph.replay()
        for i, (params, o) in enumerate(zip(solos, stock)):
            for q, value in zip(params, new):
                q.grad = value[i].clone()
            o.step()
    torch.cuda.synchronize()
    for i, params in enumerate(solos):
        for p, q in zip(fused, params):
            torch.testing.assert_close(p[i], q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_stock_capturable_optimizers_fuse_and_unfuse_and_continue_exactly(
        cls, stock_capturable_on_cpu):
    # N stepped stock Adam(capturable=True) -> one fused capturable optimizer (its step
    # counts on the device) -> N stock ones again; every model continues as if alone.
    from optim_helpers import (
        StackedModels,
        make_batches,
        make_models,
        train_fused,
        train_solo,
    )

    configs = [dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.99), weight_decay=0.1),
               dict(lr=1e-3, amsgrad=True, maximize=True)]
    models = make_models(len(configs), torch.float32)
    solos = [copy.deepcopy(m) for m in models]
    batches = make_batches(6, torch.float32)
    stocks = [getattr(torch.optim, cls)(m.parameters(), capturable=True, **c)
              for m, c in zip(models, configs)]
    solo_opts = [getattr(torch.optim, cls)(m.parameters(), capturable=True, **c)
                 for m, c in zip(solos, configs)]
    for m, o in zip(models, stocks):
        train_solo(m, o, batches[:2])
    fused = StackedModels(models)
    opt = ho.fuse_optimizers(fused, stocks)
    assert type(opt) is getattr(ho, cls) and opt._capturable()
    for p in fused.parameters():
        assert opt.state[p]["step"].tolist() == [2.0] * 3
    train_fused(fused, opt, batches[2:4])
    plain = fused.unfuse()
    back = ho.unfuse_optimizers(fused, opt, plain)
    assert all(o.param_groups[0]["capturable"] for o in back)
    for m, o in zip(plain, back):
        train_solo(m, o, batches[4:])
    for m, o in zip(solos, solo_opts):
        train_solo(m, o, batches)
    for m, solo in zip(plain, solos):
        for (name, p), q in zip(m.named_parameters(), solo.parameters()):
            assert torch.equal(p, q), name


@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
def test_sgd_model_skipped_on_its_first_step_starts_its_buffer_later_like_stock(
        capturable, monkeypatch):
    # The step knows which momentum buffers all exist without reading them on the host;
    # skip_models puts a skipped model's first-step state back (no buffer yet), so its
    # next step must again be stock's first: buf = grad, not (1 - dampening) * grad.
    if capturable:
        monkeypatch.setattr(ho.SGD, "_capturable", lambda self: True)
    configs = [dict(lr=0.1, momentum=0.9, dampening=0.5), dict(lr=0.05, momentum=0.8)]
    fused, solos, opt, stock = make_pair(ho.SGD, torch.optim.SGD, configs, torch.float64)
    g = torch.Generator().manual_seed(1)
    for k in range(4):
        grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in fused]
        for p, grad in zip(fused, grads):
            p.grad = grad.clone()
        skip = [k == 0, False]
        opt.step(skip_models=skip)
        for i, (params, o) in enumerate(zip(solos, stock)):
            if skip[i]:
                continue
            for q, grad in zip(params, grads):
                q.grad = grad[i].clone()
            o.step()
    assert_equal(fused, solos)


# ------------------------------------------------- skipping models on the device


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (``.item()``, ``bool(t)``)
    or give a shape that depends on it (``nonzero``): each a host sync on a GPU, and
    what a CUDA graph cannot capture."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tags = getattr(func, "tags", ())
        if func is torch.ops.aten._local_scalar_dense.default \
                or torch.Tag.dynamic_output_shape in tags \
                or torch.Tag.data_dependent_output in tags:
            self.reads.append(func.name())
        return func(*args, **(kwargs or {}))


def stock_state_matches(opt, fused, stock, models):
    """Each model's optimizer state (moments, buffers, step counts) equals its stock
    optimizer's, bit for bit; a model stock never stepped has fresh (zero) state."""
    for i in models:
        for p, q in zip(fused, stock[i].param_groups[0]["params"]):
            want, got = stock[i].state.get(q, {}), opt.state[p]
            if not want:
                for key, value in got.items():
                    assert not value[i].any(), (i, key)
            for key, value in want.items():
                if value is None:
                    continue
                value = torch.as_tensor(value, dtype=got[key].dtype)
                assert torch.equal(got[key][i], value), (i, key)


SKIP_SCHEDULE = [  # per step, which models overflow (inf or NaN gradients)
    [True, False, False, True],   # model 0 and 3 on their first step
    [False, False, False, False],
    [False, True, False, False],
    [True, True, True, True],     # every model
    [False, False, True, False],
    [False, False, False, False],
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cls", ["Adam", "AdamW", "SGD"])
def test_skip_models_on_the_device_leaves_skipped_models_as_stock_does(
        cls, dtype, stock_capturable_on_cpu, sgd_capturable_on_cpu):
    # skip_models as a bool tensor on a capturable optimizer: never read on the host, and
    # every skipped model (its gradients inf / NaN, as after an fp16 overflow) keeps its
    # parameters, moments / momentum buffer and step count exactly, as when
    # torch.amp.GradScaler skips that model's stock optimizer.step(); the others step as
    # their stock optimizers do, bit for bit.
    if cls == "SGD":
        configs, flags = SGD_CONFIGS, {}
    else:
        configs, flags = ADAM_CONFIGS, {"capturable": True}
        if cls == "AdamW":
            configs = [{**c, "weight_decay": c.get("weight_decay", 0.05)} for c in configs]
    fused, solos, opt, stock = make_pair(getattr(ho, cls), getattr(torch.optim, cls),
                                         configs, dtype, **flags)
    assert opt.is_capturable
    g = torch.Generator().manual_seed(1)
    reads = HostReads()
    for k, skip in enumerate(SKIP_SCHEDULE):
        grads = [torch.randn(p.shape, generator=g, dtype=dtype) for p in fused]
        for i in range(len(configs)):
            if skip[i]:  # an overflow: one inf or NaN, or all of them
                grads[k % len(grads)][i].view(-1)[0] = float("inf") if i % 2 else float("nan")
                if k == 3:
                    grads[0][i].fill_(float("inf"))
        for p, grad in zip(fused, grads):
            p.grad = grad.clone()
        with reads:
            opt.step(skip_models=torch.tensor(skip))
        for i, (params, o) in enumerate(zip(solos, stock)):
            if skip[i]:
                continue
            for q, grad in zip(params, grads):
                q.grad = grad[i].clone()
            o.step()
        assert_equal(fused, solos)
        stock_state_matches(opt, fused, stock, range(len(configs)))
    assert reads.reads == []
    if cls != "SGD":
        steps = [sum(not s[i] for s in SKIP_SCHEDULE) for i in range(len(configs))]
        for p in fused:
            assert opt.state[p]["step"].tolist() == steps


def test_skip_models_on_the_device_must_have_one_flag_per_model(stock_capturable_on_cpu):
    p = torch.randn(3, 2, requires_grad=True)
    opt = ho.Adam([p], lr=0.1, capturable=True)
    p.grad = torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"skip_models has shape \[2\] but there are 3 "
                                         r"models.*shape \[3\]"):
        opt.step(skip_models=torch.tensor([True, False]))
