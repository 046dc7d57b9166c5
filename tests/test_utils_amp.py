"""Per-model clipping, ``hftc.per_model`` losses and the per-model ``hftc.amp.GradScaler``.

Each is compared with the stock tool applied to each model alone
(``torch.nn.utils.clip_grad_norm_``, a loop of loss calls, ``torch.amp.GradScaler``),
and a model that overflows or diverges must leave the others exactly as alone.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from equivalence import autograd_nodes
from hftc.amp import GradScaler
from optim_helpers import (
    StackedModels,
    assert_all_match,
    make_batches,
    make_models,
    per_model_losses,
    rel_diff,
    single_thread,  # noqa: F401  (autouse fixture)
    tolerance,
)
from torch import nn

import hftc
import hftc.optim as ho
from hftc.utils import clip_grad_norm_, clip_grad_value_, per_model


def fused_and_solo_grads(n=3, dtype=torch.float64, scale=(1.0, 1.0, 1.0)):
    """A stand-in fused module and n solo copies, all holding the gradients of one batch."""
    models = make_models(n, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    x, y = make_batches(1, dtype)[0]
    out = fused(x)
    sum(F.cross_entropy(out[i] * scale[i], y) for i in range(n)).backward()
    for solo, s in zip(solos, scale):
        F.cross_entropy(solo(x) * s, y).backward()
    return fused, solos


def assert_grads_match(fused, solos, rtol=1e-12):
    grads = {name: p.grad for name, p in fused.named_parameters()}
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            assert rel_diff(grads[name][i], p.grad) <= rtol, (i, name)


# ------------------------------------------------------------------------ clipping


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_clips_each_model_by_its_own_norm(norm_type):
    fused, solos = fused_and_solo_grads(scale=(1.0, 30.0, 0.01))
    max_norms = [0.5, 1.0, 2.0]
    norms = clip_grad_norm_(fused, max_norms, norm_type=norm_type)
    assert norms.shape == (3,)
    for i, solo in enumerate(solos):
        stock = torch.nn.utils.clip_grad_norm_(solo.parameters(), max_norms[i], norm_type)
        assert rel_diff(norms[i], stock) <= 1e-12
    assert_grads_match(fused, solos)


def test_clip_grad_norm_takes_parameters_and_a_shared_max_norm():
    fused, solos = fused_and_solo_grads(scale=(1.0, 30.0, 0.01))
    norms = clip_grad_norm_(list(fused.parameters()), 0.3)
    stock = [torch.nn.utils.clip_grad_norm_(s.parameters(), 0.3) for s in solos]
    assert rel_diff(norms, torch.stack(stock)) <= 1e-12
    assert_grads_match(fused, solos)


def test_clip_grad_norm_keeps_a_non_finite_model_to_itself():
    fused, solos = fused_and_solo_grads()
    next(fused.parameters()).grad[1, 0] = float("nan")
    norms = clip_grad_norm_(fused, 0.1)
    assert torch.isnan(norms[1]) and torch.isfinite(norms[[0, 2]]).all()
    for i in (0, 2):
        torch.nn.utils.clip_grad_norm_(solos[i].parameters(), 0.1)
    grads = {n: p.grad for n, p in fused.named_parameters()}
    for i in (0, 2):
        for name, p in solos[i].named_parameters():
            assert rel_diff(grads[name][i], p.grad) <= 1e-12
    with pytest.raises(RuntimeError, match="model\\(s\\) \\[1\\] is non-finite"):
        clip_grad_norm_(fused, 0.1, error_if_nonfinite=True)


def test_clip_grad_value_shared_and_per_model():
    fused, solos = fused_and_solo_grads(scale=(1.0, 30.0, 0.01))
    clip_grad_value_(fused, 0.05)
    for s in solos:
        torch.nn.utils.clip_grad_value_(s.parameters(), 0.05)
    assert_grads_match(fused, solos, 0.0)
    fused, solos = fused_and_solo_grads(scale=(1.0, 30.0, 0.01))
    clip_grad_value_(fused, [0.01, 0.1, 1.0])
    for s, c in zip(solos, [0.01, 0.1, 1.0]):
        torch.nn.utils.clip_grad_value_(s.parameters(), c)
    assert_grads_match(fused, solos, 0.0)


def test_torch_clip_grad_value_takes_one_value_per_model_on_a_fused_module():
    """``torch.nn.utils.clip_grad_value_(model.parameters(), [0.01, 0.1, 1.0])`` on a fused
    module, one value per model as ``clip_grad_norm_`` takes them: torch failed in
    ``float()`` of the list; now model i is clamped by value i, as alone. One value, and
    one model's parameters with a list of one, are torch's own."""
    from torch.nn.utils.clip_grad import clip_grad_value_ as bound  # torch's own object

    def grads(clip, value, values):
        torch.manual_seed(0)
        models = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
                  for _ in range(3)]
        x = torch.randn(5, 4, dtype=torch.float64)
        fused = hftc.fuse(copy.deepcopy(models))
        scale = torch.tensor([1.0, 30.0, 0.01], dtype=torch.float64).view(3, 1, 1)
        (fused(x) * scale).pow(2).sum().backward()
        clip(fused.parameters(), value)
        for i, (m, s) in enumerate(zip(models, [1.0, 30.0, 0.01])):
            (m(x) * s).pow(2).sum().backward()
            torch.nn.utils.clip_grad_value_(m.parameters(), values[i])
            for name, p in m.named_parameters():
                torch.testing.assert_close(dict(fused.named_parameters())[name].grad[i],
                                           p.grad, rtol=1e-10, atol=1e-14)
        return models

    for clip in (torch.nn.utils.clip_grad_value_, bound):
        grads(clip, [0.01, 0.1, 1.0], [[0.01], [0.1], [1.0]])  # one model: a list of one
    models = grads(torch.nn.utils.clip_grad_value_, 0.05, [0.05] * 3)
    with pytest.raises(hftc.errors.FusionArgumentError, match="2 clip_value values"):
        torch.nn.utils.clip_grad_value_(models[0].parameters(), [0.1, 0.2])


def test_clip_errors():
    fused, _ = fused_and_solo_grads()
    with pytest.raises(ValueError, match="max_norm has 2 values but there are 3 models"):
        clip_grad_norm_(fused, [1.0, 2.0])
    with pytest.raises(ValueError, match="num_models=4, but the gradients' leading dim is 3"):
        clip_grad_norm_(fused.parameters(), 1.0, num_models=4)
    a, b = torch.zeros(3, 2, requires_grad=True), torch.zeros(2, 2, requires_grad=True)
    a.grad, b.grad = torch.ones(3, 2), torch.ones(2, 2)
    with pytest.raises(ValueError, match="leading dims are \\[2, 3\\]"):
        clip_grad_value_([a, b], 0.1)
    assert clip_grad_norm_(StackedModels(make_models(2)), 1.0).tolist() == [0.0, 0.0]


def test_clipping_keeps_a_diverging_model_from_the_others():
    # Model 1's lr is huge: it overflows to NaN even with clipping, while models
    # 0 and 2 (clipped by their own norms) train exactly as alone.
    dtype = torch.float64
    lrs, max_norms = [0.1, 1e200, 0.3], [0.5, 1.0, 0.2]
    models = make_models(3, dtype, activation=torch.nn.ReLU)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = ho.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    batches = make_batches(6, dtype)
    for x, y in batches:
        opt.zero_grad()
        per_model_losses(fused, x, y).sum().backward()
        clip_grad_norm_(fused, max_norms)
        opt.step()
    assert not all(torch.isfinite(p[1]).all() for p in fused.parameters())
    for i in (0, 2):
        solo_opt = torch.optim.SGD(solos[i].parameters(), lr=lrs[i], momentum=0.9)
        for x, y in batches:
            solo_opt.zero_grad()
            F.cross_entropy(solos[i](x), y).backward()
            torch.nn.utils.clip_grad_norm_(solos[i].parameters(), max_norms[i])
            solo_opt.step()
    assert_all_match(fused, solos, 1e-9, models=[0, 2])


# ------------------------------------------------------------------------ per_model


def loop(fn, out, *args, stacked=False, **kwargs):
    return torch.stack([fn(out[i], *[a[i] if stacked else a for a in args], **kwargs)
                        for i in range(out.shape[0])])


def test_per_model_cross_entropy_with_shared_and_stacked_targets():
    out = torch.randn(3, 8, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 5, (8,))
    losses = per_model(F.cross_entropy)(out, y)
    assert losses.shape == (3,)
    assert rel_diff(losses, loop(F.cross_entropy, out, y)) <= 1e-12
    # Each model's gradient is its own (the loop's).
    (g,) = torch.autograd.grad(losses.sum(), out)
    (g_loop,) = torch.autograd.grad(loop(F.cross_entropy, out, y).sum(), out)
    assert rel_diff(g, g_loop) <= 1e-12
    ys = torch.randint(0, 5, (3, 8))
    stacked = per_model(F.cross_entropy, in_dims=0)(out, ys)
    assert rel_diff(stacked, loop(F.cross_entropy, out, ys, stacked=True)) <= 1e-12


def test_per_model_cross_entropy_options():
    out = torch.randn(2, 6, 4, 3, dtype=torch.float64)        # [N, B, C, d]
    y = torch.randint(0, 4, (6, 3))
    y[0, 0] = y[2, 1] = -100
    for kwargs in [{}, {"reduction": "sum"}, {"label_smoothing": 0.1}, {"reduction": "none"}]:
        got = per_model(F.cross_entropy)(out, y, **kwargs)
        assert rel_diff(got, loop(F.cross_entropy, out, y, **kwargs)) <= 1e-12, kwargs
    y2 = torch.where(y == -100, 2, y)
    got = per_model(F.cross_entropy)(out, y2, ignore_index=2)
    assert rel_diff(got, loop(F.cross_entropy, out, y2, ignore_index=2)) <= 1e-12
    weight = torch.rand(4, dtype=torch.float64)
    got = per_model(F.cross_entropy)(out, y, weight=weight)        # through vmap
    assert rel_diff(got, loop(F.cross_entropy, out, y, weight=weight)) <= 1e-12
    probs = torch.softmax(torch.randn(6, 4, 3, dtype=torch.float64), 1)
    got = per_model(F.cross_entropy)(out, probs)
    assert rel_diff(got, loop(F.cross_entropy, out, probs)) <= 1e-12


def test_per_model_cross_entropy_over_few_classes(monkeypatch):
    # N * B rows of 10 classes in float32: the loss takes losses.short_row_cross_entropy
    # (forced here as under AVX512), within a rounding of the loop.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    out = (torch.randn(8, 64, 10) * 4).requires_grad_()
    y = torch.randint(0, 10, (64,))
    y[:5] = -100
    for kwargs in [{}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 3},
                   {"label_smoothing": 0.2}]:
        target = y.clamp(min=0) if "ignore_index" in kwargs else y
        losses = per_model(F.cross_entropy)(out, target, **kwargs)
        if not kwargs.get("label_smoothing"):
            assert "_ShortRowCrossEntropyBackward" in autograd_nodes(losses), kwargs
        want = loop(F.cross_entropy, out, target, **kwargs)
        torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
        g = torch.randn_like(losses)
        (grad,) = torch.autograd.grad(losses, out, g)
        (grad_loop,) = torch.autograd.grad(want, out, g)
        torch.testing.assert_close(grad, grad_loop, rtol=1e-5, atol=1e-6)  # grads ~1e-2


def test_per_model_cross_entropy_over_few_classes_stacked_targets_and_double_backward(
        monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    out = (torch.randn(4, 128, 7) * 3).requires_grad_()
    ys = torch.randint(0, 7, (4, 128))
    ys[1, :3] = -100  # ignored rows in one model only
    losses = per_model(F.cross_entropy, in_dims=0)(out, ys)
    assert "_ShortRowCrossEntropyBackward" in autograd_nodes(losses)
    want = loop(F.cross_entropy, out, ys, stacked=True)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    # create_graph: the gradient is itself differentiable (a gradient penalty)
    (grad,) = torch.autograd.grad(losses.sum(), out, create_graph=True)
    (grad_loop,) = torch.autograd.grad(want.sum(), out, create_graph=True)
    torch.testing.assert_close(grad, grad_loop, rtol=1e-5, atol=1e-7)
    v = torch.randn_like(out)
    (gg,) = torch.autograd.grad((grad * v).sum(), out)
    (gg_loop,) = torch.autograd.grad((grad_loop * v).sum(), out)
    torch.testing.assert_close(gg, gg_loop, rtol=1e-4, atol=1e-7)
    assert gg.abs().sum() > 0


def test_per_model_cross_entropy_over_few_classes_under_torch_compile(monkeypatch):
    # Under torch.compile the loss is ATen's (inductor fuses it): one graph, no break on
    # the CPU capability or on whether a target is ignored.
    import torch._dynamo

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    out = torch.randn(4, 128, 7, requires_grad=True)
    y = torch.randint(0, 7, (128,))
    loss_fn = per_model(F.cross_entropy)
    explain = torch._dynamo.explain(lambda o, t: loss_fn(o, t).sum())(out, y)
    assert explain.graph_count == 1 and explain.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(lambda o, t: loss_fn(o, t))
    got = compiled(out, y)
    want = loop(F.cross_entropy, out, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(got.sum(), out)
    (g_loop,) = torch.autograd.grad(want.sum(), out)
    torch.testing.assert_close(g, g_loop, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fn", [F.mse_loss, F.l1_loss, F.smooth_l1_loss,
                                F.binary_cross_entropy_with_logits])
def test_per_model_elementwise_losses(fn):
    out = torch.randn(3, 5, 2, dtype=torch.float64)
    target = torch.rand(5, 2, dtype=torch.float64)
    assert rel_diff(per_model(fn)(out, target), loop(fn, out, target)) <= 1e-12
    stacked = torch.rand(3, 5, 2, dtype=torch.float64)
    got = per_model(fn, in_dims=(0, 0))(out, stacked, reduction="sum")
    assert rel_diff(got, loop(fn, out, stacked, stacked=True, reduction="sum")) <= 1e-12


def test_per_model_generic_losses_via_vmap_and_via_a_loop():
    out = torch.randn(3, 5, 2, dtype=torch.float64)
    target = torch.randn(5, 2, dtype=torch.float64)

    def smooth(o, t):
        return ((o - t) ** 2).mean() + o.abs().amax()

    assert rel_diff(per_model(smooth)(out, target), loop(smooth, out, target)) <= 1e-12

    def data_dependent(o, t):  # .item() cannot run under vmap
        return (o - t).abs().sum() if (o - t).sum().item() > 0 else (o - t).pow(2).sum()

    got = per_model(data_dependent)(out, target)
    assert rel_diff(got, loop(data_dependent, out, target)) <= 1e-12


def test_per_model_argument_errors():
    # hftc.errors classes (they were builtin ValueErrors from hftc's internals)
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match="in_dims entries must be 0 or None"):
        per_model(F.mse_loss, in_dims=(1, None))
    out = torch.randn(3, 4, 2)
    with pytest.raises(hftc.errors.FusionArgumentError, match="leading dim N = 3"):
        per_model(F.mse_loss, in_dims=0)(out, torch.randn(2, 4, 2))
    # in_dims=(0, 0) with the one target all models share: it says to mark it None
    logits, y = torch.randn(3, 8, 4), torch.randint(0, 4, (8,))
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"per_model\(cross_entropy\): .*argument 1 has shape \[8\]; a "
                             r"target all models share .* is marked None: "
                             r"hftc\.per_model\(cross_entropy, in_dims=\(0, None\)\)"):
        per_model(F.cross_entropy, in_dims=(0, 0))(logits, y)
    # a fused module's dict / ModelOutput / tuple output given to a loss of one tensor
    # (was: AttributeError on .shape)
    for output in ({"logits": out}, [out]):
        with pytest.raises(ValueError, match=r"is a (dict|list) of stacked tensors, and the "
                                             r"loss failed .*out\['logits'\]"):
            per_model(F.cross_entropy)(output, torch.randint(0, 2, (4,)))
    with pytest.raises(ValueError, match=r"is a tuple of int, not of tensors stacked"):
        per_model(F.cross_entropy)((1, 2), torch.randint(0, 2, (4,)))
    with pytest.raises(ValueError, match=r"leading dim N = 3 .*has shape \[2, 4\]"):
        per_model(F.cross_entropy)((out, torch.randn(2, 4)), torch.randint(0, 2, (4,)))


@pytest.mark.parametrize("container", [tuple, list, dict])
def test_per_model_takes_an_output_of_several_fields_as_vmap_does(container):
    # PointNet's (log_probs, feature transform), a detector's dict of heads: model i gets
    # each field's [i]; vmap runs it, and the loop where vmap cannot (.item())
    log_probs = torch.randn(3, 4, 5, dtype=torch.float64).log_softmax(-1)
    trans = torch.randn(3, 4, 2, 2, dtype=torch.float64)
    out = {"a": log_probs, "b": trans} if container is dict else container((log_probs, trans))
    first, second = ("a", "b") if container is dict else (0, 1)
    y = torch.randint(0, 5, (4,))

    def loss(o, t):
        return F.nll_loss(o[first], t) + 1e-3 * o[second].pow(2).mean()

    def loss_with_item(o, t):
        return loss(o, t) * (1.0 if o[second].sum().item() > 0 else 2.0)

    for fn in (loss, loss_with_item):
        want = torch.stack([fn({first: log_probs[i], second: trans[i]}, y) for i in range(3)])
        assert rel_diff(per_model(fn)(out, y), want) <= 1e-12


def test_per_model_takes_the_losss_keywords_for_each_model():
    # pytorch/examples' MNIST test loop: F.nll_loss(output, target, reduction="sum").
    # per_model(F.nll_loss, reduction="sum") was a TypeError; its keywords now bind as
    # functools.partial binds them, and hold for each model's loss.
    out = torch.log_softmax(torch.randn(3, 8, 5, dtype=torch.float64), -1).requires_grad_()
    y = torch.randint(0, 5, (8,))
    y[2] = -100
    summed = per_model(F.nll_loss, reduction="sum")
    got = summed(out, y)
    want = loop(F.nll_loss, out, y, reduction="sum")
    assert got.shape == (3,)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    (g,) = torch.autograd.grad(got.sum(), out)
    (g_loop,) = torch.autograd.grad(want.sum(), out)
    torch.testing.assert_close(g, g_loop, rtol=1e-12, atol=0)
    # A call's own keywords override them, as functools.partial's do.
    torch.testing.assert_close(summed(out, y, reduction="mean"), loop(F.nll_loss, out, y),
                               rtol=1e-12, atol=0)
    y4 = y.clamp(min=0)
    weight = torch.rand(5, dtype=torch.float64)
    for loss_kwargs in [dict(reduction="none"), dict(ignore_index=4, reduction="sum"),
                        dict(weight=weight), dict(weight=weight, reduction="sum")]:
        got = per_model(F.nll_loss, **loss_kwargs)(out, y4)
        torch.testing.assert_close(got, loop(F.nll_loss, out, y4, **loss_kwargs),
                                   rtol=1e-12, atol=0, msg=str(loss_kwargs))
    ce = per_model(F.cross_entropy, label_smoothing=0.1, reduction="sum")(out, y)
    torch.testing.assert_close(ce, loop(F.cross_entropy, out, y, label_smoothing=0.1,
                                        reduction="sum"), rtol=1e-12, atol=0)


def test_per_model_refuses_keywords_the_loss_does_not_take():
    with pytest.raises(hftc.errors.FusionTypeError,
                       match=r"per_model\(nll_loss, reductoin=...\): .*'reductoin'.*"
                             r"its parameters: input, target, weight"):
        per_model(F.nll_loss, reductoin="sum")
    # A loss module's forward takes (input, target): its options are the module's.
    with pytest.raises(hftc.errors.FusionTypeError,
                       match=r"set it where the loss module is built \(BCELoss\(reduction"):
        per_model(nn.BCELoss(), reduction="sum")
    module = per_model(nn.BCELoss(reduction="sum"))
    probs = torch.rand(2, 6, dtype=torch.float64)
    target = torch.rand(6, dtype=torch.float64)
    torch.testing.assert_close(module(probs, target),
                               loop(nn.BCELoss(reduction="sum"), probs, target),
                               rtol=1e-12, atol=0)


def test_per_model_arguments_passed_by_keyword_bind_to_their_parameters():
    out = torch.randn(3, 5, 2, dtype=torch.float64)
    ys = torch.randn(3, 5, 2, dtype=torch.float64)
    # in_dims=(0, 0) stacks the target also when it is passed by keyword (it was shared,
    # broadcasting each model's [5, 2] output against all N targets: a silent wrong loss).
    got = per_model(F.mse_loss, in_dims=(0, 0))(out, target=ys)
    torch.testing.assert_close(got, loop(F.mse_loss, out, ys, stacked=True),
                               rtol=1e-12, atol=0)
    got = per_model(F.mse_loss, in_dims=(0, 0), reduction="sum")(input=out, target=ys)
    torch.testing.assert_close(got, loop(F.mse_loss, out, ys, stacked=True, reduction="sum"),
                               rtol=1e-12, atol=0)
    # The output by keyword too (was: "in_dims marks no argument as stacked").
    logits = torch.randn(3, 8, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (8,))
    got = per_model(F.cross_entropy)(input=logits, target=y)
    torch.testing.assert_close(got, loop(F.cross_entropy, logits, y), rtol=1e-12, atol=0)
    # A per-model class weight by keyword, stacked by its in_dims entry (position 2).
    weights = torch.rand(3, 4, dtype=torch.float64)
    log_probs = torch.log_softmax(logits, -1)
    got = per_model(F.nll_loss, in_dims=(0, None, 0))(log_probs, y, weight=weights)
    want = torch.stack([F.nll_loss(log_probs[i], y, weight=weights[i]) for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # in_dims=0 stacks what is passed by position (vmap's int): a tensor by keyword to a
    # positional parameter would be shared; refused as ambiguous, saying what to do.
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"per_model\(mse_loss, in_dims=0\): target passed by keyword.*"
                             r"Pass it by position, or in_dims as a tuple"):
        per_model(F.mse_loss, in_dims=0)(out, target=ys)
    # A wrong call is the loss's own TypeError, before anything runs.
    with pytest.raises(TypeError, match="multiple values for argument 'target'"):
        per_model(F.mse_loss)(out, ys, target=ys)
    with pytest.raises(TypeError, match="missing .*'target'"):
        per_model(F.mse_loss)(out)


# ------------------------------------------------------------------------- scaler


def train_scaled(fused, opt, scaler, batches, boost, autocast=None, clip=None):
    n = fused.num_models
    scales = []
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = fused(x)
            losses = torch.stack([F.cross_entropy(out[i].float() * boost[i], y)
                                  for i in range(n)])
        scaler.scale(losses).sum().backward()
        if clip is not None:
            scaler.unscale_(opt)
            clip_grad_norm_(fused, clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale().tolist())
    return scales


def train_scaled_solo(model, opt, scaler, batches, boost, autocast=None, clip=None):
    scales = []
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = F.cross_entropy(model(x).float() * boost, y)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_scaler_skips_only_the_model_that_overflows(opt_name, autocast):
    # Model 1's loss is 1e12 times larger: with a scale of 2**100 its float32
    # gradients overflow. torch's scaler would skip all 3 models; this one skips
    # model 1 only, backs off model 1's scale only, and every model follows the
    # path torch.amp.GradScaler gives it alone.
    dtype, n = torch.float32, 3
    boost = [1.0, 1e12, 1.0]
    make_opt = {
        "adam": (lambda ps, i: torch.optim.Adam(ps, lr=[1e-2, 3e-2, 1e-3][i]),
                 lambda ps: ho.Adam(ps, lr=[1e-2, 3e-2, 1e-3])),
        "sgd": (lambda ps, i: torch.optim.SGD(ps, lr=0.1, momentum=[0.9, 0.5, 0.0][i]),
                lambda ps: ho.SGD(ps, lr=0.1, momentum=[0.9, 0.5, 0.0])),
    }[opt_name]
    models = make_models(n, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = make_opt[1](fused.parameters())
    scaler = GradScaler(init_scale=2.0**100, growth_interval=3)
    batches = make_batches(8, dtype)
    scales = train_scaled(fused, opt, scaler, batches, boost, autocast)
    for i, solo in enumerate(solos):
        stock = torch.amp.GradScaler("cpu", init_scale=2.0**100, growth_interval=3)
        solo_scales = train_scaled_solo(solo, make_opt[0](solo.parameters(), i), stock,
                                        batches, boost[i], autocast)
        assert [s[i] for s in scales] == solo_scales, i
    assert_all_match(fused, solos, tolerance(dtype))
    assert scales[-1][1] < scales[-1][0] == scales[-1][2]
    if opt_name == "adam":
        assert opt.state[next(fused.parameters())]["step"].tolist()[1] < len(batches)


def test_scaler_with_a_diverging_model_and_per_model_clipping():
    # Model 1's huge lr makes it NaN; the scaler skips it from then on, and models
    # 0 and 2 (unscaled, clipped by their own norms) equal their solo runs.
    dtype, lrs = torch.float64, [0.1, 1e200, 0.05]
    models = make_models(3, dtype, activation=torch.nn.ReLU)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = ho.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    scaler = GradScaler(init_scale=2.0**10, growth_interval=2)
    batches = make_batches(6, dtype)
    scales = train_scaled(fused, opt, scaler, batches, [1.0] * 3, clip=1.0)
    # Its loss overflowed (its weights stay finite: every later step was skipped).
    assert not torch.isfinite(per_model_losses(fused, *batches[-1])[1])
    assert scales[-1][1] < 2.0**10 < scales[-1][0]
    for i in (0, 2):
        stock = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        solo_opt = torch.optim.SGD(solos[i].parameters(), lr=lrs[i], momentum=0.9)
        solo_scales = train_scaled_solo(solos[i], solo_opt, stock, batches, 1.0, clip=1.0)
        assert [s[i] for s in scales] == solo_scales
    assert_all_match(fused, solos, 1e-9, models=[0, 2])


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (``.item()``, ``bool(t)``)
    or give a shape that depends on it (``nonzero``): a host sync each on a GPU."""

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


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """The capturable steps on the CPU: torch refuses Adam(capturable=True) there (a
    check of the device only), and hftc's SGD is capturable on CUDA only."""
    import torch.optim.adam as stock_adam

    monkeypatch.setattr(stock_adam, "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cpu", "cuda"])
    monkeypatch.setattr(ho.SGD, "_capturable", lambda self: not self._flag("fused"))


@pytest.mark.parametrize("opt_name", ["adam", "adamw", "sgd"])
def test_scaler_with_a_capturable_optimizer_skips_on_the_device(opt_name, capturable_on_cpu):
    # The same run as test_scaler_skips_only_the_model_that_overflows, with optimizers
    # whose step a CUDA graph can capture: unscale_, step and update read nothing on the
    # host (the found-inf flags go to step(skip_models=...) as a tensor), and each model
    # still follows torch.amp.GradScaler with its own stock capturable optimizer: the
    # same scales, the same step counts, the same weights. Model 2 also gets a NaN
    # gradient at step 4.
    dtype, n = torch.float32, 3
    boost = [1.0, 1e9, 1.0]  # model 1 overflows at 2**100 and 2**99, not below
    make_opt = {
        "adam": (lambda ps, i: torch.optim.Adam(ps, lr=[1e-2, 3e-2, 1e-3][i], capturable=True),
                 lambda ps: ho.Adam(ps, lr=[1e-2, 3e-2, 1e-3], capturable=True)),
        "adamw": (lambda ps, i: torch.optim.AdamW(ps, lr=1e-2, weight_decay=[0.1, 0.5, 0.0][i],
                                                  capturable=True),
                  lambda ps: ho.AdamW(ps, lr=1e-2, weight_decay=[0.1, 0.5, 0.0],
                                      capturable=True)),
        "sgd": (lambda ps, i: torch.optim.SGD(ps, lr=0.1, momentum=[0.9, 0.5, 0.0][i]),
                lambda ps: ho.SGD(ps, lr=0.1, momentum=[0.9, 0.5, 0.0])),
    }[opt_name]
    models = make_models(n, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = make_opt[1](fused.parameters())
    assert opt.is_capturable
    scaler = GradScaler(init_scale=2.0**100, growth_interval=3)
    batches = make_batches(8, dtype)
    nan_at = 4
    reads, scales = HostReads(), []
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        out = fused(x)
        losses = torch.stack([F.cross_entropy(out[i] * boost[i], y) for i in range(n)])
        scaler.scale(losses).sum().backward()
        if k == nan_at:
            next(fused.parameters()).grad[2].view(-1)[0] = float("nan")
        with reads:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        scales.append(scaler.get_scale().tolist())
    assert reads.reads == []
    skipped = []
    for i, solo in enumerate(solos):
        stock = torch.amp.GradScaler("cpu", init_scale=2.0**100, growth_interval=3)
        solo_opt = make_opt[0](solo.parameters(), i)
        solo_scales = []
        for k, (x, y) in enumerate(batches):
            solo_opt.zero_grad()
            stock.scale(F.cross_entropy(solo(x) * boost[i], y)).backward()
            if k == nan_at and i == 2:
                next(solo.parameters()).grad.view(-1)[0] = float("nan")
            stock.step(solo_opt)
            stock.update()
            solo_scales.append(stock.get_scale())
        assert [s[i] for s in scales] == solo_scales, i
        skipped.append(sum(b < a for a, b in zip([2.0**100] + solo_scales, solo_scales)))
        if opt_name != "sgd":
            for p, q in zip(fused.parameters(), solo.parameters()):
                assert opt.state[p]["step"][i] == solo_opt.state[q]["step"], i
    assert skipped[0] == 0 and skipped[1] > 0 and skipped[2] == 1
    assert_all_match(fused, solos, tolerance(dtype))


def test_scaler_load_state_dict_writes_into_the_scales_it_has():
    # hftc.compile_step's CUDA graph reads the scaler's scale and growth-tracker tensors:
    # loading a state dict must change their values, not replace them.
    scaler = GradScaler(init_scale=4.0)
    scaler.scale(torch.ones(3))
    scale, tracker = scaler._scale, scaler._growth_tracker
    saved = GradScaler(init_scale=2.0**20)
    saved.scale(torch.ones(3))
    saved.update(new_scale=[1.0, 2.0, 3.0])
    scaler.load_state_dict(saved.state_dict())
    assert scaler._scale is scale and scaler._growth_tracker is tracker
    assert scaler.get_scale().tolist() == [1.0, 2.0, 3.0]


def test_scaler_update_follows_torch_growth_and_backoff_rules():
    scaler = GradScaler(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25,
                        growth_interval=2)
    fused = StackedModels(make_models(2))
    opt = ho.SGD(fused.parameters(), lr=0.0)
    x, y = make_batches(1)[0]
    history = []
    for overflow in [(False, True), (False, False), (True, False), (False, False)]:
        opt.zero_grad()
        scaler.scale(per_model_losses(fused, x, y)).sum().backward()
        for i, bad in enumerate(overflow):
            if bad:
                next(fused.parameters()).grad[i].fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        history.append(scaler.get_scale().tolist())
    # model 0: ok, ok -> x4; inf -> x0.25; ok.   model 1: inf -> x0.25; ok, ok -> x4; ok.
    assert history == [[8.0, 2.0], [32.0, 2.0], [8.0, 8.0], [8.0, 8.0]]
    assert scaler.get_growth_tracker().tolist() == [1, 1]
    scaler.update(new_scale=[1.0, 2.0])
    assert scaler.get_scale().tolist() == [1.0, 2.0]


def test_scaler_misuse_is_reported():
    fused = StackedModels(make_models(2))
    x, y = make_batches(1)[0]
    scaler = GradScaler()
    with pytest.raises(ValueError, match="per-model losses .* not their sum"):
        scaler.scale(per_model_losses(fused, x, y).sum())
    stock = torch.optim.SGD(fused.parameters(), lr=0.1)
    scaler.scale(per_model_losses(fused, x, y)).sum().backward()
    with pytest.raises(TypeError, match="hftc.optim optimizers"):
        scaler.step(stock)
    opt = ho.SGD(fused.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    with pytest.raises(ValueError, match="got 3 per-model losses but the scaler has 2"):
        scaler.scale(torch.ones(3))


def test_disabled_scaler_is_a_no_op():
    fused = StackedModels(make_models(2))
    opt = ho.SGD(fused.parameters(), lr=0.1)
    scaler = GradScaler(enabled=False)
    x, y = make_batches(1)[0]
    losses = per_model_losses(fused, x, y)
    assert scaler.scale(losses) is losses
    losses.sum().backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.state_dict() == {}


def test_torch_clip_grad_norm_clips_a_fused_module_per_model():
    """The habit ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on a fused
    module clipped all N models by one norm (each model's step then depended on the
    others'); after ``import hftc`` it clips each by its own, as each model alone, also on
    a deep copy and after torch.save / torch.load, and returns the N norms."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)) for _ in range(3)]
    x = torch.randn(5, 4)
    buffer = io.BytesIO()
    torch.save(hftc.fuse(copy.deepcopy(models)), buffer)
    buffer.seek(0)

    def assigned():  # new Parameter objects, without the mark
        fused = hftc.fuse(copy.deepcopy(models))
        fused.load_state_dict({k: v.clone() for k, v in fused.state_dict().items()},
                              assign=True)
        return fused

    def swapped():  # torch.utils.swap_tensors refused the weakly referenced parameters
        fused = hftc.fuse([m.double() for m in copy.deepcopy(models)])
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            fused.float()
            fused.load_state_dict(fused.state_dict())
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        return fused

    for fused in (hftc.fuse(copy.deepcopy(models)),
                  copy.deepcopy(hftc.fuse(copy.deepcopy(models))),
                  torch.load(buffer, weights_only=False), assigned(), swapped()):
        (fused(x) ** 2).sum().backward()
        norms = torch.nn.utils.clip_grad_norm_(fused.parameters(), 0.5)
        alone = copy.deepcopy(models)
        for i, m in enumerate(alone):
            (m(x) ** 2).sum().backward()
            torch.testing.assert_close(norms[i], torch.nn.utils.clip_grad_norm_(
                m.parameters(), 0.5))
            for name, p in m.named_parameters():
                torch.testing.assert_close(fused.get_parameter(name).grad[i], p.grad)
        with pytest.raises(hftc.errors.FusionArgumentError, match="together with other"):
            torch.nn.utils.clip_grad_norm_([*fused.parameters(), *alone[0].parameters()], 1.0)

_BOUND_BEFORE_IMPORT = """
import copy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_, get_total_norm, clip_grads_with_norm_
import hftc

torch.manual_seed(0)
models = [nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)).double()
          for _ in range(3)]
with torch.no_grad():  # norms far apart: one norm for all three clips each wrongly
    for i, m in enumerate(models):
        for p in m.parameters():
            p.mul_(1 + 3 * i)
alone = copy.deepcopy(models)
data = [(torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 4, (8,)))
        for _ in range(3)]
for m in alone:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
fused = hftc.fuse(models)
opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
for step, (x, y) in enumerate(data):
    opt.zero_grad()
    hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
    if step == 0:
        norms = clip_grad_norm_(fused.parameters(), 1.0)
    else:  # torch's two-step form, bound early too
        params = list(fused.parameters())
        norms = get_total_norm([p.grad for p in params])
        clip_grads_with_norm_(params, 1.0, norms)
    assert norms.shape == (3,), norms
    opt.step()
worst = max((fused.model_state_dict(i)[k] - v).abs().max().item()
            for i, m in enumerate(alone) for k, v in m.state_dict().items())
p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
p.grad = torch.full((4,), 3.0, dtype=torch.float64)
print(worst, clip_grad_norm_([p], 1.0).item(), p.grad.norm().item())
"""


def test_torch_clipping_bound_before_import_hftc_clips_per_model_too():
    """``from torch.nn.utils import clip_grad_norm_`` above ``import hftc`` (the convert
    guide adds ``import hftc`` below a script's imports) bound torch's own function
    object, which clipped all N models by one norm: model 0's weights ended 0.05 off its
    own run, silently.  Now torch's function objects themselves clip a fused module per
    model (the two-step form too), and other parameters as torch does."""
    out = subprocess.run([sys.executable, "-c", _BOUND_BEFORE_IMPORT], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    worst, norm, clipped = map(float, out.stdout.split())
    assert worst <= 1e-12
    assert norm == pytest.approx(6.0) and clipped == pytest.approx(1.0, rel=1e-5)


def test_torch_clipping_takes_one_per_model_max_norm_for_one_model():
    """A sweep's train_step clips each trial by its own max_norm
    (``clip_grad_norm_(model.parameters(), [p["clip"] for p in params])``); alone
    (train_alone, --serial, the speedup estimate) the same code gets a stock model and a
    list of one: torch's clip_grad_norm_ raised a TypeError (float() of a list), which
    stopped the whole sweep in its estimate. One value per model, for one model."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    twin = copy.deepcopy(model)
    (model(x) ** 2).sum().backward()
    (twin(x) ** 2).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), [0.1])
    assert norm == torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1) and norm > 0.1
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), (0.01,), total)
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) <= 0.0101
    with pytest.raises(hftc.errors.FusionArgumentError, match="2 max_norm values"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), [0.1, 0.2])


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_torch_two_step_clipping_clips_a_fused_module_per_model(norm_type):
    """torch's two-step form of clip_grad_norm_, ``get_total_norm`` of the gradients then
    ``clip_grads_with_norm_``, took one norm over all N models (model 0's gradients were
    off by 0.7 after clipping); after ``import hftc`` it is per model, as each model alone.
    A single norm given for the fused parameters is refused, not applied to all."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
              for _ in range(3)]
    x = torch.randn(5, 4, dtype=torch.float64)
    fused = hftc.fuse(copy.deepcopy(models))
    out = fused(x)
    sum((i + 1) * (out[i] ** 2).sum() for i in range(3)).backward()
    params = list(fused.parameters())
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, total)
    assert total.shape == (3,)
    for i, m in enumerate(models):
        ((i + 1) * (m(x) ** 2).sum()).backward()
        own = [p.grad for p in m.parameters()]
        alone = torch.nn.utils.get_total_norm(own, norm_type)
        torch.nn.utils.clip_grads_with_norm_(list(m.parameters()), 1.0, alone)
        torch.testing.assert_close(total[i], alone)
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name).grad[i], p.grad)
    with pytest.raises(hftc.errors.FusionArgumentError, match="each model's norm"):
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, total.norm())
    with pytest.raises(hftc.errors.FusionArgumentError, match="together with other"):
        torch.nn.utils.get_total_norm([params[0].grad, models[0][0].weight.grad])
    # Parameters put in by load_state_dict(assign=True) are the fused module's too.
    fused.load_state_dict({k: v.clone() for k, v in fused.state_dict().items()}, assign=True)
    out = fused(x)
    sum((i + 1) * (out[i] ** 2).sum() for i in range(3)).backward()
    assert torch.nn.utils.get_total_norm([p.grad for p in fused.parameters()]).shape == (3,)



def test_torch_grad_scaler_on_a_fused_optimizer_is_refused():
    """torch.amp.GradScaler keeps one scale for all N models: an overflow in one skipped
    every model's step.  Stepping a fused optimizer with it says to use hftc's scaler,
    changes nothing, and leaves the optimizer usable with hftc.amp.GradScaler."""
    torch.manual_seed(0)
    fused = hftc.fuse([nn.Linear(4, 2) for _ in range(3)])
    opt = ho.SGD(fused.parameters(), lr=0.1)
    before = fused.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(fused(torch.randn(5, 4)).sum()).backward()
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"one loss scale for all 3 "
                                                              r"models.*hftc.amp.GradScaler"):
        scaler.step(opt)
    assert torch.equal(fused.weight, before)
    opt.zero_grad()
    per_model = GradScaler()
    per_model.scale(fused(torch.randn(5, 4)).sum((1, 2))).sum().backward()
    per_model.step(opt)
    per_model.update()
    assert not torch.equal(fused.weight, before)


def test_swa_update_bn_on_a_fused_module_recomputes_each_models_statistics():
    """update_bn finds batch norms by class and sets their momentum, which a fused module's
    bake in: it was refused, with advice (update_bn on ``swa.module.unfuse()``'s copies)
    that left the averaged fused module predicting with its old statistics.  It now
    recomputes each model's statistics, as update_bn on that model alone does."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
              for _ in range(2)]
    alone = [AveragedModel(copy.deepcopy(m)) for m in models]
    swa = AveragedModel(hftc.fuse(models))
    loader = [torch.randn(16, 4) * 5 + 3 for _ in range(2)]
    update_bn(loader, swa)
    x = torch.randn(5, 4)
    swa.eval()
    for i, ref in enumerate(alone):
        update_bn(loader, ref)
        ref.eval()
        torch.testing.assert_close(swa(x)[i], ref(x))
        for name, value in ref.module.state_dict().items():
            torch.testing.assert_close(swa.module.model_state_dict(i)[name], value)
    plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    update_bn(loader, plain)  # other models: torch's own
    assert plain[1].num_batches_tracked == 2


_UPDATE_BN_BOUND_BEFORE_IMPORT = """
import copy
import torch, torch.nn as nn
from torch.optim.swa_utils import AveragedModel, SWALR, update_bn
import hftc
models = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
          for _ in range(2)]
alone = copy.deepcopy(models[1])
swa = AveragedModel(hftc.fuse(models))
loader = [torch.randn(16, 4) * 5 + 3 for _ in range(2)]
update_bn(loader, swa)
update_bn(loader, alone)
print(torch.allclose(swa.module.model_state_dict(1)["1.running_mean"], alone[1].running_mean))
plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
update_bn(loader, plain)
print(int(plain[1].num_batches_tracked), bool(plain[1].running_mean.abs().sum() > 0))
"""


def test_swa_update_bn_bound_before_import_hftc_recomputes_per_model_too():
    """The SWA tutorial's ``from torch.optim.swa_utils import AveragedModel, SWALR,
    update_bn`` above ``import hftc`` bound torch's own function, which recomputed no
    statistics of a fused module, silently (the patch replaced only the module's name).
    Torch's function object itself now recomputes them per model; other models: torch's."""
    out = subprocess.run([sys.executable, "-c", _UPDATE_BN_BOUND_BEFORE_IMPORT],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "2", "True"], out.stdout


def test_scaler_takes_torch_grad_scalers_device_argument():
    """``torch.amp.GradScaler("cuda")`` is the habit: hftc's took the device string as N and
    failed at ``scale()`` with 'the scaler has cuda models'. A device in N's place (or as
    ``device=``) is accepted; a bad N is a TypeError when constructed."""
    torch.manual_seed(0)
    fused = hftc.fuse([nn.Linear(4, 2) for _ in range(3)])
    opt = ho.SGD(fused.parameters(), lr=0.1)
    for scaler in (GradScaler("cpu"), GradScaler(torch.device("cpu"), init_scale=2.0**8),
                   GradScaler(device="cpu")):
        scaler.scale(fused(torch.randn(5, 4)).sum((1, 2))).sum().backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.num_models == 3
        opt.zero_grad()
    for bad in (0, 2.5, True):
        with pytest.raises(TypeError, match="num_models must be a positive int"):
            GradScaler(bad)
    with pytest.raises(RuntimeError):
        GradScaler("not-a-device")


class _RunningLoss(nn.Module):
    """A loss that keeps a running average of itself in a buffer, per call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.ones(()))

    def forward(self, out, target):
        loss = ((out - target) ** 2).mean()
        self.ema.mul_(0.9)
        self.ema.add_(0.1 * loss.detach())
        return loss


def test_a_loss_that_updates_its_buffers_runs_once_per_model():
    # vmap's attempt updated the buffer (mul_) and failed (add_ of a batched value), then
    # the loop ran on top of it: the running average was off.
    torch.manual_seed(0)
    out, target = torch.randn(3, 4, 5), torch.randn(4, 5)
    fused_loss, loop_loss = _RunningLoss(), _RunningLoss()
    got = hftc.per_model(fused_loss)(out, target)
    want = torch.stack([loop_loss(out[i], target) for i in range(3)])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(fused_loss.ema, loop_loss.ema)
    # a buffer the loss only reads (a class weight) keeps vmap's way
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]))
    logits, labels = torch.randn(3, 4, 3), torch.randint(0, 3, (4,))
    torch.testing.assert_close(hftc.per_model(weighted)(logits, labels),
                               torch.stack([weighted(logits[i], labels) for i in range(3)]))
