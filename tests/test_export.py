"""The torch.export front-end: models symbolic tracing rejects, fused through example_inputs.

Checks the normalisation (the same rules fire as for the symbolic front-end),
train/eval read at run time, a dynamic batch size, the guards on what export
baked in, dataclass outputs, and the errors.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import check_equivalence

import hftc
from hftc.errors import FusionArgumentError, TraceError

N = 3


class DataDependent(nn.Module):
    """Python that symbolic tracing cannot follow: branches on rank and on a size."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.0)
        self.fc = nn.Linear(4, 5)
        self.register_buffer("offset", torch.randn(5))

    def forward(self, x):
        if x.dim() == 3:  # an unbatched image
            x = x.unsqueeze(0)
        h = F.relu(self.bn(self.conv(x)))
        if h.shape[-1] > 2:
            h = F.max_pool2d(h, 2)
        h = self.drop(h.mean((2, 3)))
        return self.fc(h) + self.offset


def _export_fuser(example, **kwargs):
    return lambda models, in_dims: hftc.fuse(models, in_dims=in_dims, example_inputs=example,
                                             **kwargs)


def test_symbolic_tracing_rejects_it_without_example_inputs():
    with pytest.raises(TraceError, match=r"model 0 \(DataDependent\).*example_inputs"):
        hftc.fuse([DataDependent() for _ in range(N)])


def test_data_dependent_model_through_example_inputs():
    """Train and eval (export bakes the mode into ops: one graph per mode, picked at run
    time), two SGD steps, then another batch size through the same graphs."""
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    models = [DataDependent().double() for _ in range(N)]
    fused = hftc.fuse(models, example_inputs=(x,))
    for train in (True, False):
        checked = check_equivalence(models, x, train=train, steps=2,
                                    fused=copy.deepcopy(fused))
        report = checked.fusion_report
        assert report.fallbacks == [], str(report)
        counts = report.rule_counts()
        assert counts["fuse_conv"] == 1 and counts["fuse_batch_norm"] == 1
    # the example's batch size is not baked in
    y = torch.randn(7, 3, 8, 8, dtype=torch.float64)
    out = fused(y)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m.train()(y), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused.bn.running_mean[2], models[2].bn.running_mean)
    fused.eval()
    out = fused(y)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m.eval()(y), rtol=1e-10, atol=1e-10)


def test_export_front_end_matches_symbolic_rules_and_stacked_inputs():
    """A traceable model through export: the same fusion rules fire as for symbolic tracing."""
    model = lambda: nn.Sequential(  # noqa: E731
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 6),
        nn.LayerNorm(6), nn.GELU())
    models = [model() for _ in range(N)]
    xs = torch.randn(N, 2, 3, 8, 8, dtype=torch.float64)
    fused = check_equivalence(models, xs, in_dims=0,
                              fuser=_export_fuser((xs,), frontend="export"))
    names = set(fused.fusion_report.rule_counts())
    assert {"fuse_conv", "fuse_batch_norm", "fuse_linear",
            "fuse_layer_norm"} <= names
    assert fused.fusion_report.fallbacks == []


class FixedLength(nn.Module):
    """A model whose code fixes the sequence length (a positional table of 6)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(6, 4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x, scale=1.0):
        if x.shape[0] > 100:
            raise ValueError("too big")
        return self.fc(x + self.pos) * scale


def test_guards_on_what_export_baked_in():
    models = [FixedLength() for _ in range(N)]
    x = torch.randn(3, 6, 4)
    fused = hftc.fuse(models, example_inputs=(x, 2.0))
    assert fused(torch.randn(5, 6, 4), 2.0).shape == (N, 5, 6, 2)  # batch size is free
    with pytest.raises(FusionArgumentError, match=r"input `x` has shape \[5, 7, 4\].*\[\.\.100, 6, 4\]"):
        fused(torch.randn(5, 7, 4), 2.0)
    with pytest.raises(FusionArgumentError, match=r"input `scale` is 3.0.*with 2.0") as caught:
        fused(x, 3.0)
    assert "While executing" not in str(caught.value)  # without fx's debugging text
    with pytest.raises(FusionArgumentError, match=r"\[101, 6, 4\].*\[\.\.100, 6, 4\]"):
        fused(torch.randn(101, 6, 4), 2.0)  # the model's own `if` bounds the batch


def test_batch_of_one_is_specialised_and_exported_again():
    # Export fixes a size of 1: a call with another batch size was refused ("batch size
    # of at least 2"); the models are now exported again from that call's inputs.
    models = [FixedLength() for _ in range(N)]
    fused = hftc.fuse(models, example_inputs=(torch.randn(1, 6, 4),))
    x = torch.randn(4, 6, 4)
    out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
    # A size the model's code fixes is still refused, with the guard's message.
    with pytest.raises(FusionArgumentError, match=r"input `x` has shape \[4, 7, 4\]"):
        fused(torch.randn(4, 7, 4))


def test_export_error_names_the_model():
    with pytest.raises(TraceError, match=r"model 0 \(DataDependent\) cannot be traced by "
                                         r"torch.export"):
        hftc.fuse([DataDependent() for _ in range(N)], example_inputs=(torch.randn(2, 5),))


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    features: torch.Tensor
    note: str = "out"


# The harness (and torch.export) walk outputs with pytree: tell it about the dataclass.
torch.utils._pytree.register_dataclass(Out)


class WithDataclass(nn.Module):
    """A model returning a dataclass."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return Out(logits=self.fc(x), features=x * 2)


class WithDataclassUntraceable(WithDataclass):
    def forward(self, x):
        if x.dim() == 1:
            x = x.unsqueeze(0)
        return Out(self.fc(x), x * 2)


class ValueDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        if x.sum() > 0:  # on values: neither front-end can trace it
            x = -x
        return self.fc(x)


def test_value_dependent_python_says_what_to_do():
    # It advised torch.cond, whose exported graph (a higher-order op) hftc refuses; and
    # named no line of the model's code.
    with pytest.raises(TraceError, match=r"model 0 \(ValueDependent\).*at tests.test_export.py:"
                                         r"\d+ in forward: `if x.sum\(\) > 0.*torch.where") as caught:
        hftc.fuse([ValueDependent() for _ in range(N)], example_inputs=(torch.randn(2, 3),))
    assert "torch.cond" not in str(caught.value) and "TORCH_LOGS" not in str(caught.value)


class ShapeBranchWithParametrized(nn.Module):
    """A parametrized linear in a forward torch.fx cannot trace (a branch on the rank)."""

    def __init__(self, parametrization: str):
        super().__init__()
        wrap = getattr(torch.nn.utils.parametrizations, parametrization)
        self.fc = wrap(nn.Linear(3, 3))
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        if x.dim() == 1:
            x = x.unsqueeze(0)
        return self.out(torch.relu(self.fc(x)))


def test_exported_weight_norm_computes_the_weight_per_model():
    # Export inlines the parametrization: its ops on the stacked originals.
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    models = [ShapeBranchWithParametrized("weight_norm") for _ in range(N)]
    fused = check_equivalence(models, x, steps=2, fuser=_export_fuser((x.double(),)))
    assert any(r.node == "_weight_norm" for r in fused.fusion_report.fallbacks)


def test_exported_no_grad_block_says_what_to_do():
    # spectral_norm's power iteration runs under torch.no_grad(): export wraps it in a
    # higher-order op with a graph of its own, which the export front-end cannot fuse.
    with pytest.raises(TraceError, match=r"model 0 \(ShapeBranchWithParametrized\).*"
                                         r"higher-order op.*torch.fx"):
        hftc.fuse([ShapeBranchWithParametrized("spectral_norm") for _ in range(N)],
                  example_inputs=(torch.randn(4, 3),))


@pytest.mark.parametrize("cls", [WithDataclass, WithDataclassUntraceable])
def test_dataclass_outputs_keep_their_type(cls):
    x = torch.randn(4, 3)
    fused = check_equivalence([cls() for _ in range(N)], x,
                              fuser=_export_fuser((x.double(),)))
    out = fused(x.double())
    assert isinstance(out, Out)
    assert out.logits.shape == (N, 4, 2) and out.features.shape == (N, 4, 3)
    assert out.note == "out"


class SpatialTransformer(nn.Module):
    """The spatial transformer tutorial's sampling, and F.normalize / vector norms: under
    torch.export these became ATen ops (grid_sampler with integer modes,
    affine_grid_generator, linalg_vector_norm) that ran model by model."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.theta = nn.Parameter(torch.tensor([[1.0, 0, 0], [0, 1.0, 0]])
                                  + 0.1 * torch.randn(2, 3))

    def forward(self, x):
        h = self.conv(x)
        for mode in ("bilinear", "nearest"):
            grid = F.affine_grid(self.theta.expand(x.shape[0], 2, 3), x.size(),
                                 align_corners=False)
            h = F.grid_sample(h, grid, mode=mode, padding_mode="border", align_corners=False)
        return (F.normalize(h.flatten(1), dim=-1), torch.linalg.vector_norm(h),
                torch.linalg.vector_norm(h, 1, (1, 2)))


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_spatial_transformer_and_norms_fuse_in_both_front_ends(frontend):
    x = torch.randn(2, 2, 5, 5)
    models = [SpatialTransformer() for _ in range(3)]
    fused = check_equivalence(models, x,
                              fuser=_export_fuser((x.double(),), frontend=frontend))
    assert fused.fusion_report.fallbacks == []


class Norms(nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.ln = nn.LayerNorm(4, eps=eps)
        self.gn = nn.GroupNorm(2, 4, eps=eps)
        self.rms = nn.RMSNorm(4, eps=eps)

    def forward(self, x):
        return self.rms(self.ln(x)) + self.gn(x.unsqueeze(-1)).squeeze(-1)


def test_per_model_norm_eps_through_export():
    """LayerNorm / GroupNorm / RMSNorm eps may differ per model (documented); through the
    export front-end, where they are F.* calls, differing eps raised a MismatchError."""
    x = torch.randn(3, 4)
    fused = check_equivalence([Norms(eps) for eps in (1e-5, 1e-1, 1.0)], x,
                              fuser=_export_fuser((x.double(),), frontend="export"))
    assert fused.fusion_report.fallbacks == []


def test_cumulative_batch_norm_through_export_says_what_to_do():
    """torch.export cannot trace BatchNorm(momentum=None) (it reads num_batches_tracked as
    a number); the TraceError quoted torch's 'data-dependent expression u0' only."""
    class Cumulative(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)
            self.bn = nn.BatchNorm1d(6, momentum=None)

        def forward(self, x):
            return self.bn(self.fc(x))

    x = torch.randn(4, 4)
    with pytest.raises(TraceError, match="momentum=None.*without example_inputs"):
        hftc.fuse([Cumulative(), Cumulative()], frontend="export", example_inputs=(x,))


class InferenceModeTeacher(nn.Module):
    """A teacher under torch.inference_mode(), and a shape branch fx cannot follow."""

    def __init__(self):
        super().__init__()
        self.student, self.teacher = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 1
        with torch.inference_mode():
            target = self.teacher(x)
        return self.student(x) - target


def test_an_inference_mode_block_is_refused_by_the_export_front_end():
    # Non-strict export drops the block without a trace: the teacher got gradients and
    # trained, silently (the first-call check runs under no_grad and could not see it).
    with pytest.raises(TraceError, match=r"model 0 \(InferenceModeTeacher\).*"
                                         r"torch.inference_mode\(\).*detach"):
        hftc.fuse([InferenceModeTeacher() for _ in range(N)],
                  example_inputs=(torch.randn(4, 3),))


class ShapeBranchBatchNorm(nn.Module):
    """A batch norm whose momentum and eps a sweep varies, in a forward fx cannot follow."""

    def __init__(self, momentum: float, eps: float):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4, momentum=momentum, eps=eps)

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 1
        return self.bn(self.fc(x))


def test_exported_batch_norms_with_a_momentum_and_eps_per_model():
    # torch.export's graph holds F.batch_norm, whose momentum and eps were compared as
    # structure: models that fuse symbolically were refused with a MismatchError.
    x = torch.randn(6, 3)
    models = [ShapeBranchBatchNorm(m, e) for m, e in [(0.1, 1e-5), (0.3, 1e-3), (0.5, 1e-5)]]
    check_equivalence(models, x, steps=2, fuser=_export_fuser((x.double(),)))


class ShapeBranchActivation(nn.Module):
    def __init__(self, kind: str, value: float):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.act = nn.LeakyReLU(value) if kind == "leaky_relu" else (
            nn.ELU(value) if kind == "elu" else nn.CELU(value))

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 1
        return self.act(self.fc(x) - 0.3)


@pytest.mark.parametrize("kind,default", [("leaky_relu", 0.01), ("elu", 1.0)])
def test_exported_activations_whose_model_0_has_the_default_value(kind, default):
    # ATen leaves an argument at its default out of the exported call: model 0's
    # (x,) against the others' (x, value) was refused as a structural difference.
    x = torch.randn(6, 3)
    models = [ShapeBranchActivation(kind, v) for v in (default, 2 * default, 3 * default)]
    check_equivalence(models, x, steps=2, fuser=_export_fuser((x.double(),)))


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, *xs):
        if xs[0].shape[0] > 1:
            return self.fc(xs[0] + xs[1])
        return self.fc(xs[0])


def test_a_forward_with_varargs_exports():
    # The dynamic-shapes spec had one entry per input where torch matches forward's
    # signature (one entry, the tuple xs): "inputs has 1 elements, but dynamic_shapes
    # has 2".
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    check_equivalence([VarArgs() for _ in range(N)], (x, y), steps=2,
                      fuser=_export_fuser((x.double(), y.double())))


class TwoInputs(nn.Module):
    """Two inputs of one shape, in a forward symbolic tracing rejects (a branch on rank)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, a, b):
        if a.dim() == 1:
            a, b = a.unsqueeze(0), b.unsqueeze(0)
        return self.fc(a) * 2 + self.fc(b)


def _twice(kind):
    """Example inputs that pass one tensor twice, in the two ways users write it."""
    if kind == "same":
        z = torch.zeros(5, 4, dtype=torch.float64)
        return (z, z)
    return (torch.zeros(5, 4, dtype=torch.float64),) * 2


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("kind", ["same", "tuple_times_two"])
def test_a_tensor_passed_twice_in_example_inputs_is_two_inputs(kind, check):
    # torch.export gave the twice-passed tensor one value: every op read input 2, so the
    # program computed forward(b, b) for every later call forward(a, b), and the
    # first-call check passed because it ran on the example.
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    check_equivalence([TwoInputs() for _ in range(N)], (a, b), steps=2,
                      fuser=_export_fuser(_twice(kind), check=check))


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("kind", ["same", "tuple_times_two"])
def test_nanogpt_with_the_token_ids_passed_as_targets_in_the_example(kind, check):
    """nanoGPT's ``forward(idx, targets)`` through the default front-end (its ``assert t <=
    block_size`` sends it to torch.export) with ``example_inputs=(idx, idx)``: the fused
    model trained on the token ids as targets.  Logits, loss and gradients now equal the
    loop's, for targets that are not the ids."""
    from real_style import GPT

    torch.manual_seed(0)
    models = [GPT() for _ in range(N)]
    idx = torch.randint(0, 17, (4, 8))
    example = (idx, idx) if kind == "same" else (torch.zeros(4, 8, dtype=torch.long),) * 2
    targets = torch.randint(0, 17, (4, 8))
    fused = check_equivalence(models, (idx, targets), steps=2,
                              fuser=_export_fuser(example, check=check))
    assert fused.last_program().one_by_one is None


def _converted(op, args: tuple, kwargs: dict):
    """The node the rules' converter for ATen op ``op`` emits for ``op(*args, **kwargs)``
    (placeholders stand for the tensors)."""
    import torch.fx as fx

    from hftc.frontends.export import Emitter
    from hftc.passes.registry import aten_spellings

    graph = fx.Graph()
    tensors = {name: graph.placeholder(name) for name in ("x", "y")}
    args = tuple(tensors.get(a, a) if isinstance(a, str) else a for a in args)
    kwargs = {k: tensors.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    source = graph.call_function(op, args, kwargs)
    return aten_spellings()[op.overloadpacket](Emitter(graph, source), args, kwargs), tensors


@pytest.mark.parametrize("op, args, kwargs, target, expected", [
    (torch.ops.aten.embedding.default, ("x", "y"), {"padding_idx": 0, "sparse": False},
     F.embedding, ("y", "x", 0, None, 2.0, False, False)),
    (torch.ops.aten.constant_pad_nd.default, ("x",), {"pad": [1, 1], "value": 2.0},
     F.pad, ("x", [1, 1], "constant", 2.0)),
    (torch.ops.aten.grid_sampler.default, ("x", "y"),
     {"interpolation_mode": 1, "padding_mode": 2, "align_corners": True},
     F.grid_sample, ("x", "y", "nearest", "reflection", True)),
    (torch.ops.aten.dropout_.default, ("x",), {"p": 0.25, "train": True},
     F.dropout, ("x", 0.25, True, True)),
    (torch.ops.aten.nll_loss_nd.default, ("x", "y"), {"ignore_index": 3},
     F.nll_loss, ("x", "y")),
])
def test_aten_converters_bind_the_exported_arguments_by_name(op, args, kwargs, target, expected):
    """An ATen op's arguments given by keyword reach the rule's spelling: the converters
    bind by the op's schema (padding_idx, the pad value were dropped, grid_sampler's and
    dropout_'s keywords failed to unpack)."""
    node, tensors = _converted(op, args, kwargs)
    assert node.target is target
    assert node.args == tuple(tensors.get(a, a) if isinstance(a, str) else a for a in expected)
    if target is F.nll_loss:
        assert node.kwargs == {"weight": None, "reduction": "mean", "ignore_index": 3}
