"""The export front-end exports one model per group of models that run the same program
(hftc/frontends/same_program.py) and reads the others' graphs off that program at their
own tensors.  Sound only where nothing else forward reads differs: each test here has
models whose forward reads something that differs between them (a Python attribute it
branches on or scales by, a tensor constant export bakes in, a parameter's value read on
the host, a per-instance lambda, a config object), and checks the fused module against
the plain loop over the models, and how many exports ran.
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
from hftc.errors import FusionWarning, MismatchError
from hftc.frontends.same_program import program_difference


@pytest.fixture
def exports(monkeypatch):
    """Counts the calls of torch.export.export (hftc's export front-end calls it by name)."""
    calls = []
    export = torch.export.export

    def counted(model, *args, **kwargs):
        calls.append(model)
        return export(model, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


class Block(nn.Module):
    """Python symbolic tracing cannot follow (a decision on a size), a batch norm (its
    buffers and their update), a tied weight, and what the subclasses read."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 4)
        self.back = nn.Linear(4, 6)
        self.back.weight = self.fc.weight
        self.scale = scale

    def forward(self, x):
        if x.shape[-1] > 1:  # symbolic tracing stops here: the export front-end is used
            x = x * 2
        h = F.relu(self.bn(self.fc(x) - self.back(x).flip(-1)))
        return self.out(h) * self.scale + self.extra(x)

    def extra(self, x):
        return 0.0


def _fuser(example):
    """check=False: the first-call check (models 0, N // 2 and N-1 against their own
    forward) would run the models one by one where a shared program were wrong for one of
    them; these tests check the sharing itself."""
    return lambda models, in_dims: hftc.fuse(models, in_dims=in_dims, example_inputs=example,
                                             check=False)


def test_alike_models_are_exported_once_per_mode(exports):
    """Four models of the same code and attributes (different weights): two exports (train
    and eval), not eight, and each model's own weights, buffers and gradients."""
    x = torch.randn(5, 4, dtype=torch.float64)
    models = [Block() for _ in range(4)]
    for train in (True, False):
        exports.clear()
        fused = check_equivalence(models, x, train=train, steps=2, fuser=_fuser((x,)))
        assert fused.frontend == "export"
        assert len(exports) == 2
        assert fused.fusion_report.fallbacks == [], str(fused.fusion_report)


def test_alike_models_float32():
    x = torch.randn(5, 4)
    check_equivalence([Block() for _ in range(3)], x, dtype=torch.float32, fuser=_fuser((x,)))


def test_a_python_attribute_forward_scales_by_is_each_models(exports):
    """``self.scale`` differs: export bakes it into the program, so the models with 2.0
    are exported apart from those with 0.5 (two groups: four exports) and keep theirs."""
    x = torch.randn(5, 4, dtype=torch.float64)
    models = [Block(0.5), Block(2.0), Block(0.5), Block(0.5)]
    fused = check_equivalence(models, x, fuser=_fuser((x,)))
    assert len(exports) == 4
    assert fused.frontend == "export"


class Residual(Block):
    """Branches on a plain attribute: another program where it differs."""

    def __init__(self, residual):
        super().__init__()
        self.residual = residual

    def extra(self, x):
        if self.residual:
            return F.pad(x, (0, 0))
        return 0.0


def test_a_python_branch_that_differs_is_refused_not_shared():
    """Model 1 adds its input, model 0 does not: different programs, refused (the graphs
    do not match), never model 0's program run on model 1's weights."""
    x = torch.randn(5, 4, dtype=torch.float64)
    models = [Residual(False).double(), Residual(True).double()]
    with pytest.raises(MismatchError, match="model 1"):
        hftc.fuse(models, example_inputs=(x,))
    # ... and models alike in it fuse, against the loop
    check_equivalence([Residual(True), Residual(True)], x, fuser=_fuser((x,)))


class TensorConstant(Block):
    """A plain tensor attribute read on the host: export bakes its value into the graph
    (``x * 3.0``, no tensor read at run time)."""

    def __init__(self, value):
        super().__init__()
        self.gain = torch.tensor(value, dtype=torch.float64)

    def extra(self, x):
        return x[:, :1] * self.gain.item()


def test_a_tensor_constant_baked_in_is_each_models(exports):
    x = torch.randn(5, 4, dtype=torch.float64)
    models = [TensorConstant(1.0), TensorConstant(3.0), TensorConstant(1.0)]
    check_equivalence(models, x, fuser=_fuser((x,)))
    assert len(exports) == 4  # two programs (1.0, 3.0), two modes


class ParameterOnHost(Block):
    """Reads a parameter's value on the host: export leaves ``aten.item`` (an unbacked
    symbol) in the program, which is then not reused for the other models."""

    def __init__(self, value):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(value))

    def extra(self, x):
        return x[:, :1] * self.gain.item()


def test_a_parameter_read_on_the_host_exports_each_model(exports):
    x = torch.randn(5, 4, dtype=torch.float64)
    models = [ParameterOnHost(1.0), ParameterOnHost(3.0), ParameterOnHost(-2.0)]
    with pytest.warns(FusionWarning, match=r"\.item\(\) of a per-model tensor"):
        fused = hftc.fuse(copy.deepcopy(models), example_inputs=(x.float(),))
    assert len(exports) == 6
    out = fused(x.float())
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model(x.float()))


class Lambda(Block):
    """A function made per instance in __init__ (as minGPT's ``self.mlpf``), closing over
    a plain value."""

    def __init__(self, k):
        super().__init__()
        self.mlpf = lambda t: F.gelu(t) * k

    def extra(self, x):
        return self.mlpf(x[:, :1])


def test_a_lambda_per_instance_compares_its_closure(exports):
    """Same code, equal cells: one program; a differing value is each model's own
    program, exported itself (each model's copy holds its own function: hftc.module.copies)."""
    x = torch.randn(5, 4, dtype=torch.float64)
    check_equivalence([Lambda(2.0), Lambda(2.0), Lambda(2.0)], x, fuser=_fuser((x,)))
    assert len(exports) == 2
    assert program_difference(Lambda(2.0), Lambda(2.0)) is None
    assert program_difference(Lambda(2.0), Lambda(-1.0)) == \
        "module `<root>`: attribute `mlpf` differs"
    exports.clear()
    models = [Lambda(2.0), Lambda(-1.0)]
    check_equivalence(models, x, fuser=_fuser((x,)))
    assert len(exports) == 4  # two models, two modes: each its own export


@dataclasses.dataclass
class Config:
    hidden: int = 6
    activation: str = "relu"
    layers: list = dataclasses.field(default_factory=lambda: [1, 2])


class Configured(Block):
    """transformers-style: forward reads a config object's fields."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def extra(self, x):
        act = torch.tanh if self.config.activation == "tanh" else torch.sigmoid
        return act(x[:, :1]) * len(self.config.layers)


def test_a_config_object_is_compared_field_by_field(exports):
    """Configs equal field by field (not the same object): one program.  A field forward
    branches on or counts with differs: model 0's program is not reused for those models,
    whose own graphs differ and are refused by name (model 3's count; model 2's activation,
    tanh against sigmoid, fuses: hftc/passes/differing_ops.py)."""
    x = torch.randn(5, 4, dtype=torch.float64)
    check_equivalence([Configured(Config()) for _ in range(3)], x, fuser=_fuser((x,)))
    assert len(exports) == 2
    models = [Configured(Config()), Configured(Config()), Configured(Config(activation="tanh")),
              Configured(Config(layers=[1, 2, 3]))]
    with pytest.raises(MismatchError, match=r"(?s)model 3 of 4.*argument 1: 3 vs 2"):
        hftc.fuse(models, example_inputs=(x.float(),))


def test_program_difference_names_what_differs():
    a, b = Block(), Block()
    assert program_difference(a, b) is None
    assert program_difference(a, Block(2.0)) == "module `<root>`: attribute `scale` differs"
    assert program_difference(a, b.double()) == \
        "module `fc`: `weight` differs in shape, dtype, device or strides"
    c = Block()
    c.back.weight = nn.Parameter(c.fc.weight.detach().clone())  # not tied
    assert program_difference(a, c) == "parameters or buffers are tied differently"
    d = Block()
    d.bn.momentum = 0.2
    assert program_difference(a, d) == "module `bn`: attribute `momentum` differs"
    e = Block()
    e.fc = nn.Linear(4, 6, bias=False)
    assert "module `fc`" in program_difference(a, e)
    f = Block()
    f.out = nn.Sequential(nn.Linear(6, 4))
    assert program_difference(a, f) == "the module trees differ (submodule paths or classes)"
    g, h = TensorConstant(1.0), TensorConstant(1.0)
    assert program_difference(g, h) is None
    h.gain = torch.tensor(-0.0, dtype=torch.float64)
    g.gain = torch.tensor(0.0, dtype=torch.float64)
    assert program_difference(g, h) == "module `<root>`: attribute `gain` differs"
    k, m = Block(float("nan")), Block(float("nan"))
    assert program_difference(k, m) is None
    n = Block()
    n.generator = torch.Generator()
    o = Block()
    o.generator = torch.Generator()
    assert program_difference(n, o) == "module `<root>`: attribute `generator` differs"
    p, q = Block(), Block()
    p.fc.weight.tag, q.fc.weight.tag = "a", "b"
    assert program_difference(p, q) == "module `fc`: `weight` has Python attributes that differ"


def test_transformers_t5_is_exported_once_per_mode(exports):
    """Hugging Face T5 (each model its own config object, equal field by field), relative
    position buckets, tied embeddings: two exports for three models, against the loop."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    def config():
        return transformers.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                     num_decoder_layers=1, num_heads=4, dropout_rate=0.0,
                                     use_cache=False, relative_attention_num_buckets=8)

    models = [transformers.T5ForConditionalGeneration(config()) for _ in range(3)]
    ids = torch.randint(0, 40, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    example = (ids, mask, ids[:, :4])  # forward(input_ids, attention_mask, decoder_input_ids)
    check_equivalence(models, example, fuser=_fuser(example))
    assert len(exports) == 2


def test_fuse_groups_exports_one_model_per_program(exports):
    """hftc.fuse_groups keys models by their graphs: one export for the models proved
    alike, not one each (two keys, then two exports per group: six, not eight)."""
    x = torch.randn(5, 4)
    models = [Residual(True), Residual(True), Residual(False), Residual(True)]
    groups = hftc.fuse_groups(models, example_inputs=(x,))
    assert [indices for _, indices in groups] == [[0, 1, 3], [2]]
    assert len(exports) == 6
    for fused, indices in groups:
        out = fused(x)
        for j, i in enumerate(indices):
            torch.testing.assert_close(out[j], models[i](x))


def test_program_difference_of_deeply_nested_attributes_is_a_difference():
    a, b = Block(), Block()
    a.nested, b.nested = [], []
    for _ in range(5000):  # deeper than Python's recursion limit
        a.nested, b.nested = [a.nested], [b.nested]
    assert program_difference(a, b) == "an attribute is nested too deeply to compare"
