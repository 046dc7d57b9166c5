"""Forming a fused array: the copies the first-call check builds (ModelCopies.build, a
walk of the tree once) and deepcopy_module are each model's own, and every model whose
Python state differs from model 0's is still checked, after a re-formation too."""
import torch
from torch import nn

import hftc
import hftc.module.copies as copies
from hftc.frontends.symbolic import deepcopy_module


class Net(nn.Module):
    def __init__(self, p=0.0, scale=1.0):
        super().__init__()
        self.cfg = {"scale": scale}
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(p), nn.Linear(8, 3))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        return self.net(x) * self.cfg["scale"]


def _models(n=5, dtype=torch.float64):
    torch.manual_seed(0)
    return [Net(p=0.1 * i, scale=1.0 + i).to(dtype) for i in range(n)]


def _built(fused):
    built = []
    orig = copies.ModelCopies.build

    def spy(self, index, fused_module, skip=()):
        built.append(index)
        return orig(self, index, fused_module, skip)
    return built, spy


def test_copies_are_each_models_own():
    models = _models()
    fused = hftc.fuse(models)
    fused.net[2].train()
    for i, m in enumerate(models):
        copy = fused.unfuse_model(i)
        assert copy.cfg == {"scale": 1.0 + i} and copy.cfg is not m.cfg
        assert copy.net[2].p == m.net[2].p
        for (n, a), (n2, b) in zip(copy.state_dict().items(), m.state_dict().items()):
            assert n == n2 and torch.equal(a, b) and a.data_ptr() != b.data_ptr()
        assert [s.training for s in copy.modules()] == [s.training for s in m.modules()]


def test_every_differing_model_is_checked_after_reformation(monkeypatch):
    for dtype in (torch.float64, torch.float32):
        models = _models(dtype=dtype)
        built, spy = _built(None)
        monkeypatch.setattr(copies.ModelCopies, "build", spy)
        x = torch.randn(4, 6, dtype=dtype)
        fused = hftc.fuse(models).eval()
        out = fused(x)
        assert set(range(5)) <= set(built)  # (each scale differs: each model's own forward)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m.eval()(x))
        # A re-formation after model 3's Python state changed: traced and checked anew.
        models[3].cfg["scale"] = -7.0
        models[3].net[2].p = 0.45
        built.clear()
        again = hftc.fuse(models).eval()
        out = again(x)
        assert 3 in built
        assert again.unfuse_model(3).cfg == {"scale": -7.0}
        assert again.unfuse_model(3).net[2].p == 0.45
        torch.testing.assert_close(out[3], models[3].eval()(x))


def test_deepcopy_module_is_fresh():
    m = _models(1)[0]
    twin = deepcopy_module(m)
    twin.cfg["scale"] = 5.0
    twin.net[2].p = 0.3
    assert m.cfg["scale"] == 1.0 and m.net[2].p == 0.0
    assert [n for n, _ in twin.named_modules()] == [n for n, _ in m.named_modules()]
    assert all(a is not b for a, b in zip(twin.modules(), m.modules()))


def test_backward_matches_loop():
    models = _models()
    twins = [deepcopy_module(m) for m in models]
    fused = hftc.fuse(models).eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    fused(x).sum().backward()
    for i, t in enumerate(twins):
        t.eval()(x).sum().backward()
        grads = dict(fused.named_parameters())
        for name, p in t.named_parameters():
            torch.testing.assert_close(grads[name].grad[i], p.grad, rtol=0, atol=1e-12)
