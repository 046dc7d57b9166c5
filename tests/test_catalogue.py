"""The catalogue of bad input: each case refused with a message a user can act on, or fused
exactly.  None may surface as a bare AttributeError / RuntimeError / IndexError from hftc."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn
from zoo import WritesItsInput

import hftc
from hftc.errors import (
    FusionArgumentError,
    MismatchError,
    TraceError,
    UnsupportedOperatorError,
)


def mlp(width=8, act=nn.ReLU, bias=True):
    return nn.Sequential(nn.Linear(4, width, bias=bias), act(), nn.Linear(width, 2))


class Ordered(nn.Module):
    """Two branches whose submodules are defined and applied in a configurable order."""

    def __init__(self, first_conv: bool):
        super().__init__()
        self.first_conv = first_conv
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        if self.first_conv:
            return self.pool(self.conv(x))
        return self.conv(self.pool(x))


@pytest.mark.parametrize(("models", "pattern"), [
    ([mlp(), mlp(16)], r"model 1's `0` \(nn.Linear\) differs from model 0's: out_features 16 vs 8"),
    ([nn.Sequential(nn.Conv2d(3, 4, 3)), nn.Sequential(nn.Conv2d(3, 4, 5))],
     r"kernel_size \(5, 5\) vs \(3, 3\)"),
    ([nn.Sequential(nn.Conv2d(3, 4, 3, stride=1)), nn.Sequential(nn.Conv2d(3, 4, 3, stride=2))],
     r"stride \(2, 2\) vs \(1, 1\)"),
    ([mlp(), nn.Sequential(nn.Linear(4, 8), nn.ReLU())],
     r"model 1's graph has 4 nodes, model 0's 5 \(an extra or missing layer\)\n  model 1's "
     r"output differs from model 0's `2` \(nn.Linear\): op output vs call_module\n"),
    ([mlp(), mlp(act=nn.Softmax)],
     r"model 1's `1` \(nn.Softmax\) differs from model 0's `1` \(nn.ReLU\): class Softmax vs "
     r"ReLU; only an elementwise op \(an activation such as ReLU"),
    ([Ordered(True), Ordered(False)], r"model 1 of 2 cannot be fused"),
    ([mlp(), mlp(bias=False)], r"parameter `0.bias`: none vs a float32 parameter of shape \(8,\)"),
], ids=["width", "kernel", "stride", "missing-layer", "activation", "submodule-order", "bias"])
def test_models_that_differ(models, pattern):
    with pytest.raises(MismatchError, match=pattern):
        hftc.fuse(models)


def test_different_dtypes():
    with pytest.raises(MismatchError, match=r"parameter `0.weight`: dtype float64 vs float32"
                                            r"(?s:.*)Convert every model to one dtype with "
                                            r"\.to\(dtype\)"):
        hftc.fuse([mlp(), mlp().double()])


def test_parameters_frozen_in_some_models_only():
    frozen = mlp()
    frozen[0].weight.requires_grad_(False)
    with pytest.raises(MismatchError, match=r"model 1's `0` \(nn.Linear\) differs from model 0's: "
                                            r"parameter `0.weight`: requires_grad False vs True"
                                            r"(?s:.*)Freeze the same parameters in every model"):
        hftc.fuse([mlp(), frozen])


def test_frozen_in_all_models_stays_frozen():
    models = [mlp() for _ in range(2)]
    for m in models:
        m[0].requires_grad_(False)
    fused = hftc.fuse(models)
    assert not fused.state_dict(keep_vars=True)["0.weight"].requires_grad
    assert fused.state_dict(keep_vars=True)["2.weight"].requires_grad


def test_wrong_number_of_inputs():
    fused = hftc.fuse([mlp(), mlp()])
    with pytest.raises(FusionArgumentError, match=r"got 2 positional inputs, but the models' "
                                            r"forward takes 1 input \(`input`\)"):
        fused(torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(FusionArgumentError, match=r"missing input `input`"):
        fused()


def test_input_of_another_dtype():
    fused = hftc.fuse([mlp(), mlp()])
    with pytest.raises(FusionArgumentError, match=r"input 0 \(`input`\) is torch.float64 .* parameters are "
                                                  r"torch.float32.*fused.to\(torch.float64\)"):
        fused(torch.randn(2, 4, dtype=torch.float64))


def test_forward_hooks_are_refused_not_ignored():
    hooked = mlp()
    hooked[1].register_forward_hook(lambda m, i, o: o * 2)
    hooked.register_forward_pre_hook(lambda m, i: i)
    with pytest.raises(UnsupportedOperatorError, match=r"(?s)model 1, module `<root>` \(Sequential\): "
                                                       r"1 forward pre-hook.*model 1, module `1` "
                                                       r"\(ReLU\): 1 forward hook"):
        hftc.fuse([mlp(), hooked])


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_gradient_hooks_on_parameters_are_refused_not_ignored(kind):
    # The fused module's stacked parameters are new tensors: a clamp registered on a
    # model's parameter never ran, and the gradients went unclamped.
    hooked = mlp()
    getattr(hooked[0].weight, kind)(lambda g: None)
    with pytest.raises(UnsupportedOperatorError, match=r"(?s)model 1, parameter `0.weight`: 1 "
                                                       r".*hook.*fused.get_parameter"):
        hftc.fuse([mlp(), hooked])


@pytest.mark.parametrize("name", ["weight_norm", "spectral_norm"])
def test_deprecated_reparametrization_hooks_name_the_replacement(name):
    # torch.nn.utils.weight_norm / spectral_norm work through a forward pre-hook; their
    # torch.nn.utils.parametrizations versions run per model inside the fused module.
    models = [mlp() for _ in range(2)]
    for m in models:
        getattr(torch.nn.utils, name)(m[0])
    with pytest.raises(UnsupportedOperatorError,
                       match=rf"model 0, module `0` \(Linear\): 1 forward pre-hook\(s\), from "
                             rf"torch.nn.utils.{name}: use torch.nn.utils.parametrizations.{name}"):
        hftc.fuse(models)


class StochasticDepth(nn.Module):
    """Skips its layer at random, drawing with Python's ``random`` or ``numpy``."""

    def __init__(self, use_numpy: bool):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.use_numpy = use_numpy

    def forward(self, x):
        import random

        import numpy

        draw = numpy.random.rand() if self.use_numpy else random.random()
        if self.training and draw < 0.5:
            return x
        return self.fc(x)


def test_a_random_branch_drawn_with_torch_is_refused():
    """``if torch.rand(()) < p`` takes no traced value: fx drew it once while tracing and
    kept the branch (models whose draws differed were "not structurally identical";
    equal draws fused, the branch taken always or never).  The draw is now a node, and
    a node cannot decide Python's control flow."""
    class TorchStochasticDepth(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if self.training and torch.rand(()).item() < 0.5:
                return x
            return self.fc(x)

    for seed in range(4):
        torch.manual_seed(seed)
        with pytest.raises(TraceError, match="cannot be used as inputs to control flow"):
            hftc.fuse([TorchStochasticDepth() for _ in range(3)])


def test_torch_noise_of_a_constant_shape_is_drawn_per_call_and_per_model():
    """``torch.randn(4)`` takes no traced value: fx kept the tensor drawn while tracing,
    the same noise for every model at every call."""
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) + torch.randn(4) + torch.rand(()) * torch.randint(1, 3, ())

    models = [Noisy() for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(5, 4)
    noise = [fused(x) - torch.stack([m(x) for m in models]).detach() for _ in range(2)]
    for a in noise:
        assert torch.allclose(a[:, 0], a[:, 1])  # one draw per model, for the whole batch
        assert not torch.allclose(a[0], a[1]) and not torch.allclose(a[1], a[2])
    assert not torch.allclose(noise[0], noise[1])
    assert fused.fusion_report.check.passed  # with the draws made constant, exact


def test_draws_into_a_shared_tensor_are_per_model():
    """``torch.empty_like(x).normal_()`` on the shared input (noise injection; how
    torch.distributions' rsample draws) was refused as an in-place write into a value
    shared by all models.  Each model now draws into its own copy, which later reads of
    the tensor see."""
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            e = torch.empty_like(x)
            e.uniform_(-0.1, 0.1)  # in place; e is read below
            y = x + torch.empty_like(x).normal_() * 0.1
            return self.fc(y + e), e

    models = [Noisy() for _ in range(3)]
    fused = hftc.fuse(models)
    out, e = fused(torch.randn(5, 4))
    assert e.shape == (3, 5, 4) and e.abs().max() <= 0.1
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[1], e[2])
    assert [r.rule for r in fused.fusion_report.records if r.rule == "per_model_draw"] == \
        ["per_model_draw"] * 2
    assert fused.fusion_report.check.passed  # with the draws made constant, exact


@pytest.mark.parametrize("batch", [2, 3, 5])
def test_noise_like_a_shared_input_is_drawn_per_model(batch):
    """A diffusion model's loss, ``noise = torch.randn_like(img)`` mixed into the input and
    used as the target: on a shared input the fused program drew one ``[B, ...]`` tensor
    and called it per model's, so model i's target was sample i's noise for its whole
    batch (a silent wrong loss when B == N, a crash otherwise), and every model got the
    same noise. Each model draws its own ``[B, ...]`` noise, and its loss is the one its
    own noise gives."""
    class Denoiser(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 4)

        def forward(self, x):
            noise = torch.randn_like(x)
            coin = torch.rand_like(x) + torch.randint_like(x, 0, 3)
            x_t = 0.8 * x + 0.6 * noise
            return F.mse_loss(self.net(x_t), noise), noise, x_t, coin

    models = [Denoiser() for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(batch, 4)
    loss, noise, x_t, coin = fused(x)
    assert noise.shape == x_t.shape == coin.shape == (3, batch, 4)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[1], noise[2])
    assert not torch.equal(coin[0], coin[1])
    torch.testing.assert_close(x_t, 0.8 * x + 0.6 * noise)
    for i, m in enumerate(models):
        torch.testing.assert_close(loss[i], F.mse_loss(m.net(x_t[i]), noise[i]))
    assert fused.fusion_report.fallbacks == []


class GaussianPolicy(nn.Module):
    """A reparameterised Gaussian policy head (torch.distributions), as RL code writes it."""

    def __init__(self, validate_args=None):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.validate_args = validate_args

    def forward(self, x):
        mean, log_std = self.fc(x).chunk(2, -1)
        dist = torch.distributions.Normal(mean, log_std.exp(), validate_args=self.validate_args)
        action = dist.rsample()
        return action, dist.log_prob(action).sum(-1)


def test_torch_distributions_say_how_to_fuse_them():
    x = torch.randn(5, 4)
    with pytest.raises(TraceError, match=r"torch.distributions.*validate_args=False"):
        hftc.fuse([GaussianPolicy() for _ in range(3)])
    models = [GaussianPolicy(validate_args=False) for _ in range(3)]
    fused = hftc.fuse(models, example_inputs=(x,))  # the advice: traced by torch.export
    action, log_prob = fused(x)
    assert action.shape == (3, 5, 2) and log_prob.shape == (3, 5)
    assert fused.fusion_report.check.passed and not fused.fusion_report.check.shapes_only
    log_prob.sum().backward()  # reparameterised: gradients reach the weights
    assert fused.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("use_numpy", [False, True], ids=["random", "numpy"])
def test_python_random_in_forward_is_refused(use_numpy):
    # Traced, a Python draw would be one value for every call (a layer dropped at random
    # dropped always, or never): hftc names it and says to draw with torch.
    import random

    import numpy

    name = r"numpy[.]random[.]rand" if use_numpy else r"random[.]random"
    with pytest.raises(TraceError, match=rf"forward calls {name}\(\).*torch.rand"):
        hftc.fuse([StochasticDepth(use_numpy) for _ in range(2)])
    assert random.random() < 1 and numpy.random.rand() < 1  # the real ones are back


def test_in_place_ops_on_inputs_match_each_model_alone():
    models = [WritesItsInput() for _ in range(3)]
    x = torch.randn(2, 4)
    out = hftc.fuse(models)(x.clone())
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x.clone()))


def test_in_place_op_mixing_shared_and_per_model_values_is_refused():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return x.add_(self.fc(x))  # writes per-model values into the shared input

    with pytest.raises(UnsupportedOperatorError, match=r"in-place `add_` writes a value shared"):
        hftc.fuse([Bad(), Bad()])(torch.randn(2, 4))


def test_non_tensor_outputs_pass_through():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            h = self.fc(x)
            return h, h.size(1), "label", None

    models = [Mixed() for _ in range(2)]
    out = hftc.fuse(models)(torch.ones(2, 4))
    assert out[1:] == (3, "label", None)
    assert out[0].shape == (2, 2, 3)


def test_same_instance_twice_and_stacked_inputs():
    m = mlp()
    check_equivalence([m, m], torch.randn(2, 3, 4), in_dims=0)


def test_unsupported_ops_are_all_listed():
    class TwoBad(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            x.add_(self.a(x))
            return x.mul_(self.a(x))

    with pytest.raises(UnsupportedOperatorError, match=r"(?s)2 operator\(s\).*add_.*mul_") as info:
        hftc.fuse([TwoBad(), TwoBad()])(torch.randn(2, 4))
    assert len(info.value.operators) == 2


def test_functional_call_difference_names_the_function():
    class A(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.dim = dim

        def forward(self, x):
            return F.softmax(x, dim=self.dim)

    with pytest.raises(MismatchError, match=r"node `softmax` \(torch.nn.functional.softmax in the "
                                            r"model's own forward\) differs from model 0's: "
                                            r"argument `dim`: 0 vs 1"):
        hftc.fuse([A(1), A(0)])


def test_uninitialized_lazy_modules_say_to_call_the_models_once():
    """A LazyLinear before its first call was refused as a module with a forward
    pre-hook ("remove the hooks"), which its user never added."""
    models = [nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2)) for _ in range(2)]
    with pytest.raises(FusionArgumentError, match=r"model 0, module `0` \(LazyLinear\).*"
                                                  r"Call each model once"):
        hftc.fuse(models)
    x = torch.randn(3, 5)
    with torch.no_grad():
        for m in models:
            m(x)
    out = hftc.fuse(models)(x)  # initialized: the hook is gone, and they fuse
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))


class SizeArguments(nn.Module):
    """Ops that run model by model, given a ``torch.Size`` (``x.size()``, ``h.shape[-2:]``):
    the spatial transformer tutorial's ``F.affine_grid(theta, x.size())``, ``F.fold``'s
    ``output_size``, and a draw shaped like the input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.theta = nn.Parameter(torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
                                  + 0.1 * torch.randn(2, 3))

    def forward(self, x):
        h = self.conv(x)
        grid = F.affine_grid(self.theta.expand(x.shape[0], 2, 3), x.size(), align_corners=False)
        warped = F.grid_sample(h, grid, align_corners=False)
        folded = F.fold(F.unfold(h, 2, stride=2), output_size=h.shape[-2:], kernel_size=2,
                        stride=2)
        return warped + folded + 0.0 * torch.randn(x.shape, dtype=x.dtype)


def test_size_arguments_of_ops_that_run_per_model():
    """The one-by-one fallback flattened its arguments at run time with pytree, which splits a
    ``torch.Size`` into its ints, while its flags counted the Size as one value: every such
    call failed with a pytree 'leaves has length 3 but the spec refers to 6' error."""
    check_equivalence([SizeArguments() for _ in range(3)], torch.randn(2, 3, 4, 4))


class WritesIntoNewTensor(nn.Module):
    """Per-model values written in place into tensors forward created, the ways models
    write them: ``y[idx] = v``, ``torch.index_put_``, a ``fill_`` / ``clamp_`` with a
    per-model operand, ``+=``; and ``y & mask`` (``__and__``, not in place)."""

    def __init__(self, item_assignment: bool):
        super().__init__()
        self.item_assignment = item_assignment  # fx's symbolic tracing cannot record it
        self.v = nn.Parameter(torch.randn(4))
        self.register_buffer("c", torch.randn(()))

    def forward(self, x):
        y = torch.zeros_like(x)
        if self.item_assignment:  # torch.export records it as index_put_
            y[torch.tensor([0, 2])] = self.v
        z = x.new_zeros(x.shape)
        torch.index_put_(z, (torch.tensor([1]),), self.v * 2)
        z.clamp_(min=self.c)
        w = torch.clone(x)
        w += self.v
        mask = torch.ones_like(x, dtype=torch.bool) & (x * self.v > 0)
        return y + z + w * mask


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_per_model_writes_into_a_tensor_forward_made(frontend):
    """Such writes went into one tensor all models shared (each model read the last one's
    write: a silent wrong answer the first-call check missed when models 0 and N-1 wrote
    alike), or crashed (``fill_`` of a stacked value); ``y & mask`` was refused as an
    in-place write. Each model now writes into its own copy."""
    x = torch.randn(3, 4)
    models = [WritesIntoNewTensor(item_assignment=frontend == "export") for _ in range(3)]
    check_equivalence(models, x,
                      fuser=lambda models, in_dims: hftc.fuse(
                          models, in_dims=in_dims, frontend=frontend,
                          example_inputs=(x.double(),)))


def test_a_per_model_write_into_a_view_of_the_input_is_refused():
    class IntoView(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2))

        def forward(self, x):
            head = x[:, :2]
            head.mul_(self.w)  # writes the caller's x through the view
            return x

    with pytest.raises(UnsupportedOperatorError, match=r"in-place `mul_` writes a value shared"):
        hftc.fuse([IntoView() for _ in range(2)])(torch.randn(3, 4))


class ShiftRight(nn.Module):
    """T5's ``_shift_right``: a start token id the traced code lifts as a tensor constant."""

    def __init__(self, start: int):
        super().__init__()
        self.start = torch.tensor(start)
        self.embed = nn.Embedding(10, 3)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = self.start
        return self.embed(shifted)


def test_constant_equal_in_every_model_stays_shared():
    """Lifted tensor constants were stacked per model even when equal, so T5 / BART with
    labels= failed on their first call (``fill_`` of a stacked start token id into a
    shared tensor). Equal ones are one shared buffer. Per-model ones, written through a
    view of the shared tensor (``shifted[..., 0]``), are refused, clearly."""
    ids = torch.randint(1, 10, (2, 5))

    def fuser(models, in_dims):
        return hftc.fuse(models, in_dims=in_dims, example_inputs=(ids,))

    fused = check_equivalence([ShiftRight(0) for _ in range(3)], ids, fuser=fuser)
    assert [n for n, _ in fused.named_buffers() if n.startswith("_hftc_constant_shared_")]
    with pytest.raises(UnsupportedOperatorError, match="writes a value shared by all models"):
        fuser([ShiftRight(s) for s in (0, 4, 0)], None)(ids)
