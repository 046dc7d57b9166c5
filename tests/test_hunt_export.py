"""Real-style models through the tracing front-ends (symbolic and torch.export), found in
the export hunt.

- A forward that returns a buffer it updates in place (a step counter, an EMA that the
  caller logs) ran the models one by one with a FusionWarning blaming the user's
  forward: the first-call check restored the fused module's buffers before comparing,
  and the output it compared was a view of those very buffers, so it read the value from
  before the call.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from equivalence import check_equivalence

import hftc
from hftc.errors import FusionArgumentError, FusionWarning, TraceError

DTYPES = [torch.float64, torch.float32]


class StepCounted(nn.Module):
    """A model that counts its calls and keeps an EMA of its output (both buffers), and
    returns both so the training loop can log them (pytorch-lightning style metrics)."""

    def __init__(self, decay=0.9):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.decay = decay
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x):
        y = self.fc(x)
        self.steps += 1
        self.ema.mul_(self.decay).add_(y.detach().mean(0), alpha=1 - self.decay)
        return {"logits": y * self.steps, "steps": self.steps, "ema": self.ema}


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_returned_buffer_updated_in_forward_fuses(frontend, dtype, n):
    torch.manual_seed(n)
    models = [StepCounted(decay=0.5 + 0.1 * i) for i in range(n)]
    x = torch.randn(2, 4, dtype=dtype)
    example = (x,) if frontend == "export" else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionWarning)  # not "runs the models one by one"
        check_equivalence(models, x, dtype=dtype, steps=2, fuser=lambda ms, in_dims: hftc.fuse(
            ms, in_dims=in_dims, frontend=frontend, example_inputs=example))


class ObservedLinear(nn.Module):
    """A fake-quant style observer: the input is scaled by the running max seen so far,
    then the running max is assigned anew (``self.max_val = torch.maximum(...)``, as
    torch.ao's MinMaxObserver writes it) -- after the tensor backward saved was read."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("max_val", torch.ones(4))
        self.register_buffer("scale", torch.ones(3), persistent=False)

    def forward(self, x):
        y = self.fc(x / self.max_val) * self.scale
        self.max_val = torch.maximum(self.max_val, x.detach().abs().amax(0))
        self.scale = self.scale * 0.5 + y.detach().abs().mean(0)
        return y


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3])
def test_buffer_assigned_after_a_read_backward_saved(frontend, dtype, n):
    torch.manual_seed(n)
    models = [ObservedLinear() for _ in range(n)]
    x = 3 * torch.randn(2, 4, dtype=dtype)
    example = (x,) if frontend == "export" else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionWarning)
        fused = check_equivalence(models, x, dtype=dtype, steps=2, fuser=lambda ms, in_dims: (
            hftc.fuse(ms, in_dims=in_dims, frontend=frontend, example_inputs=example)))
    for i, model in enumerate(fused.unfuse()):
        torch.testing.assert_close(model.max_val, fused.max_val[i])


class NamespaceHead(nn.Module):
    """A head kept in a closure through a namespace object (configs that gather the
    layers a callback uses: ``ns = SimpleNamespace(proj=..., norm=...)``)."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        parts = SimpleNamespace(proj=self.proj, norm=self.norm, scale=scale)
        self.head_fn = lambda x: parts.norm(parts.proj(x)) * parts.scale

    def forward(self, x):
        return self.head_fn(x.relu())


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_modules_in_a_namespace_in_a_closure_are_each_copys_own(frontend, dtype, n):
    """Each copy hftc makes (the first-call check's, the models one by one's, unfuse()'s)
    called the *original* model's layers through the namespace the closure shares: the
    check then found the fused program "wrong" and ran those copies, whose outputs did not
    follow the fused parameters (training the fused module changed nothing)."""
    def built(i):  # (check_equivalence's copy.deepcopy would share the namespace)
        torch.manual_seed(10 * n + i)
        return NamespaceHead(scale=1.0 + i).to(dtype)

    models, refs = [built(i) for i in range(n)], [built(i) for i in range(n)]
    x = torch.randn(2, 4, dtype=dtype)
    example = (x,) if frontend == "export" else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionWarning)
        fused = hftc.fuse(models, frontend=frontend, example_inputs=example)
        out = fused(x)
    weights = torch.randn(n, 2, 3, dtype=dtype)
    (out * weights).sum().backward()
    for i, ref in enumerate(refs):
        want = ref(x)
        torch.testing.assert_close(out[i], want)
        (want * weights[i]).sum().backward()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(dict(fused.named_parameters())[name].grad[i], p.grad)
    with torch.no_grad():
        fused.proj.weight.add_(1.0)
    out = fused(x)
    for i, model in enumerate(fused.unfuse()):
        torch.testing.assert_close(model(x), out[i])
        assert model.head_fn.__closure__[0].cell_contents.proj is model.proj


def test_a_namespace_of_another_models_modules_is_refused():
    first = NamespaceHead()
    second = copy.deepcopy(first)  # its closure still holds first's namespace
    with pytest.raises(FusionArgumentError, match=r"model 1's `head_fn \(closure variable "
                                                  r"`parts`\)\.proj` .*model 0's `proj`"):
        hftc.fuse([first, second])


class DecayedStats(nn.Module):
    """A buffer assigned anew, then updated in place in the same forward (an EMA
    written as decay, then add_): the buffer must end up with both."""

    def __init__(self, decay=0.9):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.decay = decay
        self.register_buffer("running", torch.ones(3))

    def forward(self, x):
        y = self.fc(x)
        self.running = self.running * self.decay
        self.running.add_(y.detach().mean(0), alpha=1 - self.decay)
        return y * self.running


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("n", [1, 3])
def test_a_buffer_assigned_then_updated_in_place_keeps_both(frontend, check, n):
    """The symbolic front-end copied the new value into the buffer at the assignment,
    before the ``add_`` (which then wrote into the value only): with check=False a wrong
    buffer (and later outputs), with the check the models ran one by one."""
    torch.manual_seed(n)
    models = [DecayedStats(decay=0.5 + 0.2 * i) for i in range(n)]
    x = torch.randn(2, 4)
    example = (x.double(),) if frontend == "export" else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionWarning)
        check_equivalence(models, x, steps=3, fuser=lambda ms, in_dims: hftc.fuse(
            ms, in_dims=in_dims, frontend=frontend, example_inputs=example, check=check))


@dataclass
class CausalLMOutput:  # a ModelOutput-like class that is not registered with torch's pytree
    logits: torch.Tensor = None
    loss: torch.Tensor | None = None


class ReturnsOutputClass(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 5)

    def forward(self, x):
        if x.dim() == 2:  # (what symbolic tracing cannot follow: export is tried)
            x = x[:, None]
        return CausalLMOutput(logits=self.lm_head(x))


def test_an_unregistered_output_class_says_to_register_it():
    with pytest.raises(TraceError, match=r"register_dataclass\(TheClass\)"):
        hftc.fuse([ReturnsOutputClass(), ReturnsOutputClass()],
                  example_inputs=(torch.randn(2, 4),))


def test_a_deepcopied_closure_model_says_which_module_is_outside_it():
    copied = copy.deepcopy(NamespaceHead())  # its function calls the original's layers
    with pytest.raises(TraceError, match=r"head_fn.*not a submodule of the model.*"
                                         r"build each model with its constructor"):
        hftc.fuse([copied])


class ResetStatsThenNorm(nn.Module):
    """A batch norm's running mean assigned anew, then the norm called: the assignment
    must land before the module that reads the buffer (not moved past it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        self.bn.running_mean = self.bn.running_mean * 0.5
        return self.bn(self.fc(x))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("check", [True, False])
def test_an_assigned_buffer_is_written_before_its_module_reads_it(train, check):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionWarning)
        check_equivalence([ResetStatsThenNorm() for _ in range(2)], torch.randn(3, 4),
                          steps=2, train=train,
                          fuser=lambda ms, in_dims: hftc.fuse(ms, in_dims=in_dims, check=check))


class HolderAssign(nn.Module):
    """A buffer of a plain holder submodule (never called) assigned anew in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.stats = nn.Module()
        self.stats.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        y = self.fc(x)
        self.stats.seen = self.stats.seen + y.detach().mean(0)
        return y


@pytest.mark.parametrize("make", [HolderAssign, ResetStatsThenNorm])
@pytest.mark.parametrize("check", [True, False])
def test_an_assignment_export_leaves_out_is_refused(make, check):
    """torch.export's graph has no write of such a buffer: the fused models (check=False)
    left it as it was, where each model's own forward changes it."""
    with pytest.raises(TraceError, match=r"model 0 \(\w+\): forward assigns the buffer "
                                         r"`(stats\.seen|bn\.running_mean)` \(module path "
                                         r"`(stats|bn)`\).*copy_\(new_value\)"):
        hftc.fuse([make() for _ in range(2)], frontend="export", check=check,
                  example_inputs=(torch.randn(3, 4),))
