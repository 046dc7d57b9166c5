"""hftc.compile_step on a CUDA GPU: the whole training step as one CUDA graph.

Against the eager fused loop on the device (the same kernels: equal to float rounding)
and N stock models with stock Adam; a scheduler's learning rates applied without
re-capture; dropout drawing anew on every replay; a new input shape captured anew; an
optimizer that offers ``refresh_hyperparameters()`` captured inside the graph; and the
refusals (``.item()``, a host-to-device copy, GradScaler with an optimizer that
is not capturable); hftc.amp.GradScaler inside the graph, with no host sync.  Skipped without CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc
from hftc.errors import FusionArgumentError, StepCaptureError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LRS = [1e-2, 3e-2, 5e-2]


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class MLP(nn.Module):
    """pytorch/examples' MNIST MLP, small; ``p`` > 0 adds dropout."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 5)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def _models(dtype, p=0.0):
    torch.manual_seed(0)
    return [MLP(p).to("cuda", dtype) for _ in LRS]


def _batches(steps, dtype, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, generator=g, dtype=dtype).cuda(),
             torch.randint(0, 5, (batch,), generator=g).cuda()) for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_graph_step_is_the_eager_loop_and_the_serial_loop(dtype):
    models, batches = _models(dtype), _batches(6, dtype)
    fused = hftc.fuse(copy.deepcopy(models))
    opt = hftc.optim.Adam(fused.parameters(), lr=LRS)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = hftc.compile_step(fused, F.cross_entropy, opt, clip_grad_norm=[0.05, 0.5, 5.0])
    assert step.mode == "cuda_graph"
    loop = hftc.fuse(copy.deepcopy(models))
    loop_opt = hftc.optim.Adam(loop.parameters(), lr=LRS)
    loop_sched = torch.optim.lr_scheduler.StepLR(loop_opt, step_size=2, gamma=0.5)
    serial = copy.deepcopy(models)
    serial_opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(serial, LRS)]
    serial_scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in serial_opts]
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {}
    for x, y in batches:
        got = step(x, y)
        sched.step()
        loop_opt.zero_grad()
        want = hftc.per_model(F.cross_entropy)(loop(x), y)
        want.sum().backward()
        hftc.utils.clip_grad_norm_(loop, [0.05, 0.5, 5.0])
        loop_opt.step()
        loop_sched.step()
        torch.testing.assert_close(got, want.detach(), **tol)
        for i, (m, o, s) in enumerate(zip(serial, serial_opts, serial_scheds)):
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), [0.05, 0.5, 5.0][i])
            o.step()
            s.step()
            torch.testing.assert_close(got[i], loss.detach(), **tol)
    assert step.graphs == 1  # steps 3-6 replayed one graph
    for p, q in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(p, q, **tol)
        torch.testing.assert_close(p.grad, q.grad, **tol)
    for i, m in enumerate(serial):
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.state_dict()[name][i], p.detach(), **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_eager_mode_runs_the_models_in_order_as_the_serial_loop(dtype):
    # mode="eager" on a GPU: the step in order (each model's forward, loss and backward
    # in turn) where the fused module runs the models one by one
    models, batches = _models(dtype), _batches(5, dtype)
    fused = hftc.fuse(copy.deepcopy(models), strategy="model_loop")
    step = hftc.compile_step(fused, F.cross_entropy, hftc.optim.Adam(fused.parameters(), lr=LRS),
                             mode="eager")
    serial = copy.deepcopy(models)
    serial_opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(serial, LRS)]
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {}
    for x, y in batches:
        got = step(x, y)
        for i, (m, o) in enumerate(zip(serial, serial_opts)):
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            torch.testing.assert_close(got[i], loss.detach(), **tol)
    assert step.order.chosen == "in_order"
    for i, m in enumerate(serial):
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.state_dict()[name][i], p.detach(), **tol)
            torch.testing.assert_close(fused.get_parameter(name).grad[i], p.grad, **tol)


def test_dropout_draws_anew_on_every_replay():
    fused = hftc.fuse(_models(torch.float32, p=0.5))
    opt = hftc.optim.SGD(fused.parameters(), lr=0.0)  # the weights stay: only masks change
    step = hftc.compile_step(fused, F.cross_entropy, opt)
    x, y = _batches(1, torch.float32)[0]
    losses = [step(x, y) for _ in range(6)]
    assert step.graphs == 1
    replays = losses[2:]
    assert all(not torch.equal(a, b) for a, b in zip(replays, replays[1:]))


def test_a_new_input_shape_gets_its_own_graph():
    models = _models(torch.float32)
    fused = hftc.fuse(copy.deepcopy(models))
    step = hftc.compile_step(fused, F.cross_entropy, hftc.optim.SGD(fused.parameters(), lr=LRS))
    loop = hftc.fuse(copy.deepcopy(models))
    loop_opt = hftc.optim.SGD(loop.parameters(), lr=LRS)
    batches = _batches(3, torch.float32, batch=8) + _batches(3, torch.float32, batch=4) \
        + _batches(1, torch.float32, batch=8)
    for x, y in batches:
        got = step(x, y)
        loop_opt.zero_grad()
        want = hftc.per_model(F.cross_entropy)(loop(x), y)
        want.sum().backward()
        loop_opt.step()
        torch.testing.assert_close(got, want.detach())
    assert step.graphs == 2
    for p, q in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(p, q)


class _CapturableAdam(torch.optim.Adam):
    """Stock Adam over the stacked parameters, capturable: its lr a device tensor that
    ``refresh_hyperparameters`` fills from ``lr_value`` (the interface compile_step uses
    to put the optimizer step inside the graph)."""

    is_capturable = True

    def __init__(self, params, lr):
        self.lr_value = lr
        super().__init__(params, lr=torch.tensor(lr, device="cuda"), capturable=True)

    def refresh_hyperparameters(self):
        for group in self.param_groups:
            group["lr"].fill_(self.lr_value)


def test_an_optimizer_with_refresh_hyperparameters_is_captured_in_the_graph():
    models, batches = _models(torch.float32), _batches(6, torch.float32)
    fused = hftc.fuse(copy.deepcopy(models))
    opt = _CapturableAdam(fused.parameters(), lr=1e-2)
    step = hftc.compile_step(fused, F.cross_entropy, opt)
    assert step.captures_optimizer
    loop = hftc.fuse(copy.deepcopy(models))
    loop_opt = torch.optim.Adam(loop.parameters(), lr=1e-2)
    for k, (x, y) in enumerate(batches):
        lr = 1e-2 if k < 4 else 1e-3  # a change after capture applies without re-capture
        opt.lr_value = lr
        for g in loop_opt.param_groups:
            g["lr"] = lr
        got = step(x, y)
        loop_opt.zero_grad()
        want = hftc.per_model(F.cross_entropy)(loop(x), y)
        want.sum().backward()
        loop_opt.step()
        torch.testing.assert_close(got, want.detach())
    assert step.graphs == 1
    for p, q in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(p, q)


def test_hftc_adam_capturable_runs_inside_the_graph_with_a_scheduler():
    # hftc.optim.Adam(capturable=True): per-model lrs and step counts on the device,
    # refreshed before each replay; StepLR's changes apply without a new capture.
    models, batches = _models(torch.float32), _batches(6, torch.float32)
    fused = hftc.fuse(copy.deepcopy(models))
    opt = hftc.optim.Adam(fused.parameters(), lr=LRS, capturable=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = hftc.compile_step(fused, F.cross_entropy, opt)
    assert step.captures_optimizer
    loop = hftc.fuse(copy.deepcopy(models))
    loop_opt = hftc.optim.Adam(loop.parameters(), lr=LRS)
    loop_sched = torch.optim.lr_scheduler.StepLR(loop_opt, step_size=2, gamma=0.5)
    for x, y in batches:
        got = step(x, y)
        sched.step()
        loop_opt.zero_grad()
        want = hftc.per_model(F.cross_entropy)(loop(x), y)
        want.sum().backward()
        loop_opt.step()
        loop_sched.step()
        torch.testing.assert_close(got, want.detach())
    assert step.graphs == 1
    for p, q in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(p, q)


def test_a_non_capturable_hftc_optimizer_steps_after_the_replay():
    fused = hftc.fuse(_models(torch.float32))
    step = hftc.compile_step(fused, F.cross_entropy, hftc.optim.Adam(fused.parameters(), lr=LRS))
    assert not step.captures_optimizer


def _loss_with_item(out, y):
    return F.cross_entropy(out, y) * out.detach().abs().max().item()


def _loss_with_host_copy(out, y):
    weights = torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0]).to(out.device)
    return F.cross_entropy(out, y, weight=weights)


@pytest.mark.parametrize("loss, what", [
    (_loss_with_item, r"_local_scalar_dense at .*test_cuda_step\.py:\d+ .* reads a tensor's "
                      r"value on the host"),
    (_loss_with_host_copy, r"at .*test_cuda_step\.py:\d+ .* copies a tensor from host memory"),
])
def test_what_a_graph_cannot_hold_is_refused(loss, what):
    fused = hftc.fuse(_models(torch.float32))
    step = hftc.compile_step(fused, loss, hftc.optim.SGD(fused.parameters(), lr=LRS))
    x, y = _batches(1, torch.float32)[0]
    step(x, y)
    with pytest.raises(StepCaptureError, match=what + r".*CUDA graph.*mode='eager'"):
        step(x, y)


def test_grad_scaler_with_a_non_capturable_optimizer_and_ambient_autocast_are_refused():
    fused = hftc.fuse(_models(torch.float32))
    opt = hftc.optim.SGD(fused.parameters(), lr=LRS)
    adam = hftc.optim.Adam(fused.parameters(), lr=LRS)  # capturable=False: host step counts
    with pytest.raises(FusionArgumentError, match=r"GradScaler runs inside a CUDA graph only "
                                                  r"with a capturable optimizer, and Adam is "
                                                  r"not one.*capturable=True"):
        hftc.compile_step(fused, F.cross_entropy, adam, scaler=hftc.amp.GradScaler("cuda"))
    step = hftc.compile_step(fused, F.cross_entropy, opt)
    x, y = _batches(1, torch.float32)[0]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        step(x, y)
        step(x, y)
        with pytest.raises(StepCaptureError, match="pass autocast_dtype=torch.bfloat16"):
            step(x, y)


def test_bf16_autocast_step_is_the_eager_autocast_loop():
    # Both run the fused program from the first call: strategy="auto" would run the
    # models one by one on some first calls, whose bf16 GEMMs round apart from the fused
    # batched ones by a bf16 ulp (on an H200, parameters 2e-3 apart after 5 steps).
    models, batches = _models(torch.float32), _batches(5, torch.float32)
    fused = hftc.fuse(copy.deepcopy(models), strategy="fused")
    step = hftc.compile_step(fused, F.cross_entropy, hftc.optim.SGD(fused.parameters(), lr=LRS),
                             autocast_dtype=torch.bfloat16)
    loop = hftc.fuse(copy.deepcopy(models), strategy="fused")
    loop_opt = hftc.optim.SGD(loop.parameters(), lr=LRS)
    for x, y in batches:
        got = step(x, y)
        loop_opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = hftc.per_model(F.cross_entropy)(loop(x), y)
        want.sum().backward()
        loop_opt.step()
        torch.testing.assert_close(got, want.detach())
    for p, q in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(p, q)


def test_capture_waits_for_the_default_strategys_choice(tmp_path, monkeypatch):
    # strategy="auto" alternates the fused program and the models one by one on the first
    # calls: a graph captured then would replay one way for good and never decide.
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    models, batches = _models(torch.float32), _batches(40, torch.float32)
    fused = hftc.fuse(copy.deepcopy(models), strategy="auto")
    step = hftc.compile_step(fused, F.cross_entropy, hftc.optim.SGD(fused.parameters(), lr=LRS))
    for x, y in batches:
        step(x, y)
        if getattr(fused.last_program(), "trial", None) is not None:
            assert step.graphs == 0
    assert fused.last_program().trial is None and fused.plan.chosen in ("fused", "model_loop")
    assert step.graphs == 1


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_grad_scaler_runs_inside_the_graph_without_host_syncs(opt_name):
    # hftc.amp.GradScaler with a capturable optimizer: scaled backward, unscale_ (for the
    # per-model clip), the step that skips the models that overflowed and the scales'
    # update, all in the graph.  Model 1's loss overflows at steps 1 and 4 and model 2's at
    # step 4 (boost, a device tensor the loss reads); the replays (steps 2-5) make no host
    # sync, and match the eager fused loop and N stock models under torch.amp.GradScaler.
    models, batches = _models(torch.float32), _batches(6, torch.float32)
    clip = [0.05, 0.5, 5.0]
    boost = torch.ones(3, device="cuda")
    overflow = {1: [1], 4: [1, 2]}

    def make_opt(params, i=None):
        lrs = LRS if i is None else LRS[i]
        if opt_name == "adam":
            return (hftc.optim.Adam if i is None else torch.optim.Adam)(
                params, lr=lrs, capturable=True)
        return (hftc.optim.SGD if i is None else torch.optim.SGD)(params, lr=lrs, momentum=0.9)

    def boosted_losses(out, y):
        return hftc.per_model(F.cross_entropy)(out, y) * boost

    fused = hftc.fuse(copy.deepcopy(models))
    opt, scaler = make_opt(fused.parameters()), hftc.amp.GradScaler("cuda", growth_interval=2)
    step = hftc.compile_step(fused, boosted_losses, opt, per_model_loss=False, scaler=scaler,
                             clip_grad_norm=clip)
    assert step.captures_optimizer
    loop = hftc.fuse(copy.deepcopy(models))
    loop_opt = make_opt(loop.parameters())
    loop_scaler = hftc.amp.GradScaler("cuda", growth_interval=2)
    serial = copy.deepcopy(models)
    serial_opts = [make_opt(m.parameters(), i) for i, m in enumerate(serial)]
    serial_scalers = [torch.amp.GradScaler("cuda", growth_interval=2) for _ in serial]
    for k, (x, y) in enumerate(batches):
        boost.fill_(1.0)
        for i in overflow.get(k, []):
            boost[i] = 1e38
        if k >= 2:  # a replay
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = step(x, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        loop_opt.zero_grad()
        want = boosted_losses(loop(x), y)
        loop_scaler.scale(want).sum().backward()
        loop_scaler.unscale_(loop_opt)
        hftc.utils.clip_grad_norm_(loop, clip)
        loop_scaler.step(loop_opt)
        loop_scaler.update()
        torch.testing.assert_close(got, want.detach(), equal_nan=True)
        assert torch.equal(scaler.get_scale(), loop_scaler.get_scale()), k
        for i, (m, o, s) in enumerate(zip(serial, serial_opts, serial_scalers)):
            o.zero_grad()
            s.scale(F.cross_entropy(m(x), y) * boost[i]).backward()
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip[i])
            s.step(o)
            s.update()
            assert s.get_scale() == scaler.get_scale()[i].item(), (k, i)
    assert step.graphs == 1
    scales = scaler.get_scale().tolist()
    assert scales[1] < scales[2] < scales[0]  # each model's own back-offs
    for p, q in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(p, q)
    for i, m in enumerate(serial):
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.state_dict()[name][i], p.detach())
