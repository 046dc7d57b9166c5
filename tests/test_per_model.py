"""Models that differ only in a scalar hyper-parameter fuse, each model with its own value.

HFTA and Hydro force dropout p, slopes, norm eps/momentum to be equal across the
fused models; hftc keeps one value per model.  Deterministic cases are checked
against the loop over the originals (forward, backward, running stats); dropout
is checked statistically (each model's keep rate is its own 1 - p).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn

import hftc


class Scaled(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return self.fc(x) * self.scale + 0.5 / self.scale


class FunctionalSlopes(nn.Module):
    def __init__(self, slope: float, alpha: float):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.slope, self.alpha = slope, alpha

    def forward(self, x):
        h = self.fc(x)
        return F.leaky_relu(h, self.slope) + F.elu(h, self.alpha) + F.celu(h, alpha=self.alpha)


FACTORIES = {
    "leaky_relu": lambda v: nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(v)),
    "elu": lambda v: nn.Sequential(nn.Linear(4, 4), nn.ELU(alpha=v)),
    "celu": lambda v: nn.Sequential(nn.Linear(4, 4), nn.CELU(alpha=v)),
    "batchnorm_momentum": lambda v: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=v)),
    "batchnorm_eps": lambda v: nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3, eps=v * 1e-2)),
    "batchnorm_cumulative": lambda v: nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None if v < 0.25 else v)),
    "layernorm_eps": lambda v: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=v)),
    "groupnorm_eps": lambda v: nn.Sequential(nn.Conv2d(2, 4, 1), nn.GroupNorm(2, 4, eps=v)),
    "rmsnorm_eps": lambda v: nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4, eps=v)),
    "instancenorm_eps": lambda v: nn.Sequential(
        nn.Conv2d(2, 3, 1), nn.InstanceNorm2d(3, eps=v, affine=True, track_running_stats=True)),
    "constant_scale": lambda v: Scaled(v),
    "functional_slopes": lambda v: FunctionalSlopes(v, 2 * v),
}
INPUTS = {"batchnorm_eps": (4, 2, 3, 3), "groupnorm_eps": (2, 2, 3, 3),
          "instancenorm_eps": (2, 2, 3, 3)}
VALUES = [0.1, 0.3, 0.2]


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_per_model_scalars_match_the_loop(name, train):
    models = [FACTORIES[name](v) for v in VALUES]
    fused = check_equivalence(models, torch.randn(INPUTS.get(name, (5, 4))), train=train,
                              steps=2 if train else 1)
    assert fused.num_models == 3
    # instance norm and celu with per-model values run model by model, exactly
    loops = [r.node for r in fused.fusion_report.fallbacks]
    expected = {"instancenorm_eps": ["_1"], "celu": ["_1"], "functional_slopes": ["celu"]}
    assert loops == expected.get(name, [])


@pytest.mark.parametrize("layer", ["module", "functional", "channels"])
def test_per_model_dropout_rates(layer):
    rates = [0.1, 0.5, 0.8]

    class Functional(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, x):
            return F.dropout(x, self.p, self.training)

    make = {"module": nn.Dropout, "functional": Functional,
            "channels": lambda p: nn.Sequential(nn.Dropout2d(p))}[layer]
    fused = hftc.fuse([make(p) for p in rates])
    assert fused.fusion_report.fallbacks == [] if fused._programs else True
    x = torch.ones(64, 32, 4, 4)
    out = fused(x)
    for i, p in enumerate(rates):
        kept = out[i] != 0
        assert abs(kept.float().mean().item() - (1 - p)) < 0.03, (i, p)
        torch.testing.assert_close(out[i][kept], torch.full_like(out[i][kept], 1 / (1 - p)))
        if layer == "channels":  # whole channels are dropped
            assert torch.equal(kept.all((-1, -2)), kept.any((-1, -2)))
    assert fused.fusion_report.fallbacks == []
    fused.eval()
    torch.testing.assert_close(fused(x), x.expand(3, *x.shape))


def test_fuse_groups_sweep_of_dropout_and_width():
    """8 models, 4 dropout rates x 2 widths -> 2 groups, each matching its originals."""
    models = [nn.Sequential(nn.Linear(6, w), nn.ReLU(), nn.Dropout(p), nn.Linear(w, 3))
              for w in (8, 16) for p in (0.1, 0.2, 0.3, 0.4)]
    groups = hftc.fuse_groups(models)
    assert [indices for _, indices in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    x = torch.randn(5, 6)
    for fused, indices in groups:
        fused.eval()
        out = fused(x)
        for j, i in enumerate(indices):
            torch.testing.assert_close(out[j], models[i].eval()(x))


def test_group_models_gives_fuse_groups_arrays_without_fusing(monkeypatch):
    """group_models: the arrays fuse_groups fuses (indices in order, why together),
    interleaved widths included, and nothing fused."""
    from hftc.module import group

    models = [nn.Sequential(nn.Linear(6, w), nn.ReLU(), nn.Dropout(p), nn.Linear(w, 3))
              for w, p in ((8, 0.1), (16, 0.2), (8, 0.3), (16, 0.1), (8, 0.0))]
    fused = [indices for _, indices in hftc.fuse_groups(models)]
    monkeypatch.setattr(group, "FusedModule", None)  # grouping alone builds none
    assert group.group_models(models) == [([0, 2, 4], "one structure"),
                                          ([1, 3], "one structure")]
    assert fused == [[0, 2, 4], [1, 3]]


def test_widths_still_refuse_to_fuse_directly():
    with pytest.raises(hftc.MismatchError, match="out_features 16 vs 8"):
        hftc.fuse([nn.Sequential(nn.Linear(2, 8)), nn.Sequential(nn.Linear(2, 16))])


def test_unfuse_gives_each_model_its_own_hyper_parameters():
    class Head(nn.Module):
        def __init__(self, p, scale):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.drop = nn.Dropout(p)
            self.act = nn.LeakyReLU(scale)
            self.scale = scale

        def forward(self, x):
            return self.act(self.drop(self.fc(x))) * self.scale

    models = [Head(0.1, 0.2), Head(0.7, 0.3)]
    back = hftc.fuse(models).unfuse()
    assert [m.drop.p for m in back] == [0.1, 0.7]
    assert [m.act.negative_slope for m in back] == [0.2, 0.3]
    assert [m.scale for m in back] == [0.2, 0.3]


def test_numpy_hyper_parameters_are_read_as_the_numbers_they_are():
    # np.linspace grids: per-model values printed as np.float64(...) into the generated
    # code (NameError), and differing np.float32 / np.int64 values were left out of the
    # models' signatures (fused with model 0's, silently).
    import numpy as np

    torch.manual_seed(0)
    slopes = np.linspace(0.01, 0.3, 3)
    models = [nn.Sequential(nn.Conv2d(4, 4, 1), nn.GroupNorm(np.int64(2), 4),
                            nn.LeakyReLU(s)) for s in slopes]
    fused = check_equivalence(models, torch.randn(2, 4, 6, 6), steps=2)
    assert [m[2].negative_slope for m in fused.unfuse()] == list(slopes)
    clipped = [nn.Sequential(nn.Linear(4, 4), nn.Hardtanh(np.float32(-0.1 * (i + 1)),
                                                          np.float32(0.1 * (i + 1))))
               for i in range(2)]
    with pytest.raises(hftc.errors.MismatchError,
                       match=r"max_val 0.2.* vs 0.1.*; min_val -0.2.* vs -0.1"):
        hftc.fuse(clipped)


@pytest.mark.parametrize("layer", ["upsample", "embedding_bag"])
def test_a_modules_own_mode_attribute_is_compared(layer):
    # The signature's train/eval entry was named "mode" and overwrote Upsample's and
    # EmbeddingBag's own `mode`: models differing in it were fused with model 0's.
    def make(mode):
        if layer == "upsample":
            return nn.Sequential(nn.Conv2d(2, 2, 1), nn.Upsample(scale_factor=2, mode=mode))
        return nn.Sequential(nn.EmbeddingBag(10, 3, mode=mode))

    modes = ["nearest", "bilinear"] if layer == "upsample" else ["sum", "mean"]
    with pytest.raises(hftc.errors.MismatchError, match=rf"mode {modes[1]} vs "
                                                        rf"{modes[0]}"):
        hftc.fuse([make(m) for m in modes])



def hardshrink_per_model(x: torch.Tensor, lambds: tuple[float, ...]) -> torch.Tensor:
    """Model i's ``hardshrink(x[i], lambd=lambds[i])`` for a ``[N, ...]`` stack."""
    return torch.stack([F.hardshrink(x[i], lambd) for i, lambd in enumerate(lambds)])


def softplus_per_model(x: torch.Tensor, betas: tuple[float, ...]) -> torch.Tensor:
    """Model i's ``softplus(x[i], beta=betas[i])`` for a ``[N, ...]`` stack."""
    return torch.stack([F.softplus(x[i], beta=beta) for i, beta in enumerate(betas)])


def test_a_rule_declares_the_hyper_parameters_that_may_differ_per_model():
    """``@rule(..., per_model=("lambd",))`` is all it takes: models whose Hardshrink ``lambd``
    differs match, and the rule receives one value per model; without it they are refused.
    (Hardshrink: the activations of hftc.passes.differing_ops, Softplus's ``beta`` among
    them, differ per model without a rule.)"""
    from hftc.errors import MismatchError
    from hftc.passes.registry import RULES, rule

    models = [nn.Sequential(nn.Linear(4, 4), nn.Hardshrink(lambd)) for lambd in (0.5, 2.0, 3.0)]
    with pytest.raises(MismatchError, match=r"lambd 2\.0 vs 0\.5"):
        hftc.fuse(models)

    seen = []

    def fuse_hardshrink(group, builder):
        seen.append(group.per_model["lambd"])
        return builder.call(hardshrink_per_model, builder.broadcast(group.args[0]),
                            tuple(group.per_model["lambd"]))

    key = ("call_module", nn.Hardshrink)
    declared = RULES.pop(key)
    try:
        rule(key, per_model=("lambd",))(fuse_hardshrink)
        fused = hftc.fuse(models)
        x = torch.randn(3, 4)
        out = fused(x)  # (compiled on the first call)
    finally:
        RULES[key] = declared
    assert seen == [[0.5, 2.0, 3.0]]
    assert not fused.fusion_report.fallbacks
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))


def test_a_functions_per_model_hyper_parameters_must_be_its_parameters():
    """Positions come from the function's signature: a name it does not have is an error."""
    from hftc.passes.registry import RULES, rule

    key = ("call_function", softplus_per_model)
    with pytest.raises(TypeError, match=r"rule `<lambda>`: call_function softplus_per_model has "
                                        r"no parameter 'beta' \(per_model=\('beta',\)\)"):
        rule(key, per_model=("beta",))(lambda group, builder: None)
    assert key not in RULES


def test_the_per_model_table_is_built_from_the_rules_declarations():
    from hftc.passes.registry import per_model_table

    table = per_model_table()
    assert table.module_attributes(nn.Dropout2d(0.1)) == ("p",)
    assert table.module_attributes(nn.BatchNorm2d(3)) == ("momentum", "eps")
    # No rule fuses SyncBatchNorm: the norm family's entry declares it for the loop.
    assert table.module_attributes(nn.SyncBatchNorm(3)) == ("momentum", "eps")
    assert table.module_attributes(nn.Linear(2, 2)) == ()
    assert table.arguments[F.batch_norm] == {6: "momentum", 7: "eps"}
    assert table.defaults[F.batch_norm] == (None, None, False, 0.1, 1e-5)
    assert table.arguments[F.scaled_dot_product_attention] == {4: "dropout_p"}
    assert F.relu not in table.arguments
