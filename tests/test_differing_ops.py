"""Models that are one program except for an elementwise op fuse: an activation (ReLU, GELU,
SiLU, Tanh, LeakyReLU, Identity; as modules and as F.* / torch.* calls) or dropout on in
some models and off in others.  The differing op runs on each model's slice of the fused
tensor (hftc/passes/differing_ops.py); everything else is fused.

Deterministic cases are checked against the loop over the original models (forward,
backward, and training steps with hftc.optim against stock torch.optim, float64 and
float32); dropout statistically (each model draws its own mask, at its own rate, with
F.dropout's scale), the models without dropout exactly.  A difference that is not an
elementwise op is still refused, and fuse_groups still splits it off.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn

import hftc
from hftc.errors import MismatchError, UnsupportedOperatorError

ACTIVATIONS = {
    "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh,
    "leaky_relu": lambda: nn.LeakyReLU(0.2), "identity": nn.Identity,
}
PAIRS = list(itertools.combinations(ACTIVATIONS, 2))
DTYPES = [torch.float64, torch.float32]


def mlp(act: str) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), ACTIVATIONS[act](), nn.Linear(16, 16),
                         ACTIVATIONS[act](), nn.Linear(16, 3))


class FunctionalMLP(nn.Module):
    """pytorch/examples' style: the activation is a function chosen by name."""

    def __init__(self, act: str):
        super().__init__()
        self.act = act
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = self.fc1(x)
        if self.act == "relu":
            h = F.relu(h)
        elif self.act == "gelu":
            h = F.gelu(h, approximate="tanh")
        elif self.act == "silu":
            h = F.silu(h)
        elif self.act == "tanh":
            h = torch.tanh(h)
        else:
            h = F.leaky_relu(h, 0.2)
        return self.fc2(h)


class CNN(nn.Module):
    """pytorch/examples' MNIST net, small, with a batch norm and its activation a choice."""

    def __init__(self, act: str):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1, bias=False)  # (a bias before a batch norm: none)
        self.bn = nn.BatchNorm2d(4)
        self.act = ACTIVATIONS[act]()
        self.conv2 = nn.Conv2d(4, 6, 3, 1)
        self.fc = nn.Linear(6 * 3 * 3, 5)

    def forward(self, x):
        x = self.act(self.bn(self.conv1(x)))
        x = F.max_pool2d(self.act(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def adam_steps():
    """(hftc.optim.Adam, stock Adam per model) with per-model learning rates."""
    def fused_optimizer(fused):
        return hftc.optim.Adam(fused, lr=[1e-2 * (i + 1) for i in range(fused.num_models)])

    def model_optimizer(i, model):
        return torch.optim.Adam(model.parameters(), lr=1e-2 * (i + 1))

    return fused_optimizer, model_optimizer


def _models(factory, names, seed=0):
    torch.manual_seed(seed)
    return [factory(name) for name in names]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("a", "b"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_mlp_whose_activation_differs_trains_like_the_loop(a, b, dtype):
    """Models a, b, a (two runs of one op, and a run between): forward, backward and 5
    Adam steps equal each model's own with stock Adam."""
    models = _models(mlp, [a, b, a])
    x = torch.randn(8, 6)
    fused = check_equivalence(models, x, dtype=dtype, steps=5, optimizers=adam_steps())
    report = fused.fusion_report
    assert len(report.per_model) == 2 and not report.fallbacks
    assert "models 0, 2" in report.per_model[0].reason


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("a", "b"), [p for p in PAIRS if "identity" not in p],
                         ids=[f"{a}-{b}" for a, b in PAIRS if "identity" not in (a, b)])
def test_functional_activations_differ_per_model(a, b, dtype):
    models = _models(FunctionalMLP, [a, b, b, a])
    fused = check_equivalence(models, torch.randn(5, 6), dtype=dtype, steps=5,
                              optimizers=adam_steps())
    assert [r.rule for r in fused.fusion_report.per_model] == ["per_model_op"]
    assert [m.act for m in fused.unfuse()] == [a, b, b, a]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cnn_with_every_activation_trains_like_the_loop(dtype):
    names = list(ACTIVATIONS)
    models = _models(CNN, names)
    x = torch.randn(3, 1, 10, 10)
    fused = check_equivalence(models, x, dtype=dtype, steps=5, optimizers=adam_steps())
    assert [type(m.act) for m in fused.unfuse()] == [type(m.act) for m in models]
    check_equivalence(models, x, dtype=dtype, train=False)


def test_function_held_as_an_attribute():
    """``self.fn = F.gelu`` (minGPT's style of picking an activation): each model runs its
    own, and unfuse gives each its own function back."""
    class Net(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.fn = fn

        def forward(self, x):
            return self.fn(self.fc(x))

    models = _models(Net, [F.relu, F.gelu, torch.tanh, F.silu])
    fused = check_equivalence(models, torch.randn(4, 3), steps=2)
    assert [m.fn for m in fused.unfuse()] == [F.relu, F.gelu, torch.tanh, F.silu]


def test_in_place_and_out_of_place_activations():
    """torchvision's ``nn.ReLU(inplace=True)`` in some models, GELU in others, and in-place
    method spellings: each model's op on its slice, the in-place ones written in place."""
    class Net(nn.Module):
        def __init__(self, inplace):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
            self.inplace = inplace
            self.act = nn.ReLU(inplace=True) if inplace else nn.GELU()

        def forward(self, x):
            h = self.act(self.fc1(x) * 1.0)
            g = h * 2.0
            return self.fc2(g.tanh_() if self.inplace else g.sigmoid())

    check_equivalence(_models(Net, [True, False, True]), torch.randn(5, 4), steps=2)
    check_equivalence(_models(Net, [True, False, True]), torch.randn(5, 4), dtype=torch.float32)
    # every model's op in place, each another: the result is the input, written
    every = _models(Net, [True, True, True])
    every[1].act = nn.LeakyReLU(0.2, inplace=True)
    check_equivalence(every, torch.randn(5, 4), steps=2)


def test_activation_of_a_shared_input():
    """The op is the first of forward, on the input all models share: each model's on it."""
    class Net(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.act, self.fc = ACTIVATIONS[act](), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.act(x))

    check_equivalence(_models(Net, ["tanh", "relu", "identity"]), torch.randn(3, 4))


def test_models_run_one_by_one_run_their_own_activation():
    """The models one by one (strategy='model_loop') runs each model's own activation, not
    model 0's, and so does keep_models' smaller array."""
    models = _models(mlp, ["relu", "gelu", "tanh"])
    check_equivalence(models, torch.randn(4, 6),
                      fuser=lambda ms, **kw: hftc.fuse(ms, strategy="model_loop", **kw))
    fused = hftc.fuse(copy.deepcopy(models)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    hftc.keep_models(fused, [2, 0])
    out = fused(x)
    for j, i in enumerate([2, 0]):
        torch.testing.assert_close(out[j], models[i].double()(x), rtol=1e-12, atol=1e-12)


class DropoutNet(nn.Module):
    """nanoGPT's MLP block: dropout on (p > 0) or off (nn.Identity) per model."""

    def __init__(self, on: bool, p: float = 0.3):
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.drop = nn.Dropout(p) if on else nn.Identity()

    def forward(self, x):
        return self.drop(self.fc(x))


def test_dropout_on_and_off_per_model():
    """Models with dropout off equal their loop exactly in train mode; models with it on
    each draw their own mask (kept fraction 1 - p, masks unlike each other's), and scale
    what they keep by F.dropout's 1 / (1 - p); every model's gradient goes through its own
    mask.  In eval mode all equal the loop."""
    on = [True, False, True, False]
    models = [m.double() for m in _models(DropoutNet, on)]
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(64, 32, dtype=torch.float64)
    torch.manual_seed(1)
    out = fused(x)
    assert fused.fusion_report.per_model[0].reason.endswith(
        "dropout(p=0.3) (models 0, 2), identity (models 1, 3)")
    torch.manual_seed(1)
    assert torch.equal(fused(x), out)  # the seed reproduces the draws
    out.sum().backward()
    scale = torch.ones((), dtype=torch.float64).div(0.7)
    masks = []
    for i, m in enumerate(models):
        h = m.fc(x)
        h.sum().backward()
        if not on[i]:
            torch.testing.assert_close(out[i], h, rtol=0, atol=0)
            torch.testing.assert_close(fused.fc.weight.grad[i], m.fc.weight.grad,
                                       rtol=1e-12, atol=1e-12)
            continue
        kept = out[i] != 0
        assert abs(kept.double().mean().item() - 0.7) < 5 * (0.7 * 0.3 / kept.numel()) ** 0.5
        torch.testing.assert_close(out[i][kept], h.detach()[kept] * scale, rtol=1e-15, atol=0)
        # the bias gradient counts each model's own kept elements, scaled
        torch.testing.assert_close(fused.fc.bias.grad[i], (kept.double() * scale).sum(0),
                                   rtol=1e-12, atol=1e-12)
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1])
    check_equivalence(models, x, train=False)


def test_dropout_rate_differences_keep_the_per_model_rate_rule():
    """nn.Dropout(0.0) against nn.Dropout(0.3) was fused by the dropout rule with one rate
    per model before; it still is (one draw for all), not run per slice."""
    models = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(p)) for p in (0.0, 0.3)]
    fused = hftc.fuse(models)
    fused(torch.randn(2, 4))
    report = fused.fusion_report
    assert not report.per_model
    assert any(rule.startswith("fuse_dropout") for rule in report.rule_counts())


def test_fusion_report_names_the_per_model_nodes():
    fused = hftc.fuse(_models(mlp, ["relu", "gelu", "relu"]))
    fused(torch.randn(2, 6))
    text = str(fused.fusion_report)
    assert "run on each model's slice (the models' ops differ; exact):" in text
    assert "node `_1` (module path `1`, ReLU): the op differs per model: relu (models 0, 2), " \
           "gelu (model 1)" in text


def test_an_op_that_is_not_elementwise_is_still_refused():
    models = [nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
              nn.Sequential(nn.Linear(4, 4), nn.Softmax(dim=-1))]
    with pytest.raises(MismatchError, match=r"model 1's `1` \(nn.Softmax\) differs from model "
                                            r"0's `1` \(nn.ReLU\): class Softmax vs ReLU; only "
                                            r"an elementwise op \(an activation such as ReLU"):
        hftc.fuse(models)
    # fuse_groups splits it off and fuses the rest
    models.append(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    groups = hftc.fuse_groups(models)
    assert [indices for _, indices in groups] == [[0, 2], [1]]
    x = torch.randn(2, 4)
    out = groups[0][0](x)
    torch.testing.assert_close(out[1], models[2](x))


def test_a_module_against_a_function_is_refused():
    """nn.ReLU() in one model, F.gelu in another: different code, refused with the rule."""
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.gelu(self.fc(x))

    class Module(Functional):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(self.fc(x))

    with pytest.raises(MismatchError, match=r"op call_module vs call_function; only an "
                                            r"elementwise op .* called the same way"):
        hftc.fuse([Functional(), Module()])


def test_mixed_in_place_whose_result_is_written_later_is_refused():
    class Net(nn.Module):
        def __init__(self, inplace):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=inplace) if inplace else nn.Tanh()

        def forward(self, x):
            h = self.fc(x)
            y = self.act(h)
            y.mul_(2)
            return h + y

    with pytest.raises(UnsupportedOperatorError,
                       match=r"node `act` \(module path `act`, ReLU\): the models run different "
                             r"ops here \(relu\(inplace=True\) \(model 0\), tanh \(model 1\)\), "
                             r".*forward writes in place into the result later; use the "
                             r"out-of-place form"):
        hftc.fuse([Net(True), Net(False)])(torch.randn(2, 4))


class ShapeBranch(nn.Module):
    """A branch on a shape: symbolic tracing fails, torch.export traces each model."""

    def __init__(self, act: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.act = ACTIVATIONS[act]()

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        return self.fc2(self.act(self.fc1(x)))


def test_exported_models_whose_activation_differs():
    """(torch.export records no node for nn.Identity: against it, a layer is missing.)"""
    x = torch.randn(5, 4)
    models = _models(ShapeBranch, ["relu", "gelu", "silu", "tanh", "leaky_relu"])
    fused = check_equivalence(models, x, steps=2, fuser=lambda ms, **kw: hftc.fuse(
        ms, example_inputs=(x.double(),), **kw))
    assert fused.frontend == "export"
    assert len(fused.fusion_report.per_model) == 1
