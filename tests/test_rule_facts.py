"""What the pipeline knows about an op is declared on its ``@rule`` (hftc/passes/registry.py),
and only there: what it computes over a padded dim (``padding=``, ``pad_widths=True``), how a
padded model pads its module (``widens=``), whether a CPU program may run channels-last
with it (``channels_last=``), its link in a linear chain (``chain=``) and the elementwise op
that may differ per model (``differing_op=``).  Each fact declared on a new rule takes
effect with nothing else changed, and the tables the rest of the pipeline reads are the
rules' declarations.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn

import hftc
from hftc.errors import MismatchError, UnsupportedOperatorError
from hftc.lowering import chains, layout
from hftc.lowering.runtime import differing_ops as rt_differing_ops
from hftc.passes import differing_ops, registry
from hftc.passes import padded as padded_modules
from hftc.passes.registry import (
    EXACT,
    RULES,
    DifferingOp,
    Widens,
    rule,
    runs_one_by_one,
)
from tests.optim_helpers import single_thread  # noqa: F401  (fixture)


@contextlib.contextmanager
def declared(*keys, **facts):
    """A rule for ``keys`` (the one-by-one fallback) with ``facts``, for the test's length."""
    saved = {key: RULES.pop(key) for key in keys if key in RULES}
    try:
        rule(*keys, name="test_rule_facts", **facts)(runs_one_by_one)
        yield
    finally:
        for key in keys:
            RULES.pop(key, None)
        RULES.update(saved)


class ExpitOverHidden(nn.Module):
    """An op no rule knows (``torch.special.expit``) on a padded dim, summed over it."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(4, hidden)

    def forward(self, x):
        return torch.special.expit(self.fc(x)).sum(-1)


def test_an_op_is_computed_over_a_padded_dim_as_its_rule_declares(single_thread):  # noqa: F811
    """``torch.special.expit`` over padded hidden units: refused, naming it, while no rule
    says what it computes there; exact once a rule declares ``padding=EXACT`` (the sum
    after it counts the real units only: padded ones are expit(0) = 0.5)."""
    torch.manual_seed(0)
    models = [ExpitOverHidden(h) for h in (3, 5)]
    x = torch.randn(6, 4)
    key = ("call_function", torch.special.expit)
    assert key not in RULES
    with pytest.raises(UnsupportedOperatorError, match=r"cannot compute `special_expit`"):
        hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    with declared(key, padding=EXACT):
        fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
        out = fused(x)
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model(x), rtol=1e-6, atol=1e-6)


def test_a_padding_fact_is_a_known_kind():
    with pytest.raises(TypeError, match=r"padding='elementwise' is none of"):
        rule(("call_function", torch.special.expit), padding="elementwise")(runs_one_by_one)
    assert ("call_function", torch.special.expit) not in RULES


class Scaled(nn.Module):
    """A module with one weight vector of its width (no rule pads it: refused)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.weight


def test_a_module_is_padded_as_its_rule_declares():
    """``widens=`` is what makes ``pad_widths=True`` pad a module (here a stand-in class put
    under ``torch.nn`` so that it is refused without one), and ``weight=True`` counts its
    weight in the padded arithmetic."""
    from hftc.module.padding import pad_models, weight_shapes

    class Own(Scaled):
        pass

    Own.__module__ = "torch.nn.modules.test_rule_facts"
    models = [nn.Sequential(nn.Linear(3, w), Own(w)) for w in (2, 4)]
    with pytest.raises(UnsupportedOperatorError, match=r"cannot pad .*`1` \(Own\)"):
        pad_models(models)
    seen = []

    def pad(module, others, widths, where):
        seen.append((tuple(widths["weight"]), where))
        return padded_modules.widened(module, widths)

    with declared(("call_module", Own), widens=Widens(pad, weight=True)):
        padded, plan = pad_models(models)
        assert weight_shapes(models[0])["1.weight"] == torch.Size([2])
        assert "1.weight" in plan.weight_names
        assert "nn.Own" in registry.widened_modules()
    assert [s for s, _ in seen] == [(4,), (4,)]
    assert "model 0's module `1` (Own)" in seen[0][1]
    assert padded[0][1].weight.shape == (4,) and padded[0][1].weight[2:].eq(0).all()


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.special.expit(self.conv(x))


def test_channels_last_safety_is_declared_on_the_rule():
    model = Normed()
    graph = torch.fx.symbolic_trace(model).graph
    cpu = torch.device("cpu")
    assert layout.safe(model, graph, cpu)
    with declared(("call_function", torch.special.expit), channels_last=False):
        assert not layout.safe(model, graph, cpu)
        assert layout.safe(model, graph, torch.device("cuda"))
    with declared(("call_function", torch.special.expit),
                  channels_last=lambda node: node.args[0].name != "conv"):
        assert not layout.safe(model, graph, cpu)
    # the norms' rules declare theirs (a norm's CPU backward on channels-last tensors)
    assert not registry.channels_last_safe(nn.GroupNorm(2, 4))
    assert not registry.channels_last_safe(nn.InstanceNorm2d(4))
    assert registry.channels_last_safe(nn.BatchNorm2d(4))
    assert not registry.channels_last_safe(nn.Conv2d(4, 4, 1, stride=2))
    assert registry.channels_last_safe(nn.Conv2d(4, 4, 3, stride=2))


def test_the_chain_links_are_the_rules():
    assert {link.accepts for link in registry.chain_links("linear")} == {
        hftc.passes.linear.chained_linear}
    assert {link.accepts for link in registry.chain_links("relu")} == {
        hftc.passes.elementwise.chained_relu}
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(F.relu, (x,))
    relu_ = graph.call_function(torch.relu_, (x,))
    assert chains._is_relu(relu, nn.Module()) and not chains._is_relu(relu_, nn.Module())


def test_the_per_model_op_tables_are_the_rules_declarations():
    """Every op the runtime runs per model by name is one a rule declares, with its
    function, and every spelling read as one is a key of a rule that declares it."""
    declared_ops = {op.name: op for entry in RULES.values() for op in entry.differing_ops}
    assert rt_differing_ops.ELEMENTWISE_OPS == {n: op.function for n, op in declared_ops.items()}
    assert differing_ops.OP_PARAMETERS == {n: op.parameters for n, op in declared_ops.items()}
    for key, (op, _, _) in differing_ops._SPELLINGS.items():
        assert op in RULES[key].differing_ops, key


def test_a_per_model_op_declared_on_a_new_rule_fuses_models_that_differ_there():
    """Models with ``F.softsign`` against ``torch.special.expit``: refused while expit is no
    declared differing op; one ``differing_op=`` later they fuse, each model's op on its
    slice, forward and backward as the models (:func:`tests.equivalence.check_equivalence`)."""
    class Act(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.fc, self.act = nn.Linear(4, 3), act

        def forward(self, x):
            return self.act(self.fc(x))

    torch.manual_seed(0)
    models = [Act(F.softsign), Act(torch.special.expit), Act(F.softsign)]
    x = torch.randn(5, 4)
    key = ("call_function", torch.special.expit)
    with pytest.raises(MismatchError):
        hftc.fuse(models)
    expit = DifferingOp("expit", torch.special.expit, (), ((key, (), ()),))
    try:
        with declared(key, differing_op=expit):
            assert differing_ops.is_elementwise_function(torch.special.expit)
            fused = check_equivalence(models, x, steps=2)
            assert [r.rule for r in fused.fusion_report.per_model] == ["per_model_op"]
    finally:
        rt_differing_ops.ELEMENTWISE_OPS.pop("expit", None)
        differing_ops.OP_PARAMETERS.pop("expit", None)
        differing_ops._SPELLINGS.pop(key, None)
    assert not differing_ops.is_elementwise_function(torch.special.expit)


class AliasesOverHidden(nn.Module):
    """Elementwise ops the padding tables of before missed (their aliases, a cast, a
    parameterless activation module), over padded hidden units, then a sum over them."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc, self.act = nn.Linear(4, hidden), nn.Softsign()

    def forward(self, x):
        h = torch.subtract(self.act(self.fc(x)), 0.25).absolute()
        keep = torch.greater(h, 0.1).float()
        return torch.multiply(h, keep).sum(-1) + torch.negative(h).amax(-1)


def test_every_elementwise_rule_is_exact_over_a_padded_dim(single_thread):  # noqa: F811
    """The elementwise rules declare ``padding=EXACT`` for every spelling (``subtract`` as
    ``sub``, ``nn.Softsign`` as ``F.softsign``): the padded models equal their own runs."""
    torch.manual_seed(0)
    models = [AliasesOverHidden(h) for h in (3, 6)]
    x = torch.randn(7, 4)
    for key in [("call_function", torch.subtract), ("call_method", "absolute"),
                ("call_function", torch.greater), ("call_module", nn.Softsign)]:
        assert RULES[key].padding == EXACT, key
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    out = fused(x)
    assert fused.padding is not None and not fused.fusion_report.fallbacks
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model(x), rtol=1e-6, atol=1e-6)
