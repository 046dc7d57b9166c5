"""Every failure the fuzzer found, kept as a regression test (see tests/test_fuzz.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from equivalence import check_equivalence
from test_fuzz import check_spec, random_lowerings
from torch import nn

import hftc

REGRESSIONS = [
    # A shared-input 3x3 conv lowered as im2col + one GEMM (channels-last output) inside a
    # residual block followed by a batch norm gave wrong weight gradients; that lowering
    # is no longer dispatched.
    ({"family": "image", "input": (1, 1, 4, 4),
      "layers": [("act", "relu", 1), ("residual", 1, "relu"), ("batch", 1, False)],
      "head": ("view", 16, 2, 1, "relu")}, 2, False, False),
    # A conv1d after a transpose with T == 1: the folded input was contiguous with odd
    # size-1 strides, which ATen took for channels-last and whose CPU conv backward failed
    # ("slow_conv2d: grad_weight must be contiguous").  Fixed by restriding canonically.
    ({"family": "sequence", "input": (1, 1, 2),
      "layers": [("seq_residual", 2), ("conv1d", 2, 3)], "head": ("seq", 2, 1, "mean")},
     2, False, False),
    # Norms of a single value: torch itself refuses them; the generator now avoids them,
    # and the fused module must run what the originals run around them.
    ({"family": "image", "input": (1, 2, 4, 4),
      "layers": [("conv", 2, 1, 1, 2, 0, 1, "zeros", False), ("pool", "max")],
      "head": ("view", 1, 2, 1, "relu")}, 1, False, False),
]


@pytest.mark.parametrize(("spec", "n", "stacked", "train"), REGRESSIONS)
def test_fuzz_regression(spec, n, stacked, train):
    check_spec(spec, n, stacked, train, seed=0)


def test_group_norm_on_the_inputs_is_never_run_channels_last(tmp_path, monkeypatch):
    # Found with random lowerings: a group norm on the (stacked) inputs, tried by autotune
    # as the models one by one with channels-last inputs.  torch's CPU group-norm backward
    # crashes the process on a channels-last input that needs no gradient of its own;
    # a model with a group norm now keeps its inputs as given on the CPU (layout.safe).
    from hftc.lowering import timing

    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))  # every candidate runs: no cache
    monkeypatch.setattr(timing, "_MEMORY", {})
    spec = {"family": "image", "input": (1, 3, 5, 5),
            "layers": [("group", 3, 3), ("pool", "adaptive"), ("act", "tanh", 3)],
            "head": ("mean", 3, 8, 3, "gelu")}
    check_spec(spec, 3, True, True, seed=4662, fuser=functools.partial(hftc.fuse, autotune=True))


def test_strided_1x1_conv_over_few_channels_is_never_run_channels_last(tmp_path, monkeypatch):
    # Found fuzzing in float32 with random lowerings: the process died ("Aborted",
    # "Segmentation fault") in autotune's models one by one with channels-last inputs.
    # oneDNN's 1x1 conv with a stride over < 16 input channels (here 4 -> 3, stride 2,
    # after a reflect pad) writes past its workspace on channels-last inputs and gets the
    # weight gradient wrong (uxlfoundation/oneDNN#6035): such a model keeps its inputs as
    # given on the CPU (layout.safe), and conv.conv runs such a conv on contiguous maps.
    from fuzz_models import FuzzNet

    from hftc.lowering import timing

    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))  # every candidate runs: no cache
    monkeypatch.setattr(timing, "_MEMORY", {})
    spec = {"family": "image", "input": (3, 4, 8, 8),
            "layers": [("dropout",), ("dropout",), ("conv", 4, 3, 1, 2, 1, 1, "reflect", False),
                       ("conv", 3, 1, 2, 2, 1, 1, "zeros", False)],
            "head": ("adaptive", 1, 5, 3, "prelu")}
    fuser = functools.partial(hftc.fuse, autotune=True)
    check_spec(spec, 3, False, True, seed=627, fuser=fuser, dtype=torch.float32)
    torch.manual_seed(627)
    fused = fuser([FuzzNet(spec) for _ in range(3)])
    fused(torch.randn(spec["input"])).sum().backward()
    choice = fused.fusion_report.lowerings[-1]
    assert choice.node == "<whole model>"
    assert not any("channels_last" in name for name in set(choice.times) | set(choice.rejected))


class _Picks:
    """The lowerings random_lowerings takes, in the order it asks for them."""

    def __init__(self, names):
        self.names = list(names)

    def choice(self, options):
        want = self.names.pop(0)
        return next(o for o in options if (o if isinstance(o, str) else o.name) == want)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_batch_norm_of_one_sample_before_a_channels_last_conv(train, tmp_path, monkeypatch):
    # Found with random lowerings (eval): a batch norm of one sample, then a conv lowered as
    # a channels-last grouped conv.  The input gradient reached ATen's CPU batch-norm
    # backward channels-last with an odd batch stride (B = 1), for which it returns wrong
    # gradients (torch 2.13); unfold_channels now restrides the gradient first.
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    spec = {"family": "image", "input": (1, 2, 4, 4),
            "layers": [("batch", 2, False), ("conv", 2, 1, 1, 1, 1, 1, "zeros", False)],
            "head": ("view", 36, 2, 1, "relu")}
    with random_lowerings(_Picks(["grouped_channels_last", "baddbmm", "baddbmm", "fused"])):
        check_spec(spec, 2, False, train, seed=0,
                   fuser=functools.partial(hftc.fuse, autotune=True))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_instance_norm_of_one_sample_before_a_channels_last_conv(train, tmp_path, monkeypatch):
    # Found with random lowerings (eval): an instance norm of one sample, then a conv
    # lowered channels-last.  ATen's instance_norm hands its batch_norm the gradient
    # through a view with an odd batch stride, and batch_norm's CPU backward got the
    # input gradients wrong; hftc's fused instance norm of one sample now calls that
    # batch_norm itself, and its gradient is restrided (norms.instance_norm).
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    spec = {"family": "image", "input": (1, 2, 4, 4),
            "layers": [("batch", 2, False), ("conv", 2, 1, 1, 2, 0, 1, "zeros", False),
                       ("instance", 1, False), ("conv", 1, 1, 1, 1, 1, 1, "zeros", False)],
            "head": ("view", 16, 2, 1, "relu")}
    picks = ["grouped", "grouped_channels_last", "baddbmm_t", "baddbmm_t", "fused"]
    with random_lowerings(_Picks(picks)):
        check_spec(spec, 2, False, train, seed=0,
                   fuser=functools.partial(hftc.fuse, autotune=True))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("unbatched", [False, True], ids=["batch_of_one", "unbatched"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("track", [False, True], ids=["input_stats", "tracked"])
def test_instance_norm_of_one_sample_matches_the_loop(track, affine, unbatched, train):
    # The one-sample path of norms.instance_norm (batch_norm called directly), with
    # running statistics, affine parameters and unbatched inputs.
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(2, 3, 3, padding=1),
                            nn.InstanceNorm2d(3, affine=affine, track_running_stats=track),
                            nn.Conv2d(3, 2, 1)) for _ in range(2)]
    x = torch.randn(2, 5, 5) if unbatched else torch.randn(1, 2, 5, 5)
    check_equivalence(models, x, train=train, steps=2 if train else 1)


class _LinearThenInPlace(nn.Module):
    """pytorch/examples style: a linear, then an activation in place on its output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        h = self.fc(x)
        h.relu_()
        return self.out(h)


@pytest.mark.parametrize("shape", [(2, 1, 4), (2, 1, 1, 4)], ids=["one_row", "one_row_3d"])
def test_in_place_op_on_a_fused_linear_of_one_row(shape):
    # Found by the families fuzzer (a linear with `h.relu_()`, stacked input, batch and time
    # 1): the transposed product's `[N, out, 1]` result, transposed back, is contiguous
    # already, so `.contiguous()` returned _BatchedLinear's output as a view, which autograd
    # refuses to modify in place ("a view created inside a custom Function").
    check_equivalence([_LinearThenInPlace() for _ in range(2)], torch.randn(shape), in_dims=0)


class _MaxOverTimeThenInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.conv(x).max(2)[0]
        h.mul_(2.0)
        return self.fc(h)


@pytest.mark.parametrize("in_dims", [None, 0], ids=["shared", "stacked"])
def test_in_place_op_on_a_fused_reduction_of_a_permuted_map(in_dims):
    # Found with in-place ops in the fuzzer: a max over a fused conv's output (a permuted
    # view of [B, N*C, L] memory) reduces in memory order and returned _ContiguousGradient's
    # `view_as` of its input, which autograd refuses to modify in place.
    x = torch.randn((2, 5, 3, 8) if in_dims == 0 else (5, 3, 8))
    check_equivalence([_MaxOverTimeThenInPlace() for _ in range(2)], x, in_dims=in_dims)


def test_a_no_grad_block_is_one_node_pair_in_a_group_traced_once():
    # The fuzzer (make fuzz): eight token models whose dropout p differs per model but
    # is 0.9 in models 6 and 7 (one group, traced once for both, under the torch function
    # mode that watches forward for reads of model values), and a layer that updates a
    # buffer under `with torch.no_grad():`.  Through the mode, torch._C._set_grad_enabled
    # came back to hftc's recording wrapper a second time: models 6 and 7's graph had
    # every grad-mode switch twice, and fusing refused them as not identical to model 0.
    from test_fuzz_families import check_family

    spec = {"family": "tokens", "vocab": 3, "d": 4, "batch": 1, "time": 1,
            "padding_idx": None, "context": False, "per_model": True, "output": "dict",
            "layers": [("dropout", 0.3), ("ema", 4, True)], "head": (4, 1)}
    for train in (False, True):
        check_family(spec, 8, (False, False), train, seed=0)
