"""hftc.compile_step on the CPU: the whole training step as one callable.

Each mode against the eager fused loop it replaces (bit for bit where the same kernels run)
and against N stock models trained one by one with stock torch.optim, per-model learning
rates, a scheduler and per-model clipping; and the refusals of what a captured step cannot
hold.  The CUDA-graph mode is tested in tests/test_cuda_step.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc
import hftc.training.step
from hftc.errors import FusionArgumentError, StepCaptureError

LRS = [1e-2, 3e-2, 5e-2]


class LeNetish(nn.Module):
    """pytorch/examples' mnist Net, shrunk: conv, pool, two linears, log-softmax."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(4 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def _batches(steps: int, dtype: torch.dtype, batch: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 1, 8, 8, generator=g, dtype=dtype),
             torch.randint(0, 5, (batch,), generator=g)) for _ in range(steps)]


def _models(dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    return [LeNetish().to(dtype) for _ in LRS]


def _serial(models, batches, clip=None):
    """N stock models, N stock Adams with a StepLR each, one after another."""
    models = copy.deepcopy(models)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, LRS)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    losses = []
    for x, y in batches:
        row = []
        for i, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            loss = F.nll_loss(m(x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip[i])
            opt.step()
            row.append(loss.detach())
        for s in scheds:
            s.step()
        losses.append(torch.stack(row))
    return models, losses


def _fused_loop(models, batches, clip=None):
    """The eager fused step compile_step replaces, written out."""
    fused = hftc.fuse(copy.deepcopy(models))
    opt = hftc.optim.Adam(fused.parameters(), lr=LRS)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = hftc.per_model(F.nll_loss)(fused(x), y)
        loss.sum().backward()
        if clip is not None:
            hftc.utils.clip_grad_norm_(fused, clip)
        opt.step()
        sched.step()
        losses.append(loss.detach())
    return fused, losses


def _stepped(models, batches, clip=None, **kwargs):
    fused = hftc.fuse(copy.deepcopy(models))
    opt = hftc.optim.Adam(fused.parameters(), lr=LRS)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = hftc.compile_step(fused, F.nll_loss, opt, clip_grad_norm=clip, **kwargs)
    losses = []
    for x, y in batches:
        losses.append(step(x, y))
        sched.step()
    return fused, losses, step


def _assert_same_models(fused, models, **tol):
    for i, m in enumerate(models):
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.state_dict()[name][i], p.detach(), **tol,
                                       msg=lambda msg, i=i, name=name: f"model {i} {name}: {msg}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_eager_step_is_the_fused_loop_bit_for_bit_and_the_serial_loop(dtype):
    models, batches = _models(dtype), _batches(5, dtype)
    clip = [0.05, 0.5, 5.0]  # one model clipped, one sometimes, one never
    fused, losses, step = _stepped(models, batches, clip)
    assert step.mode == "eager" == hftc.training.step.CPU_DEFAULT  # mode="auto" on the CPU
    loop, loop_losses = _fused_loop(models, batches, clip)
    for got, want in zip(losses, loop_losses):
        assert got.shape == (3,) and not got.requires_grad
        assert torch.equal(got, want)
    for (name, p), q in zip(fused.named_parameters(), loop.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(p.grad, q.grad), name  # .grad holds the last step's gradients
    serial, serial_losses = _serial(models, batches, clip)
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {}
    for got, want in zip(losses, serial_losses):
        torch.testing.assert_close(got, want, **tol)
    _assert_same_models(fused, serial, **tol)


@pytest.mark.slow  # torch.compile: ~30 s on a busy 2-core machine
def test_compile_step_matches_the_eager_step_and_the_serial_loop():
    dtype = torch.float32
    models, batches = _models(dtype), _batches(5, dtype)
    fused, losses, step = _stepped(models, batches, mode="compile")
    assert step.mode == "compile" and step._compiled is not None  # steps 3-5 compiled
    loop, loop_losses = _fused_loop(models, batches)
    for got, want in zip(losses, loop_losses):
        torch.testing.assert_close(got, want)
    for p, q in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(p, q)
    serial, serial_losses = _serial(models, batches)
    for got, want in zip(losses, serial_losses):
        torch.testing.assert_close(got, want)
    _assert_same_models(fused, serial)


class _SeenWhileCompiling(dict):
    """The forward-signature cache, noting each read dynamo traces.  Traced, the weak
    cache of every forward seen became a dict dynamo guards on by key index; a key
    collected mid-trace (the models of earlier tests) failed CI with an IndexError."""

    def __init__(self):
        super().__init__()
        self.traced: list[bool] = []

    def get(self, key, default=None):
        if torch.compiler.is_compiling():
            self.traced.append(True)  # (dynamo replays a traced list append)
        return super().get(key, default)


def test_compile_step_keeps_the_call_binding_out_of_the_traced_graph(monkeypatch):
    from hftc.module import inputs
    cache = _SeenWhileCompiling()
    monkeypatch.setattr(inputs, "_FORWARD_SIGNATURES", cache)
    dtype = torch.float32
    models, batches = _models(dtype), _batches(4, dtype)
    fused, losses, step = _stepped(models, batches, mode="compile")
    assert step._compiled is not None
    assert not cache.traced
    _, loop_losses = _fused_loop(models, batches)
    for got, want in zip(losses, loop_losses):
        torch.testing.assert_close(got, want)


def test_compiled_fused_call_still_refuses_what_the_models_refuse():
    class KeywordOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, *, x):
            return self.fc(x)

    torch.manual_seed(0)
    fused = hftc.fuse([KeywordOnly() for _ in range(2)])
    compiled = torch.compile(lambda x: fused(x=x))
    torch.testing.assert_close(compiled(torch.ones(2, 4)), fused(x=torch.ones(2, 4)))
    wrong = torch.compile(lambda x: fused(x))
    with pytest.raises(FusionArgumentError, match="refuses this call"):
        wrong(torch.ones(2, 4))


def test_grad_scaler_in_the_eager_step_is_the_loop():
    models, batches = _models(torch.float32), _batches(3, torch.float32)
    fused = hftc.fuse(copy.deepcopy(models))
    opt = hftc.optim.SGD(fused.parameters(), lr=LRS)
    scaler = hftc.amp.GradScaler("cpu")
    step = hftc.compile_step(fused, F.nll_loss, opt, scaler=scaler)
    loop = hftc.fuse(copy.deepcopy(models))
    loop_opt = hftc.optim.SGD(loop.parameters(), lr=LRS)
    loop_scaler = hftc.amp.GradScaler("cpu")
    for k, (x, y) in enumerate(batches):
        got = step(x, y)
        loop_opt.zero_grad()
        want = hftc.per_model(F.nll_loss)(loop(x), y)
        loop_scaler.scale(want).sum().backward()
        loop_scaler.step(loop_opt)
        loop_scaler.update()
        assert torch.equal(got, want.detach())
        if k == 0:  # a scale of its own per model from the second step on
            for s in (scaler, loop_scaler):
                s.update(new_scale=[2.0**10, 2.0**60, 2.0**127])
    assert torch.equal(scaler.get_scale(), loop_scaler.get_scale())
    assert scaler.get_scale().unique().numel() == 3
    for p, q in zip(fused.parameters(), loop.parameters()):
        assert torch.equal(p, q)


def _loss_with_item(out, y):
    return F.nll_loss(out, y) * out.detach().abs().max().item()


def _loss_with_mask(out, y):
    keep = y > 0
    return F.nll_loss(out[keep], y[keep])


@pytest.mark.parametrize("loss, what", [
    (_loss_with_item, r"_local_scalar_dense at .*test_step\.py:\d+ \(return F\.nll_loss"
                      r".*\.item\(\)\) reads a tensor's value on the host"),
    (_loss_with_mask, r"at .*test_step\.py:\d+ .*shape depends on the data"),
])
def test_compile_mode_refuses_what_a_graph_cannot_hold(loss, what):
    models, batches = _models(torch.float32), _batches(3, torch.float32)
    fused = hftc.fuse(models)
    step = hftc.compile_step(fused, loss, hftc.optim.SGD(fused.parameters(), lr=LRS),
                             mode="compile")
    step(*batches[0])  # the first warm-up step is not watched (the fused program compiles)
    with pytest.raises(StepCaptureError, match=what + r".*pass mode='eager'"):
        step(*batches[1])
    # the eager mode runs the same loss: nothing is captured
    eager = hftc.compile_step(fused, loss, hftc.optim.SGD(fused.parameters(), lr=LRS))
    for x, y in batches:
        assert eager(x, y).shape == (3,)


def test_changing_shapes_past_the_limit_are_refused(monkeypatch):
    monkeypatch.setattr(hftc.training.step, "MAX_SIGNATURES", 1)
    models = _models(torch.float32)
    fused = hftc.fuse(models)
    step = hftc.compile_step(fused, F.nll_loss, hftc.optim.SGD(fused.parameters(), lr=LRS),
                             mode="compile")
    step(*_batches(1, torch.float32, batch=8)[0])
    with pytest.raises(StepCaptureError, match=r"1 different shapes .* \[\[4, 1, 8, 8\], "
                                               r"\[4\]\].*drop_last=True.*mode='eager'"):
        step(*_batches(1, torch.float32, batch=4)[0])


def test_bad_arguments_are_refused():
    fused = hftc.fuse(_models(torch.float32))
    opt = hftc.optim.SGD(fused.parameters(), lr=LRS)
    x, y = _batches(1, torch.float32)[0]
    with pytest.raises(FusionArgumentError, match=r"mode='cuda_graph' needs .* CUDA.*cpu"):
        hftc.compile_step(fused, F.nll_loss, opt, mode="cuda_graph")
    with pytest.raises(FusionArgumentError, match="mode must be one of"):
        hftc.compile_step(fused, F.nll_loss, opt, mode="graph")
    with pytest.raises(FusionArgumentError, match="takes a fused module"):
        hftc.compile_step(models := _models(torch.float32), F.nll_loss, opt)
    assert models  # (a list, not a fused module)
    summed = hftc.compile_step(fused, lambda out, y: hftc.per_model(F.nll_loss)(out, y).sum(),
                               opt, per_model_loss=False)
    with pytest.raises(FusionArgumentError, match=r"gave shape \[\] for the 3 fused models, "
                                                  r"not one loss per model \(\[3\]\)"):
        summed(x, y)
    with torch.no_grad(), pytest.raises(FusionArgumentError, match="under torch.no_grad"):
        hftc.compile_step(fused, F.nll_loss, opt)(x, y)


class TokenClassifier(nn.Module):
    """A bag-of-embeddings text classifier (pytorch/examples' text_classification style)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.fc = nn.Linear(8, 5)

    def forward(self, tokens):
        return self.fc(self.embed(tokens).mean(1))


def test_hftc_own_host_reads_are_not_refused_in_compile_mode():
    # F.cross_entropy over 5 classes runs hftc's short-row kernel, which reads on the CPU
    # whether a target is ignored, and the fused embedding checks its indices' range: both
    # eager-only reads (torch.compile takes their other path), not the user's.
    torch.manual_seed(0)
    models = [TokenClassifier() for _ in LRS]
    fused = hftc.fuse(copy.deepcopy(models))
    step = hftc.compile_step(fused, F.cross_entropy, hftc.optim.SGD(fused.parameters(), lr=LRS),
                             mode="compile")
    loop = hftc.fuse(copy.deepcopy(models))
    loop_opt = hftc.optim.SGD(loop.parameters(), lr=LRS)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the two warm-up steps, the second watched
        x, y = torch.randint(0, 50, (160, 6), generator=g), torch.randint(0, 5, (160,), generator=g)
        got = step(x, y)
        loop_opt.zero_grad()
        want = hftc.per_model(F.cross_entropy)(loop(x), y)
        want.sum().backward()
        loop_opt.step()
        assert torch.equal(got, want.detach())
