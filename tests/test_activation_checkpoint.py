"""``hftc.fuse(models, checkpoint=k)``: activation checkpointing across the fused models.

The fused forward is cut into k segments, each recomputed in backward
(``torch.utils.checkpoint``, ``use_reentrant=False``). The values must not change:
forward, gradients and buffers against the plain loop over the models (float64 and
float32), and, with dropout (whose fused masks are not the loop's draws), bit for bit
against the same fused models without checkpointing from the same seed: a
recomputation that drew new masks would give other gradients. Fewer bytes are saved
for backward (counted with ``saved_tensors_hooks``), which is the point.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import check_equivalence
from real_style import GPT, GPTConfig
from test_zoo import _zoo_models
from zoo import make_input

import hftc
from hftc.errors import FusionArgumentError

SEGMENTS = [1, 2, 3, True, 1000]  # 1000: more than the ops, a cut wherever one is safe


class ConvBNNet(nn.Module):
    """pytorch/examples' MNIST net with a BatchNorm and ResNet's in-place ReLU."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(6, 8, 3)
        self.dropout1 = nn.Dropout(p)
        self.fc1 = nn.Linear(8 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout1(torch.flatten(x, 1))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class ResidualBlock(nn.Module):
    """torchvision's BasicBlock tail (``out += identity``, an in-place ReLU) after an
    in-place scale of a layer's output (which stays in place in the fused graph)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 6)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        identity = self.fc1(x)
        out = self.fc2(identity)
        out.mul_(0.5)
        out += identity
        out = self.relu(out)
        return self.head(out)


def _models(factory, n=3, seed=0):
    torch.manual_seed(seed)
    return [factory() for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("segments", SEGMENTS, ids=lambda s: f"checkpoint={s}")
def test_convnet_with_batchnorm_matches_the_loop(segments, dtype):
    """Outputs, every gradient and the BatchNorm statistics (updated once, not again by
    the recomputation) over two SGD steps, as the N models one by one."""
    x = torch.randn(5, 1, 8, 8)
    check_equivalence(_models(ConvBNNet), x, dtype=dtype, steps=2,
                      fuser=functools.partial(hftc.fuse, checkpoint=segments))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_zoo_resnet_matches_the_loop(dtype):
    """The zoo's ResNet (BasicBlocks, BatchNorms, residual adds) with about sqrt(#ops)
    segments."""
    check_equivalence(_zoo_models("resnet", 3, train=True), make_input("resnet", 4, seed=1),
                      dtype=dtype, steps=2, fuser=functools.partial(hftc.fuse, checkpoint=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("segments", [2, True], ids=lambda s: f"checkpoint={s}")
def test_nanogpt_matches_the_loop(segments, dtype):
    """nanoGPT (tied embedding, causal attention), traced by torch.export."""
    x = torch.randint(0, 17, (4, 8))
    check_equivalence(_models(GPT), x, dtype=dtype, steps=2, check_input_grads=False,
                      fuser=functools.partial(hftc.fuse, checkpoint=segments,
                                              example_inputs=(x,)))


def _step(fused, x, seed):
    torch.manual_seed(seed)
    out = fused(x)
    out = out[0] if isinstance(out, tuple) else out
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                          dtype=out.dtype)
    (out * weights).sum().backward()
    return out.detach(), {k: p.grad.clone() for k, p in fused.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(("factory", "x"), [
    (lambda: ConvBNNet(p=0.4), torch.randn(5, 1, 8, 8)),
    (lambda: GPT(GPTConfig(dropout=0.3)), torch.randint(0, 17, (4, 8))),
], ids=["convnet", "nanogpt"])
@pytest.mark.parametrize("segments", [2, True], ids=lambda s: f"checkpoint={s}")
def test_dropout_recomputed_with_the_forwards_masks(factory, x, segments, dtype):
    """With dropout: bit for bit the fused models without checkpointing, same seed; the
    dropout really drops (else the test could not fail)."""
    models = [m.to(dtype) for m in _models(factory)]
    x = x.to(dtype) if x.is_floating_point() else x
    fuse = functools.partial(hftc.fuse, example_inputs=(x,))
    plain = fuse(copy.deepcopy(models))
    ckpt = fuse(copy.deepcopy(models), checkpoint=segments)
    out, grads = _step(plain, x, seed=3)
    out_ckpt, grads_ckpt = _step(ckpt, x, seed=3)
    assert not torch.equal(out, _step(fuse(copy.deepcopy(models)), x, seed=4)[0])
    assert torch.equal(out, out_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for k in grads:
        assert torch.equal(grads[k], grads_ckpt[k]), k


def _saved_bytes(fused, x) -> int:
    """Bytes autograd keeps for backward during ``fused(x)`` (checkpointed segments keep
    their inputs only)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fused(x)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    return total


def test_checkpointing_keeps_fewer_activations():
    models = _models(lambda: GPT(GPTConfig(n_layer=4, n_embd=16, n_head=2)), n=4)
    x = torch.randint(0, 17, (8, 8))
    fuse = functools.partial(hftc.fuse, example_inputs=(x,))
    plain = _saved_bytes(fuse(copy.deepcopy(models)), x)
    ckpt = _saved_bytes(fuse(copy.deepcopy(models), checkpoint=True), x)
    assert ckpt < 0.6 * plain, (ckpt, plain)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_no_cut_before_an_in_place_op_on_an_earlier_value(dtype):
    """``out.mul_(0.5)`` of fc2's output: a cut between them would give the scale's segment
    fc2's output as input, scaled in place by the forward, so its recomputation would
    scale it twice; the plan keeps them in one segment."""
    x = torch.randn(5, 6)
    fused = check_equivalence(_models(ResidualBlock), x, dtype=dtype, steps=2,
                              fuser=functools.partial(hftc.fuse, checkpoint=1000))
    segments = [s.nodes for s in fused.last_program().forward.segments]
    assert len(segments) > 3
    scale = next(n for s in segments for n in s if n.target == "mul_")
    assert next(s for s in segments if scale in s)[0].args[0] is not scale.args[0]
    assert any(scale.args[0] in s and scale in s for s in segments)


def test_without_gradients_segments_run_directly():
    models = _models(ConvBNNet)
    x = torch.randn(5, 1, 8, 8)
    fused = hftc.fuse(copy.deepcopy(models), checkpoint=2).eval()
    plain = hftc.fuse(copy.deepcopy(models)).eval()
    with torch.no_grad():
        assert torch.equal(fused(x), plain(x))


@pytest.mark.parametrize("bad", [0, -2, 1.5, "yes", None])
def test_a_bad_checkpoint_option_is_refused(bad):
    with pytest.raises(FusionArgumentError, match=r"checkpoint must be False, True .* got"):
        hftc.fuse(_models(ConvBNNet), checkpoint=bad)


def test_a_segment_that_changes_its_input_in_place_is_refused(monkeypatch):
    """An in-place op the plan cannot see (here: the plan made blind to all of them) is
    caught on the forward that runs it, before a backward could recompute it wrongly."""
    from hftc.lowering import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "_mutated_argument", lambda node: None)
    fused = hftc.fuse(_models(ResidualBlock), checkpoint=1000)
    with pytest.raises(FusionArgumentError,
                       match=r"checkpoint segment \d+ \(nodes mul_ \.\.\. mul_\) changes "
                             r"`linear_1` in place, .* fuse with another number of segments"):
        fused(torch.randn(5, 6))


def test_autotune_keeps_the_fused_program_that_checkpointing_needs(tmp_path, monkeypatch):
    """autotune=True may run the N models one by one where that is faster (nothing to
    checkpoint then); with checkpoint= the whole-forward choice leaves that candidate out,
    times (and takes the memory of) the candidates checkpointed, and the checkpointed
    fused program runs, equal to the loop."""
    from hftc.lowering import autotune
    from hftc.lowering.checkpoint import CheckpointedForward

    timed = []
    run_step = autotune.run_tuning_step

    def spy(fused, program_forward, how, *args, **kwargs):
        timed.append(type(how.forward or program_forward))
        return run_step(fused, program_forward, how, *args, **kwargs)

    monkeypatch.setattr(autotune, "run_tuning_step", spy)
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))  # timed here, not found cached

    x = torch.randn(5, 1, 8, 8)
    fused = check_equivalence(_models(ConvBNNet), x, dtype=torch.float32, steps=2,
                              fuser=functools.partial(hftc.fuse, autotune=True,
                                                      checkpoint=2))
    program = fused.last_program()
    assert isinstance(program.forward, CheckpointedForward) and program.one_by_one is None
    whole = next(c for c in fused.fusion_report.lowerings if c.node == "<whole model>")
    assert not any(name.startswith("model_loop") for name in [*whole.times, *whole.rejected])
    assert timed and set(timed) == {CheckpointedForward}


def test_checkpoint_runs_the_fused_program_whatever_the_default_strategy(tmp_path, monkeypatch):
    # strategy="timed" may choose the models one by one, which leaves nothing checkpointed:
    # with checkpoint= the fused program runs, untimed; forcing the loop is refused.
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    models = _models(ConvBNNet)
    fused = hftc.fuse(copy.deepcopy(models), checkpoint=2, strategy="timed")
    x = torch.randn(4, 1, 8, 8)
    out = fused(x)
    assert fused.plan.chosen == "fused" and "checkpointed" in fused.plan.reason
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
    with pytest.raises(FusionArgumentError, match="strategy='model_loop' runs the models one "
                                                  "by one .*drop one of the two"):
        hftc.fuse(copy.deepcopy(models), checkpoint=True, strategy="model_loop")
