"""hftc on a CUDA GPU: every lowering and the fused zoo against the loop, on the device.

The CPU suite checks the same rules on the CPU; here the kernels are cuDNN's and
cuBLAS's. TF32 is switched off for these tests (``allow_tf32``): with it a grouped
convolution and N separate ones round differently at 1e-3, which would hide a real
fusion error behind the tolerance. Skipped where no CUDA device is present.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import check_equivalence, relu_margin
from test_lowerings import CONVS, LINEARS, _check_every_lowering
from test_zoo import _zoo_models
from zoo import make_input

import hftc
from hftc.lowering import timing
from hftc.lowering.runtime import conv as rt_conv
from hftc.lowering.runtime import linear as rt_linear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.float64, torch.float32]
ZOO_CASES = ["mlp", "lenet5_cifar", "resnet", "mobilenet_v2", "pointnet_cls",
             "dcgan_generator", "residual_mlp"]


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


#: (kernel, layer, N, batch): every conv and linear layer of the CPU lowering tests.
LAYERS = [(rt_conv.conv, layer, 3, 2) for layer in CONVS] + [
    (rt_linear.linear, layer, 4, 5) for layer in LINEARS]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_batched", [True, False], ids=["batched", "shared"])
@pytest.mark.parametrize(("kernel", "layer", "n", "batch"), LAYERS,
                         ids=[f"{k.__name__}-{c[0].__name__}{c[1]}" for k, c, _, _ in LAYERS])
def test_every_lowering_on_cuda(kernel, layer, n, batch, x_batched, dtype):
    cls, kwargs, shape = layer
    _check_every_lowering(kernel, cls, kwargs, shape, n, x_batched, batch, dtype, "cuda")


#: The zoo ResNet's convs (tests/zoo.py ``resnet_small``: widths 8, 16, 32 on 32x32
#: maps) at N = 3 and batch 8, the shapes autotune times in the test below.
RESNET_CONVS = [
    (nn.Conv2d, dict(in_channels=3, out_channels=8, kernel_size=3, padding=1, bias=False),
     (3, 32, 32)),
    (nn.Conv2d, dict(in_channels=8, out_channels=8, kernel_size=3, padding=1, bias=False),
     (8, 32, 32)),
    (nn.Conv2d, dict(in_channels=8, out_channels=16, kernel_size=3, stride=2, padding=1,
                     bias=False), (8, 32, 32)),
    (nn.Conv2d, dict(in_channels=8, out_channels=16, kernel_size=1, stride=2, bias=False),
     (8, 32, 32)),
    (nn.Conv2d, dict(in_channels=32, out_channels=32, kernel_size=3, padding=1, bias=False),
     (32, 8, 8)),
]


@pytest.mark.parametrize("x_batched", [True, False], ids=["batched", "shared"])
@pytest.mark.parametrize("layer", RESNET_CONVS, ids=lambda c: "{in_channels}-{out_channels}-k"
                         "{kernel_size}".format(**c[1]) if isinstance(c, tuple) else str(c))
def test_every_conv_lowering_at_the_zoo_resnets_shapes(layer, x_batched):
    cls, kwargs, shape = layer
    _check_every_lowering(rt_conv.conv, cls, kwargs, shape, 3, x_batched, 8, torch.float32,
                          "cuda")


#: PointNet is checked in float64 only, as on the CPU: in float32 its max-pool over
#: points turns rounding into a different argmax. On an H100 (torch 2.11) the fused
#: gradients sat 1.1-2.8x over the 1e-5 tolerance after one step (the T-Net's
#: ``fc1.bias``, whose true gradient is zero under the batch norm, is pure noise), and
#: after an SGD step a flipped maximum made model 1's gradients differ by O(1).
GRID = [(name, dtype) for name in ZOO_CASES for dtype in DTYPES
        if (name, dtype) != ("pointnet_cls", torch.float32)]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("n", [2, 5])
@pytest.mark.parametrize(("name", "dtype"), GRID, ids=[f"{m}-{d}" for m, d in GRID])
def test_zoo_on_cuda(name, dtype, n, train):
    # As on the CPU: randomized norm statistics, and dropout off in train mode (hftc
    # draws every model's mask from one generator, so masks differ from the loop's).
    models = [m.cuda() for m in _zoo_models(name, n, train)]
    fused = check_equivalence(models, make_input(name, 4, seed=0).cuda(), train=train,
                              dtype=dtype, steps=2)
    assert all(p.is_cuda for p in fused.parameters())


#: An input seed per workload whose ReLU inputs all sit well away from zero (relu_margin):
#: seed 0 put one of ResNet's 5e-8 from it at batch 8, and float32's rounding flipped that
#: ReLU's gradient in the fused program, not in the loop (on the CPU and an H200 alike).
AUTOTUNE_SEEDS = {"lenet5_cifar": 37, "resnet": 38, "mlp": 38}


@pytest.mark.parametrize("name", ["lenet5_cifar", "resnet", "mlp"])
def test_autotune_on_cuda_times_on_the_gpu_and_stays_equivalent(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "_MEMORY", {})
    models = [m.cuda() for m in _zoo_models(name, 3, train=True)]
    x = make_input(name, 8, seed=AUTOTUNE_SEEDS[name]).cuda()
    assert relu_margin(models, x) > 4e-6  # else pick another seed: see AUTOTUNE_SEEDS
    made = []

    def fuser(ms, **kwargs):
        made.append(hftc.fuse(ms, autotune=True, **kwargs))
        return made[-1]

    try:  # one step: after an update the margins are other ones
        fused = check_equivalence(models, x, steps=1, dtype=torch.float32, fuser=fuser)
    except AssertionError as error:  # name what autotune chose
        report = made[-1].fusion_report if made else None
        raise AssertionError(f"{error}\nautotune chose: "
                             f"{report.lowerings if report else '?'}") from None
    choices = fused.fusion_report.lowerings
    assert choices and all(c.chosen in c.times or c.cached for c in choices)
    # The cache is per device: the GPU's name is in every key.
    assert torch.cuda.get_device_name() in (tmp_path / "autotune.json").read_text()


def test_a_fused_training_step_never_waits_for_the_gpu():
    # As in a stock loop, the CPU queues the next ops while the GPU works: no op of the
    # fused forward (per-model dropout rates), loss, backward or Adam step (per-model
    # learning rates) synchronizes with the device. A host-to-device copy of per-model
    # values from pageable memory would (sync debug mode "error" raises on it).
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 10))
              for p in (0.1, 0.2, 0.3)]
    fused = hftc.fuse([m.cuda() for m in models])
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-3, 2e-3, 4e-3])
    x, y = torch.randn(8, 64, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    loss_fn = hftc.per_model(F.cross_entropy)

    def step():
        opt.zero_grad()
        loss_fn(fused(x), y).sum().backward()
        opt.step()

    step()  # the first builds the optimizer state
    before = [p.detach().clone() for p in fused.parameters()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(not torch.equal(a, p) for a, p in zip(before, fused.parameters()))


def test_per_model_values_are_made_once_on_the_gpu():
    # A per-model eps or dropout rate was copied host-to-device on every call: a copy a
    # CUDA graph (hftc.compile_step) cannot replay; now one device tensor serves each call.
    from hftc.lowering.runtime.per_model import values_on

    a = values_on([0.1, 0.2, 0.3], torch.float32, torch.device("cuda"))
    b = values_on([0.1, 0.2, 0.3], torch.float32, torch.device("cuda"))
    assert a is b and a.device.type == "cuda"
    torch.testing.assert_close(a.cpu(), torch.tensor([0.1, 0.2, 0.3]), rtol=0, atol=0)
    assert values_on([0.1, 0.2, 0.3], torch.float64, torch.device("cuda")) is not a
    models = [nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-5 * (i + 1)))
              for i in range(3)]
    fused = hftc.fuse([m.cuda() for m in models])
    x = torch.randn(4, 8, device="cuda")
    fused(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fused(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["resnet", "mlp", "lenet5_cifar"])
def test_checkpointed_zoo_on_cuda(name, dtype):
    """``hftc.fuse(checkpoint=True)`` on the device: the loop's outputs, gradients and
    BatchNorm statistics (the recomputation does not update them again)."""
    models = [m.cuda() for m in _zoo_models(name, 3, train=True)]
    # seed 1: with seed 0 ResNet's float32 gradients (batch norm over 4 samples) are
    # ill-conditioned, the fused models' 1e-2 away from the loop's with or without
    # checkpointing (measured on the CPU).
    check_equivalence(models, make_input(name, 4, seed=1).cuda(), dtype=dtype, steps=2,
                      fuser=functools.partial(hftc.fuse, checkpoint=True))


def _peak_step(fused, x, seed):
    torch.manual_seed(seed)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fused(x)
    out.square().sum().backward()
    torch.cuda.synchronize()
    grads = {k: p.grad.clone() for k, p in fused.named_parameters()}
    return out.detach(), grads, torch.cuda.max_memory_allocated() - start


def test_checkpointing_on_cuda_redraws_the_forwards_dropout_masks_in_less_memory():
    """CUDA's dropout under checkpoint: the recomputation replays the forward's masks (the
    checkpoint restores the device's RNG state), bit for bit the unchecheckpointed fused
    models from the same seed, with a lower peak of device memory."""
    torch.manual_seed(0)
    models = [nn.Sequential(*[layer for _ in range(6) for layer in
                              (nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.2))],
                            nn.Linear(256, 10)).cuda() for _ in range(4)]
    x = torch.randn(512, 256, device="cuda")
    plain = hftc.fuse([copy.deepcopy(m) for m in models])
    ckpt = hftc.fuse([copy.deepcopy(m) for m in models], checkpoint=True)
    out, grads, plain_peak = _peak_step(plain, x, seed=5)
    out_ckpt, grads_ckpt, ckpt_peak = _peak_step(ckpt, x, seed=5)
    assert torch.equal(out, out_ckpt)
    for k in grads:
        assert torch.equal(grads[k], grads_ckpt[k]), k
    assert not torch.equal(out, _peak_step(plain, x, seed=6)[0])  # dropout drops
    assert ckpt_peak < 0.7 * plain_peak, (ckpt_peak, plain_peak)


def test_refreshed_optimizer_coefficients_do_not_write_into_shared_values():
    # values_on's GPU tensors are shared by every caller with the same values; a capturable
    # optimizer's refresh_hyperparameters() writes into its coefficient tensors in place,
    # so those must be its own: else a later lookup of the old values reads the new ones.
    from hftc.lowering.runtime.per_model import values_on
    from hftc.optim.optimizer import Coefficients

    like = torch.zeros(3, 2, device="cuda")
    coefficients = Coefficients({"lr": [0.1, 0.2, 0.3]}, persistent=True)
    coefficients("lr", like)
    coefficients.assign({"lr": [1.0, 2.0, 3.0]})
    torch.testing.assert_close(coefficients("lr", like).flatten().cpu(),
                               torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(values_on([[0.1, 0.2, 0.3]], torch.float32,
                                         torch.device("cuda")).cpu(),
                               torch.tensor([[0.1, 0.2, 0.3]]))
