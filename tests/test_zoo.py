"""Fused zoo models against a plain loop over the originals, forward and backward.

The grid: every zoo model x N in {1, 3} (and 8 for the MLP) x train/eval, in
float64 with one shared input; stacked per-model inputs (``in_dims=0``) for
LeNet, the MLP and the DCGAN discriminator; float32 for two models; the fused
module cast after fusing; the mode switched after fusing.  The harness tests at
the end check that ``check_equivalence`` passes a correct loop fuser and fails,
naming the culprit, on deliberately wrong ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from equivalence import (
    DEFAULT_TOL,
    LoopFused,
    check_equivalence,
    loop_fuse,
    loop_rounding_error,
    model_inputs,
    reference_outputs,
    relu_margin,
    stack_inputs,
)
from zoo import ZOO, make_input, make_models

BATCH = 4  # never equal to an N in the grid, so a confused batch/model dim shows


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: intra-op threads only add overhead, and on a loaded
    2-core machine their spin-waits made this file 134 s instead of 20 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d)


def _randomize_norm_state(models: list[nn.Module], seed: int = 0) -> list[nn.Module]:
    """Give every norm layer per-model affine parameters and running stats.

    Fresh batch norms are identical across models (weight 1, bias 0, mean 0,
    var 1); a fuser that used model 0's statistics for all would pass unnoticed.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for model in models:
            for m in model.modules():
                if not isinstance(m, _NORMS):
                    continue
                if getattr(m, "weight", None) is not None:
                    m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
                if getattr(m, "running_mean", None) is not None:
                    m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                    m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
                    m.num_batches_tracked.fill_(int(torch.randint(0, 100, (1,), generator=gen)))
    return models


def _zero_dropout(models: list[nn.Module]) -> list[nn.Module]:
    """Dropout masks are random, so train-mode equivalence is checked with p = 0."""
    for model in models:
        for m in model.modules():
            if isinstance(m, _DROPOUTS):
                m.p = 0.0
    return models


def _zoo_models(name: str, n: int, train: bool, seed: int = 0) -> list[nn.Module]:
    models = _randomize_norm_state(make_models(name, n, seed=seed), seed=seed)
    return _zero_dropout(models) if train else models


SHARED_GRID = [(name, n) for name in ZOO for n in (1, 3)] + [("mlp", 8)]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("name", "n"), SHARED_GRID, ids=[f"{m}-N{n}" for m, n in SHARED_GRID])
def test_zoo_shared_input(name, n, train):
    models = _zoo_models(name, n, train)
    x = make_input(name, BATCH, seed=1)
    check_equivalence(models, x, train=train, steps=2 if train else 1)


STACKED_GRID = [
    (name, n) for name in ("lenet5_mnist", "mlp", "dcgan_discriminator") for n in (1, 3)
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("name", "n"), STACKED_GRID, ids=[f"{m}-N{n}" for m, n in STACKED_GRID])
def test_zoo_stacked_input(name, n, train):
    models = _zoo_models(name, n, train)
    xs = stack_inputs([make_input(name, BATCH, seed=10 + i) for i in range(n)])
    check_equivalence(models, xs, in_dims=0, train=train, steps=2 if train else 1)


def test_zoo_in_dims_tuple():
    """A one-entry tuple means the same as the int it holds."""
    models = _zoo_models("mlp", 3, train=True)
    xs = stack_inputs([make_input("mlp", BATCH, seed=10 + i) for i in range(3)])
    check_equivalence(models, (xs,), in_dims=(0,), train=True)


# PointNet's float32 gradients are ill-conditioned (batch norm over 4 samples after
# a max over points): the plain float32 loop is itself ~5e-5 (relative) away from
# the float64 one, and after one SGD step model 1's is 2.6e-2 away.  So PointNet
# gets a wider tolerance and a single step; float64 runs check it at 1e-10.
FLOAT32_CASES = {"resnet": (None, 2), "pointnet_cls": (2e-4, 1)}


@pytest.mark.parametrize("name", list(FLOAT32_CASES))
def test_zoo_float32(name):
    tol, steps = FLOAT32_CASES[name]
    models = _zoo_models(name, 3, train=True)
    x = make_input(name, BATCH, seed=1)
    check_equivalence(models, x, dtype=torch.float32, train=True, steps=steps, tol=tol)


@pytest.mark.parametrize("name", ["lenet5_cifar", "resnet"])
def test_zoo_cast_after_fuse(name):
    """Fuse float32 models, then ``.double()`` the fused module."""
    models = _zoo_models(name, 3, train=True)
    x = make_input(name, BATCH, seed=1)
    check_equivalence(models, x, dtype=torch.float64, cast_after_fuse=True, train=True)


@pytest.mark.parametrize("name", ["resnet", "pointnet_cls"])
@pytest.mark.parametrize("fuse_train", [True, False], ids=["fused-in-train", "fused-in-eval"])
def test_zoo_mode_switch_after_fuse(name, fuse_train):
    """Fused in one mode, run in the other: ``.train()`` / ``.eval()`` must take effect."""
    models = _zoo_models(name, 3, train=True)
    x = make_input(name, BATCH, seed=1)
    check_equivalence(models, x, train=not fuse_train, fuse_train=fuse_train)


def test_zoo_dropout_masks_differ_per_model():
    """Dropout is live in train mode, off in eval, and each model draws its own mask."""
    import hftc

    model = make_models("pointnet_cls", 1, dropout=0.5)[0].double()
    fused = hftc.fuse([copy.deepcopy(model) for _ in range(3)])
    x = make_input("pointnet_cls", 8, seed=1, dtype=torch.float64)

    fused.eval()
    with torch.no_grad():
        log_probs, _ = fused(x)
    for i in (1, 2):
        torch.testing.assert_close(log_probs[i], log_probs[0], rtol=0, atol=1e-12)

    fused.train()
    with torch.no_grad():
        log_probs, _ = fused(x)
    assert not torch.allclose(log_probs[0], log_probs[1]), "models 0 and 1 drew the same mask"
    assert not torch.allclose(log_probs[1], log_probs[2]), "models 1 and 2 drew the same mask"


# --------------------------------------------------------------------------- the harness


@pytest.mark.parametrize("name", list(ZOO))
def test_harness_accepts_loop_fuser(name):
    """The reference loop fuser passes on every zoo model: the harness and the zoo agree."""
    models = _zoo_models(name, 3, train=True)
    x = make_input(name, BATCH, seed=1)
    check_equivalence(models, x, train=True, steps=2, fuser=loop_fuse)
    check_equivalence(models, x, train=False, fuser=loop_fuse)


def test_harness_accepts_loop_fuser_stacked():
    models = _zoo_models("lenet5_mnist", 3, train=True)
    xs = stack_inputs([make_input("lenet5_mnist", BATCH, seed=10 + i) for i in range(3)])
    check_equivalence(models, xs, in_dims=0, fuser=loop_fuse, steps=2)


def test_harness_leaves_callers_models_alone():
    models = _zoo_models("resnet", 2, train=True)
    before = [copy.deepcopy(m.state_dict()) for m in models]
    check_equivalence(models, make_input("resnet", BATCH), fuser=loop_fuse, steps=2)
    for m, state in zip(models, before):
        for key, value in m.state_dict().items():
            assert torch.equal(value, state[key]), key
        assert m.conv1.weight.dtype == torch.float32


def test_reference_outputs_and_model_inputs():
    models = make_models("mlp", 2)
    xs = stack_inputs([torch.randn(BATCH, 64), torch.randn(BATCH, 64)])
    outs = reference_outputs(models, xs, in_dims=0)
    assert torch.equal(outs[1], models[1](xs[1]))
    shared = torch.randn(BATCH, 64)
    assert model_inputs((xs, shared), (0, None), 1)[1] is shared
    assert torch.equal(model_inputs((xs, shared), (0, None), 1)[0], xs[1])
    pair = stack_inputs([(xs[0], shared), (xs[1], shared)])
    assert pair[0].shape == (2, BATCH, 64) and pair[1].shape == (2, BATCH, 64)


class _PerturbOutput(LoopFused):
    """Model 1's output is off by 1e-6: far above float64's tolerance."""

    def forward(self, *args):
        out = super().forward(*args)
        bump = torch.zeros_like(out)
        bump[1] = 1e-6
        return out + bump


class _PerturbGradient(LoopFused):
    """Right values, but model 1's gradient is scaled by 1.001."""

    def forward(self, *args):
        out = super().forward(*args)
        scale = torch.ones(out.shape[0], *([1] * (out.dim() - 1)), dtype=out.dtype)
        scale[1] = 1.001
        return out * scale - (out * (scale - 1)).detach()


class _PerturbBuffer(LoopFused):
    """Model 2's running mean drifts during the forward pass."""

    def forward(self, *args):
        out = super().forward(*args)
        with torch.no_grad():
            self.bn1.running_mean[2] += 1e-3
        return out


class _SwapModels(LoopFused):
    """Returns the models' outputs in the wrong order."""

    def forward(self, *args):
        return super().forward(*args).flip(0)


def _lenet(n: int = 3) -> tuple[list[nn.Module], torch.Tensor]:
    return make_models("lenet5_mnist", n), make_input("lenet5_mnist", BATCH)


def test_relu_margin_is_the_smallest_relu_input_of_any_model():
    # Module and functional ReLUs, in place or not, every model; in float64.
    class Net(nn.Module):
        def __init__(self, shift):
            super().__init__()
            self.shift, self.act = shift, nn.ReLU(inplace=True)

        def forward(self, x):
            return torch.relu(self.act(x + self.shift) - 0.5)

    x = torch.tensor([[0.25, -1.0, 3.0]], dtype=torch.float32)
    assert relu_margin([Net(0.0)], x) == pytest.approx(0.25)
    # model 1's functional ReLU: relu(0.25 + 0.2) - 0.5
    assert relu_margin([Net(0.0), Net(0.2)], x) == pytest.approx(0.05)
    assert relu_margin([nn.Identity()], x) == float("inf")


def test_harness_catches_wrong_output():
    models, x = _lenet()
    with pytest.raises(AssertionError, match=r"model 1: output <root>: max abs diff"):
        check_equivalence(models, x, fused=_PerturbOutput(models))


def test_harness_catches_wrong_output_in_float32():
    models, x = _lenet()
    fused = _PerturbOutput(models)
    with pytest.raises(AssertionError, match=r"model 1: output"):
        check_equivalence(models, x, fused=fused, dtype=torch.float32, tol=1e-8)


class _PerturbGradientSlightly(LoopFused):
    """Right values, but model 1's gradient is scaled by 1 + 1e-4: a wrong result that
    float32's rounding alone does not give."""

    def forward(self, *args):
        out = super().forward(*args)
        scale = torch.ones(out.shape[0], *([1] * (out.dim() - 1)), dtype=out.dtype)
        scale[1] = 1 + 1e-4
        return out * scale - (out * (scale - 1)).detach()


def test_loop_rounding_error_sets_a_float32_tolerance_that_still_catches_wrong_gradients():
    models, x = _lenet()
    rounding = loop_rounding_error(models, x)
    # LeNet-5's float32 loop is close to its float64 loop (float32's epsilon is 1.2e-7) ...
    assert 0 < rounding < 1e-5
    tol = max(DEFAULT_TOL[torch.float32], 10 * rounding)
    check_equivalence(models, x, dtype=torch.float32, tol=tol, fuser=loop_fuse)
    # ... and a gradient off by 1e-4 is far outside that.
    with pytest.raises(AssertionError, match=r"model 1: grad of"):
        check_equivalence(models, x, fused=_PerturbGradientSlightly(models),
                          dtype=torch.float32, tol=tol)


def test_loop_rounding_error_grows_with_ill_conditioning():
    """A layer norm over two features after a linear amplifies rounding (the case that
    made the fixed float32 tolerance too tight for fuzzing)."""
    torch.manual_seed(0)
    well = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)]
    ill = [nn.Sequential(nn.Linear(8, 2), nn.LayerNorm(2)) for _ in range(2)]
    x = torch.randn(4, 8)
    assert loop_rounding_error(well, x, dtype=torch.float64) == 0.0
    assert loop_rounding_error(ill, x) > loop_rounding_error(well, x)


def test_harness_catches_wrong_gradient():
    models, x = _lenet()
    with pytest.raises(AssertionError, match=r"model 1: grad of 'fc3\.weight'") as info:
        check_equivalence(models, x, fused=_PerturbGradient(models))
    assert "model 0:" not in str(info.value) and "model 2:" not in str(info.value)


def test_harness_catches_wrong_buffer():
    models = make_models("resnet", 3)
    x = make_input("resnet", BATCH)
    with pytest.raises(AssertionError, match=r"model 2: buffer 'bn1\.running_mean'"):
        check_equivalence(models, x, fused=_PerturbBuffer(models))


def test_harness_catches_swapped_models():
    models, x = _lenet()
    with pytest.raises(AssertionError, match=r"model 0: output") as info:
        check_equivalence(models, x, fused=_SwapModels(models))
    assert "model 2: output" in str(info.value)


def test_harness_catches_stale_weights():
    """A fused module that ignores updates to its parameters fails at step 1."""

    class Frozen(LoopFused):
        def __init__(self, models):
            super().__init__(models)
            self._frozen = [copy.deepcopy(m).double() for m in models]

        def forward(self, x):
            live = super().forward(x)
            frozen = torch.stack([m(x) for m in self._frozen])
            return live + (frozen - live).detach()

    models, x = _lenet()
    with pytest.raises(AssertionError, match=r"step 1: model \d: output"):
        check_equivalence(models, x, fused=Frozen(models), steps=2)


def test_harness_catches_unstacked_parameter():
    models, x = _lenet()
    fused = LoopFused(models)
    fused.fc3.weight = nn.Parameter(fused.fc3.weight[0].clone())
    with pytest.raises(AssertionError, match=r"param 'fc3\.weight' has shape \(10, 84\)"):
        check_equivalence(models, x, fused=fused)


def test_harness_catches_wrong_output_structure():
    class Untupled(LoopFused):
        def forward(self, x):
            return super().forward(x)[0]

    models = make_models("pointnet_cls", 2, dropout=0.0)
    with pytest.raises(AssertionError, match=r"output structure differs"):
        check_equivalence(models, make_input("pointnet_cls", BATCH), fused=Untupled(models))
