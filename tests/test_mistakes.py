"""A user's first mistakes with a fused module get a message naming the fix and the user's
line (issue 46 item 1): a stock optimizer given one value per model, a fallback's warning
naming the op, a stock loss on a fused output taken as one model's, the ``.mean()`` of the
N per-model losses, training the copies ``unfuse()`` gave, ``skip_models`` to freeze a
model with batch norm."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.errors import FusionArgumentError, FusionTypeError


def _fused():
    torch.manual_seed(0)
    return hftc.fuse([nn.Linear(4, 2) for _ in range(3)])


@pytest.mark.parametrize("cls, kwargs, name", [
    (torch.optim.SGD, {"lr": [0.1, 0.2, 0.3]}, "lr"),
    (torch.optim.Adam, {"lr": [1e-3, 2e-3, 3e-3]}, "lr"),
    (torch.optim.AdamW, {"weight_decay": [0.0, 0.1, 0.2]}, "weight_decay"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": (0.9, 0.8, 0.0)}, "momentum"),
])
def test_a_stock_optimizer_given_one_value_per_model_names_hftc_optim(cls, kwargs, name):
    fused = _fused()
    with pytest.raises(FusionTypeError, match=rf"torch\.optim\.{cls.__name__} takes one "
                                              rf"{name} .*use hftc\.optim\.{cls.__name__}\("
                                              rf"fused\.parameters\(\), {name}=\[\.\.\.\]\)"):
        cls(fused.parameters(), **kwargs)
    with pytest.raises(FusionTypeError, match="hftc.optim.SGD"):
        torch.optim.SGD(fused.parameters(), [0.1, 0.2, 0.3])  # lr by position


@pytest.mark.parametrize("build, text", [
    (lambda fused, models: hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2]),
     r"lr has 2 values but there are 3 models"),
    (lambda fused, models: hftc.optim.Adam(fused.parameters(), betas=[(0.9, 0.99)] * 4),
     r"betas has 4 values but there are 3 models"),
    (lambda fused, models: hftc.optim.AdamW(fused.parameters(), weight_decay=[0.1] * 2),
     r"weight_decay has 2 values"),
    (lambda fused, models: hftc.optim.SGD(models[0].parameters(), lr=0.1),
     r"one model's parameters: build the optimizer on the fused module's, "
     r"SGD\(fused\.parameters\(\), \.\.\.\)"),
    (lambda fused, models: hftc.optim.SGD(fused.parameters(), lr=[0.1, -0.1, 0.2]),
     r"Invalid lr for model 1"),
])
def test_hftc_optim_given_the_wrong_n_or_one_models_parameters_raises_an_hftc_error(build,
                                                                                     text):
    """A list of values of another length than N, and one model's parameters in place of
    the fused module's, raised a builtin ValueError from hftc's internals; they are
    hftc.errors classes (still ValueErrors) saying what to give."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    fused = hftc.fuse(models)
    with pytest.raises(FusionArgumentError, match=text):
        build(fused, models)


def test_stock_optimizers_otherwise_run_as_torch_runs_them():
    fused = _fused()
    opt = torch.optim.Adam(fused.parameters(), lr=1e-3, betas=(0.8, 0.99))
    assert opt.defaults["betas"] == (0.8, 0.99)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own, untouched
        torch.optim.SGD(fused.parameters(), lr=-1.0)
    per_model = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3])
    assert per_model is not None


def test_a_fallback_warns_at_the_users_line_naming_the_op():
    class ScaledByItem(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * self.fc.weight.abs().max().item()

    torch.manual_seed(0)
    fused = hftc.fuse([ScaledByItem() for _ in range(2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        fused(torch.randn(3, 4))
    [warning] = [w for w in caught if issubclass(w.category, hftc.FusionWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert "`Tensor.item()` returned different Python values" in str(warning.message)


# --------------------------------------------------------------------------- stock losses

def _classifier(n=3, classes=5):
    torch.manual_seed(0)
    return hftc.fuse([nn.Linear(4, classes) for _ in range(n)])


def _line_of(text):
    """The line number of ``text`` in this file (the user's line a message names)."""
    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return next(k + 1 for k, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("loss, spelled", [
    (lambda out, y: F.cross_entropy(out, y), r"F\.cross_entropy"),
    (lambda out, y: nn.CrossEntropyLoss()(out, y), r"nn\.CrossEntropyLoss\(\)"),
    (lambda out, y: F.nll_loss(out, y), r"F\.nll_loss"),
])
def test_a_class_loss_on_a_fused_output_as_for_one_model_names_per_model(loss, spelled):
    fused = _classifier()
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with pytest.raises(FusionArgumentError) as caught:
        loss(fused(x), y)
    message = str(caught.value)
    assert re.search(spelled + r" got a fused module's output \[3, 16, 5\] \(3 models\) and "
                     r"one model's target \[16\]", message), message
    assert "torch would take the 3 models for the batch" in message
    assert "hftc.per_model(" in message and "losses.sum().backward()" in message
    assert f"{__file__}:" in message  # the user's line


def test_the_message_shows_the_users_line():
    fused = _classifier()
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with pytest.raises(FusionArgumentError) as caught:
        loss = F.cross_entropy(fused(x), y)  # the user's line  # noqa: F841
    line = _line_of("loss = F.cross_entropy(fused(x), y)  # the user's line  #")
    assert f"{__file__}:{line}: `loss = F.cross_entropy(fused(x), y)" in str(caught.value)


def test_a_class_loss_with_stacked_targets_names_in_dims():
    fused = _classifier()
    x, ys = torch.randn(16, 4), torch.randint(0, 5, (3, 16))
    with pytest.raises(FusionArgumentError, match=r"stacked per model \[3, 16\].*"
                                                  r"hftc\.per_model\(F\.cross_entropy, "
                                                  r"in_dims=\(0, 0\)\)"):
        F.cross_entropy(fused(x), ys)


def test_a_loss_that_refuses_other_shapes_names_per_model():
    fused = _classifier(classes=1)
    x, y = torch.randn(16, 4), torch.rand(16, 1)
    with pytest.raises(FusionArgumentError, match=r"F\.binary_cross_entropy_with_logits got"
                                                  r".*hftc\.per_model"):
        F.binary_cross_entropy_with_logits(fused(x), y)


@pytest.mark.parametrize("loss, target_shape, text", [
    (lambda out, y: F.mse_loss(out, y), (16, 5), "the target is broadcast over the models"),
    (lambda out, y: nn.MSELoss()(out, y), (16, 5), "the target is broadcast over the models"),
    (lambda out, y: F.l1_loss(out, y), (3, 16, 5), "a target stacked per model"),
    (lambda out, y: nn.SmoothL1Loss()(out, y), (1, 16, 5), "one model's target [1, 16, 5]"),
])
def test_an_elementwise_mean_over_the_models_warns_at_the_users_line(loss, target_shape, text):
    fused = _classifier()
    x, y = torch.randn(16, 4), torch.randn(*target_shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss(fused(x), y)
    [warning] = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    message = str(warning.message)
    assert text in message and "each model's gradient is divided by 3" in message
    assert "hftc.per_model(" in message
    assert warning.filename == __file__
    # torch's own broadcasting warning names what it named before: never hftc's code
    package = str(Path(hftc.__file__).parent)
    assert not any(w.filename.startswith(package) for w in caught)


def test_kl_div_batchmean_on_a_fused_output_divides_by_the_models_and_says_so():
    fused = _classifier()
    x, p = torch.randn(16, 4), torch.softmax(torch.randn(16, 5), -1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.kl_div(F.log_softmax(fused(x), -1), p, reduction="batchmean")
    [warning] = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    message = str(warning.message)
    assert "'batchmean' divides by the input's first dimension, the 3 models" in message
    assert "hftc.per_model(F.kl_div)" in message and warning.filename == __file__
    out = fused(x)  # what it says to do: each model's own batchmean, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = hftc.per_model(lambda o, t: F.kl_div(o, t, reduction="batchmean"))(
            F.log_softmax(out, -1), p)
    torch.testing.assert_close(losses[2], F.kl_div(F.log_softmax(out[2], -1), p,
                                                   reduction="batchmean"))


def test_what_is_right_on_a_fused_output_runs_as_torch_runs_it():
    fused = _classifier()
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fused(x)
        losses = hftc.per_model(F.cross_entropy)(out, y)
        torch.testing.assert_close(losses[1], F.cross_entropy(out[1], y))
        ys = torch.randn(3, 16, 5)
        total = F.mse_loss(out, ys, reduction="sum")  # the sum of the N models' sums: exact
        torch.testing.assert_close(total, sum(F.mse_loss(out[i], ys[i], reduction="sum")
                                              for i in range(3)))
        F.cross_entropy(out.reshape(-1, 5), y.repeat(3))  # flattened by hand: not a mark
        F.cross_entropy(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]))  # any other tensor


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_the_losses_keep_their_identity_signature_and_source():
    import hftc.lowering.runtime.losses as losses_module
    from hftc.passes import loss as loss_pass

    assert F.cross_entropy in losses_module._CLASS_LOSSES
    assert F.mse_loss in loss_pass._LOSSES and F.cross_entropy in loss_pass._LOSSES
    assert list(inspect.signature(F.cross_entropy).parameters)[:3] == ["input", "target",
                                                                      "weight"]
    assert inspect.getsource(F.cross_entropy).startswith("def cross_entropy(")
    assert "_hftc_check_loss" not in inspect.getsource(F.mse_loss)

    class WithLoss(nn.Module):
        def forward(self, a, b):
            return F.cross_entropy(a, b)

    graph = torch.fx.symbolic_trace(WithLoss()).graph
    assert any(node.target is F.cross_entropy for node in graph.nodes)
    scripted = torch.jit.script(WithLoss())
    a, b = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(scripted(a, b), F.cross_entropy(a, b))


def test_models_with_their_loss_inside_still_fuse():
    class WithLabels(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 5)
            self.mse = nn.MSELoss()

        def forward(self, x, labels):
            logits = self.fc(x)
            return F.cross_entropy(logits, labels) + self.mse(logits, logits.detach() * 0.5)

    torch.manual_seed(0)
    models = [WithLabels() for _ in range(3)]
    fused = hftc.fuse(models)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hftc.UsageWarning)
        out = fused(x, y)
    assert out.shape == (3,)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x, y))


# --------------------------------------------------------------------------- .mean() of N losses

def test_the_mean_of_the_per_model_losses_warns_once_at_its_line():
    fused = _classifier()
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            hftc.per_model(F.cross_entropy)(fused(x), y).mean().backward()  # the mean line
    found = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    assert (found[0].filename, found[0].lineno) == (__file__, _line_of("# the mean line"))
    assert "1/3 for each model" in str(found[0].message)
    assert "losses.sum().backward()" in str(found[0].message)


def test_the_sum_of_the_per_model_losses_is_quiet():
    fused = _classifier()
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hftc.UsageWarning)
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        (hftc.per_model(F.cross_entropy)(fused(x), y) * torch.tensor([1.0, 2.0, 3.0])
         ).sum().backward()


# --------------------------------------------------------------------------- fused steps

def _with_batch_norm(n=3):
    torch.manual_seed(0)
    return hftc.fuse([nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 5))
                      for _ in range(n)])


def test_training_an_unfused_copy_then_stepping_the_fused_optimizer_warns():
    fused = _with_batch_norm()
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    models = fused.unfuse()  # the unfuse line
    F.cross_entropy(models[1](x), y).backward()
    hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        opt.step()  # once per copy
    [warning] = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    message = str(warning.message)
    assert message.startswith("model 1's copy that fused.unfuse() gave")
    assert f"{__file__}:{_line_of('# the unfuse line')}" in message
    assert "call fused.unfuse() again" in message
    assert warning.filename == __file__


def test_copies_used_to_evaluate_or_save_are_quiet():
    fused = _with_batch_norm()
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    best = fused.unfuse_model(2).eval()
    with torch.no_grad():
        best(x)
    state = fused.unfuse_model(0).state_dict()
    tuned = fused.unfuse_model(1)  # fine-tuned apart, by an optimizer of its own: meant so
    tuned_opt = torch.optim.SGD(tuned.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hftc.UsageWarning)
        F.cross_entropy(tuned(x), y).backward()
        tuned_opt.step()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()
    assert state


def test_skip_models_on_models_with_batch_norm_warns_and_names_keep_models():
    fused = _with_batch_norm()
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(skip_models=[False, True, False])
    [warning] = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    assert "model(s) [1]'s parameters" in str(warning.message)
    assert "hftc.keep_models" in str(warning.message)
    assert warning.filename == __file__


def test_skip_models_without_batch_norm_or_by_the_grad_scaler_is_quiet():
    fused = _classifier()
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hftc.UsageWarning)
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step(skip_models=[False, True, False])
        fused = _with_batch_norm()
        opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
        scaler = hftc.amp.GradScaler("cpu")
        losses = hftc.per_model(F.cross_entropy)(fused(x), y)
        losses = losses * torch.tensor([1.0, float("inf"), 1.0])  # model 1 overflows
        scaler.scale(losses).sum().backward()
        scaler.step(opt)


def test_training_only_the_copies_then_stepping_the_fused_optimizer_warns():
    # the fused module has no gradient at all: the step does nothing, and says why
    fused = _classifier()
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    before = fused.model_state_dict(0)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    models = fused.unfuse()
    for m in models:
        F.cross_entropy(m(x), y).backward()
    with pytest.warns(hftc.UsageWarning, match="model 0's copy that fused.unfuse"):
        opt.step()
    torch.testing.assert_close(fused.model_state_dict(0), before, rtol=0, atol=0)


def test_a_class_loss_on_one_fused_model_is_caught_too():
    fused = _classifier(n=1)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with pytest.raises(FusionArgumentError, match=r"output \[1, 16, 5\] \(1 model\)"):
        F.cross_entropy(fused(x), y)


def test_a_class_loss_on_a_tensor_made_from_a_fused_output_names_per_model():
    fused = _classifier()
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    with pytest.raises(FusionArgumentError, match=r"F\.nll_loss got a tensor of a fused "
                                                  r"module's output's shape \[3, 16, 5\]"):
        F.nll_loss(F.log_softmax(fused(x), -1), y)
    with pytest.raises(FusionArgumentError, match=r"48 rows = 3 models x 16.*"
                                                  r"hftc\.per_model\(F\.cross_entropy\)"):
        F.cross_entropy(fused(x).reshape(-1, 5), y)
    # torch's own error where no fused module of that N is alive
    with pytest.raises(ValueError, match="Expected input batch_size") as caught:
        F.cross_entropy(torch.randn(7, 16, 5), y)
    assert not isinstance(caught.value, FusionArgumentError)


def test_loading_one_models_state_dict_into_the_fused_module_says_what_to_do():
    fused = _with_batch_norm()
    one = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 5)).state_dict()
    with pytest.raises(FusionArgumentError, match=r"one model's state dict \(`0\.weight` is "
                                                  r"\[6, 4\], the fused module's \[3, 6, 4\].*"
                                                  r"hftc\.replace_models"):
        fused.load_state_dict(one)
    stacked = {k: torch.stack([v] * 3) for k, v in one.items()}
    fused.load_state_dict(stacked)  # as the message says
    torch.testing.assert_close(fused.model_state_dict(2)["0.weight"], one["0.weight"])
    with pytest.raises(RuntimeError, match="size mismatch") as caught:  # torch's own
        fused.load_state_dict({**stacked, "0.weight": torch.zeros(2, 6, 4)})
    assert not isinstance(caught.value, FusionArgumentError)


def test_per_model_with_stacked_targets_marked_shared_names_in_dims():
    fused = _classifier()
    x = torch.randn(16, 4)
    out = fused(x)
    for loss, targets in ((F.cross_entropy, torch.randint(0, 5, (3, 16))),
                          (F.mse_loss, torch.randn(3, 16, 5))):
        with pytest.raises(FusionArgumentError, match=r"in_dims=\(0, 0\)"):
            hftc.per_model(loss)(out, targets)
        losses = hftc.per_model(loss, in_dims=(0, 0))(out, targets)
        torch.testing.assert_close(losses[2], loss(out[2], targets[2]))


def test_an_optimizer_on_the_original_models_warns_naming_the_fused_parameters():
    torch.manual_seed(0)
    models = [nn.Linear(4, 5) for _ in range(3)]
    fused = hftc.fuse(models)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 5, (16,))
    hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
    with pytest.warns(hftc.UsageWarning, match=r"hftc\.optim\.SGD\(fused\.parameters\(\)"):
        opt.step()
    right = hftc.optim.SGD(fused.parameters(), lr=0.1)
    own = torch.optim.SGD(models[0].parameters(), lr=0.1)  # a model trained on its own
    F.cross_entropy(models[0](x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hftc.UsageWarning)
        right.step()
        own.step()


def test_a_compiled_fused_step_beside_a_live_fused_module_keeps_its_groups():
    """torch.compile(opt.step) while another fused module is alive: the global step check
    of stock optimizers is not traced (dynamo's optimizer handling rewrote the groups'
    capturable flags, and the step refused its own param groups)."""
    import torch._dynamo

    alive = hftc.fuse([torch.nn.Linear(3, 2) for _ in range(2)])
    alive(torch.randn(4, 3))
    fused = hftc.fuse([torch.nn.Linear(3, 2).double() for _ in range(3)])
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-3, 2e-3, 3e-3])
    torch._dynamo.reset()
    step = torch.compile(opt.step)
    for _ in range(2):
        opt.zero_grad()
        fused(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
        step()
    assert [g.get("capturable") for g in opt.param_groups] == [False] * 3


def test_backward_from_the_per_model_losses_unreduced_names_the_sum():
    fused = _fused()
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    losses = hftc.per_model(F.cross_entropy)(fused(x), y)
    with pytest.raises(FusionArgumentError,
                       match=r"3 per-model losses \[3\] at .*test_mistakes\.py:\d+: "
                             r"`losses\.backward\(\)`.*losses\.sum\(\)\.backward\(\)") as caught:
        losses.backward()
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's own, kept as the cause
    none = hftc.per_model(F.cross_entropy, reduction="none")(fused(x), y)  # [3, 5]
    with pytest.raises(FusionArgumentError, match=r"losses \[3, 5\]"):
        torch.autograd.backward(none)
    # as the message says: each model's gradient is the one it gets alone
    losses.sum().backward()
    for i, model in enumerate(fused.unfuse()):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.testing.assert_close(fused.weight.grad[i], model.weight.grad)


@pytest.mark.parametrize("made", [
    lambda losses: losses / 2,                                   # gradient accumulation
    lambda losses: torch.tensor([1.0, 0.5, 2.0]) * losses,       # loss weights
    lambda losses: hftc.amp.GradScaler("cpu").scale(losses),     # AMP
])
def test_backward_from_a_tensor_made_from_the_per_model_losses_names_the_sum(made):
    """``loss = loss / accumulation_steps; loss.backward()`` (or ``scaler.scale(loss)
    .backward()``) on the N per-model losses: torch's bare "grad can be implicitly created
    only for scalar outputs" (the division's result had no mark); now hftc's error at the
    user's line, found through the losses' autograd node."""
    fused = _fused()
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    scaled = made(hftc.per_model(F.cross_entropy)(fused(x), y))
    with pytest.raises(FusionArgumentError, match=r"tensor \[3\] made from hftc\.per_model's "
                       r"3 per-model losses .* at .*test_mistakes\.py:\d+: `scaled\.backward"
                       r"\(\)`.*its sum: \(\.\.\.\)\.sum\(\)\.backward\(\)") as caught:
        scaled.backward()
    assert isinstance(caught.value.__cause__, RuntimeError)
    scaled.sum().backward()  # as it says
    assert fused.weight.grad is not None
    x3 = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar outputs") as caught:  # not from losses
        (x3 * 2 + fused(x).sum().detach()).backward()
    assert not isinstance(caught.value, FusionArgumentError)


def test_the_grad_scaler_given_the_summed_losses_names_the_line():
    fused = _fused()
    losses = hftc.per_model(F.cross_entropy)(fused(torch.randn(5, 4)), torch.zeros(5).long())
    with pytest.raises(FusionArgumentError, match=r"GradScaler\.scale at .*test_mistakes\.py:"
                       r"\d+: .*not their sum.*scaler\.scale\(losses\)\.sum\(\)"):
        hftc.amp.GradScaler("cpu").scale(losses.sum())
    with pytest.raises(FusionTypeError, match="hftc.optim optimizers"):
        scaler = hftc.amp.GradScaler("cpu")
        scaler.scale(losses)
        scaler.step(torch.optim.SGD(fused.parameters(), lr=0.1))


def test_backward_from_a_fused_output_names_the_per_model_loss():
    fused = _fused()
    with pytest.raises(FusionArgumentError, match=r"fused module's output \[3, 5, 2\] \(3 "
                                                  r"models' outputs stacked\).*hftc\.per_model"):
        fused(torch.randn(5, 4)).backward()


def test_backward_of_other_tensors_is_torchs_own():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar") as caught:
        (x * 2).backward()
    assert not isinstance(caught.value, FusionArgumentError)
    (x * 2).backward(torch.ones(3))  # with a gradient, as torch takes it
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    losses = hftc.per_model(F.mse_loss, in_dims=0)(_fused()(torch.randn(5, 4)),
                                                   torch.zeros(3, 5, 2))
    losses.backward(torch.ones(3))  # an explicit gradient: torch's own backward


def test_an_input_the_models_cannot_take_names_model_0s_op_not_hftcs_kernel():
    torch.manual_seed(0)
    fused = hftc.fuse([nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
                       for _ in range(3)])
    fused(torch.randn(5, 4))  # compiled for these inputs; other batch sizes run it too
    with pytest.raises(hftc.errors.ModelInputError,  # a RuntimeError, as torch's was
                       match=r"model 0 \(Sequential\) fails on this call's inputs \(`input` "
                             r"\[5, 7\].*module path `0`, Linear\): RuntimeError: mat1 and "
                             r"mat2 shapes cannot be multiplied \(5x7 and 4x8\)"):
        fused(torch.randn(5, 7))
    assert issubclass(hftc.errors.ModelInputError, RuntimeError)
    assert not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()
    assert fused(torch.randn(2, 4)).shape == (3, 2, 3)  # and it still runs what fits


def test_a_fused_state_dict_loaded_into_one_model_names_model_state_dict():
    fused = _with_batch_norm()
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 5))
    with pytest.raises(FusionArgumentError,
                       match=r"Sequential\.load_state_dict at .*test_mistakes\.py:\d+.* got a "
                             r"fused module's state dict \(`0\.weight` is \[3, 6, 4\], this "
                             r"module's \[6, 4\]: 3 models' tensors stacked\).*"
                             r"fused\.model_state_dict\(i\)"):
        model.load_state_dict(fused.state_dict())
    model.load_state_dict(fused.model_state_dict(1))  # as the message says
    torch.testing.assert_close(model[0].weight, fused.model_state_dict(1)["0.weight"])
    with pytest.raises(RuntimeError, match="size mismatch") as caught:  # torch's own
        model.load_state_dict({**model.state_dict(), "0.weight": torch.zeros(6, 5)})
    assert not isinstance(caught.value, FusionArgumentError)


def test_per_model_given_one_models_output_says_what_it_read():
    torch.manual_seed(0)
    models = [nn.Linear(4, 3) for _ in range(2)]
    fused = hftc.fuse(models)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.raises(FusionArgumentError,
                       match=r"per_model\(cross_entropy\) failed on each model's share of "
                             r"argument 0 \[5, 3\] \(read as 5 models' stacked: dim 0\); "
                             r"argument 1 \[5\] \(shared by the models\): ValueError: .*"
                             r"a fused module's output \[N, B, \.\.\.\]") as caught:
        hftc.per_model(F.cross_entropy)(models[0](x), y)  # one model's, not fused(x)
    assert isinstance(caught.value.__cause__, ValueError)  # torch's own, kept
    with pytest.raises(hftc.errors.FusionTypeError, match=r"argument 1 list"):
        hftc.per_model(F.cross_entropy)(fused(x), [y, y])
    assert hftc.per_model(F.cross_entropy)(fused(x), y).shape == (2,)  # as it says


def test_eval_on_the_models_given_to_fuse_warns_at_the_fused_forward():
    """``for m in models: m.eval()`` reaches none of the fused module's copies: the next
    fused forward (still in train mode, dropout on) warns once, naming fused.eval()."""
    models = [nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)) for _ in range(3)]
    x = torch.randn(5, 4)
    fused = hftc.fuse(models, example_inputs=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused(x)
        fused.eval()  # the fused module's own mode: no warning, nor with the models kept
        fused(x)
        fused.train()
        models[0].eval()  # one model only: not the mistake
        fused(x)
    for m in models:
        m.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused(x)
        fused(x)
    [warning] = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    assert "switched to eval mode since, but the fused module runs in train mode" in str(
        warning.message) and "Call fused.eval()" in str(warning.message)
    assert warning.filename == __file__
    fused.eval()  # what it says: the fused module in eval mode, as the models, and quiet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(fused(x)[1], models[1](x))


def test_saving_a_model_given_to_fuse_after_training_the_fused_module_warns():
    """The habit kept from the one-model script, ``torch.save(model.state_dict(), ...)``
    with ``model`` one of the models given to hftc.fuse, saves the weights of the fusing:
    warned once trained, naming fused.model_state_dict(i); quiet before, for the fused
    module's own, and for a model trained by itself."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    fused = hftc.fuse(models, example_inputs=(x,))
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models[1].state_dict()  # not trained yet: the same weights
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()
        saved = fused.model_state_dict(1)  # the trained ones
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models[1].state_dict()
    [warning] = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    assert "fused.model_state_dict(1)" in str(warning.message)
    assert "`0.weight` differs" in str(warning.message) and warning.filename == __file__
    assert not torch.equal(saved["0.weight"], models[1].state_dict()["0.weight"])
    own = torch.optim.SGD(models[2].parameters(), lr=0.1)  # model 2 trained by itself
    F.cross_entropy(models[2](x), y).backward()
    own.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models[2].state_dict()
        fused.state_dict()


@pytest.mark.parametrize("classes", [(torch.optim.SGD,) * 3,
                                     (torch.optim.SGD, torch.optim.Adam, torch.optim.SGD)])
def test_a_scheduler_left_on_a_stock_optimizer_after_fuse_optimizers_is_refused(classes):
    """StepLR built on each model's stock optimizer, then ``fuse_optimizers``: stepping
    the stock schedulers changed the stock optimizers' rates, which the fused optimizer
    never reads (each model silently kept its first rate). The fused step is refused
    before changing anything, naming the model, the rate and the user's line; schedulers
    on the fused optimizer then train each model as its own stock run."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 5).double() for _ in range(3)]
    alone = [nn.Linear(4, 5).double() for _ in range(3)]
    for a, m in zip(alone, models):
        a.load_state_dict(m.state_dict())
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 5, (8,))
    lrs = [0.1, 0.2, 0.3]
    opts = [cls(m.parameters(), lr=lr) for cls, m, lr in zip(classes, models, lrs)]
    stale = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    fused = hftc.fuse(models)
    opt = hftc.optim.fuse_optimizers(fused, opts)
    hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
    for sched in stale:
        with warnings.catch_warnings():  # (torch: a scheduler step before any step)
            warnings.simplefilter("ignore", UserWarning)
            sched.step()
    before = [p.detach().clone() for p in fused.parameters()]
    with pytest.raises(FusionArgumentError, match=r"(?s)test_mistakes\.py:\d+: `opt\.step\(\)`"
                       r".*optimizers\[0\].*'lr' changed from 0\.1 to 0\.05.*StepLR\(opt"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(fused.parameters(), before))
    followed = hftc.optim.fuse_optimizers(fused, opts)  # code that copies the stock rates
    for sched in stale:                                 # into the fused groups is right
        sched.step()
    for i, o in enumerate(opts):
        followed.param_groups[i]["lr"] = o.param_groups[0]["lr"]
    fused.zero_grad(set_to_none=True)
    followed.step()  # (checked, and no gradient: nothing moves)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    own = [cls(a.parameters(), lr=lr) for cls, a, lr in zip(classes, alone, lrs)]
    own_scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in own]
    for _ in range(3):
        opt.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()
        sched.step()
        for a, o, s in zip(alone, own, own_scheds):
            o.zero_grad()
            F.cross_entropy(a(x), y).backward()
            o.step()
            s.step()
    for i, a in enumerate(alone):
        for name, value in a.state_dict().items():
            torch.testing.assert_close(fused.model_state_dict(i)[name], value, rtol=0,
                                       atol=1e-12)


def test_a_fused_optimizers_state_dict_loaded_into_one_models_optimizer_names_unfuse():
    """Resuming one model alone from a fused run's optimizer checkpoint: torch's bare
    "different number of parameter groups" (or, N=1, the stacked state loaded as it is);
    now hftc's error at the user's line naming unfuse_optimizers, whose state loads."""
    import io

    torch.manual_seed(0)
    models = [nn.Linear(4, 2) for _ in range(3)]
    fused = hftc.fuse(models)
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-3, 2e-3, 3e-3])
    hftc.per_model(F.cross_entropy)(fused(torch.randn(5, 4)), torch.zeros(5).long()).sum() \
        .backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    one = torch.optim.Adam(nn.Linear(4, 2).parameters())
    with pytest.raises(FusionArgumentError, match=r"Adam\.load_state_dict at .*test_mistakes"
                       r"\.py:\d+: `one\.load_state_dict\(saved\)`.*unfuse_optimizers"):
        one.load_state_dict(saved)
    copies = fused.unfuse()
    stock = hftc.optim.unfuse_optimizers(fused, opt, copies)
    own = torch.optim.Adam(copies[1].parameters())
    own.load_state_dict(stock[1].state_dict())  # as it says: model 1's loads
    assert own.param_groups[0]["lr"] == 2e-3
    again = hftc.optim.Adam(fused.parameters(), lr=1.0)
    again.load_state_dict(saved)  # into a fused optimizer: as before
    assert [g["lr"] for g in again.param_groups] == [1e-3, 2e-3, 3e-3]


def test_a_compiled_step_does_not_recompile_as_fused_modules_come_and_go():
    """torch's optimizer step pre-hook of ``import hftc`` read the live fused modules'
    count before it saw it was being compiled: ``torch.compile(opt.step)`` then guarded
    on that count, and recompiled the step whenever a fused module (another test's, one
    the user dropped) was collected."""
    import gc

    import torch._dynamo

    from hftc.optim.optimizer import STEPPED_STOCK_OPTIMIZERS

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    eager = nn.Linear(4, 3).double()
    eager.load_state_dict(model.state_dict())
    # (no momentum: torch's own compiled step recompiles once its state is made)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    torch._dynamo.reset()
    step = torch.compile(opt.step)
    x = torch.randn(5, 4, dtype=torch.float64)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for k in range(4):
            fused = hftc.fuse([nn.Linear(4, 3) for _ in range(k + 2)])  # one more live
            for m, o in ((model, opt), (eager, eager_opt)):
                o.zero_grad()
                m(x).pow(2).sum().backward()
            step()
            eager_opt.step()
            del fused
            gc.collect()  # and gone again
    assert opt in STEPPED_STOCK_OPTIMIZERS  # (hftc.keep_models' refusal still sees it)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
