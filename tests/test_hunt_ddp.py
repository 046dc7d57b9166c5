"""A fused module treated as users treat a plain one: ``apply(init_fn)``, dtype moves,
submodule flags; each model must end where the loop over the originals treated alike ends."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hftc
import hftc.optim as ho
from hftc.errors import (
    FusionArgumentError,
    FusionNotImplementedError,
    UnsupportedOperatorError,
)


def _convnet() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).double()


def _init_weights(m: nn.Module) -> None:
    # (timm / HF style: by class, a random draw)
    if isinstance(m, (nn.Conv2d, nn.Linear)):
        nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.constant_(m.weight, 0.5)
        nn.init.constant_(m.bias, 0.1)


def _same_after_step(fused: nn.Module, models: list[nn.Module]) -> None:
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
    opt = ho.SGD([p for p in fused.parameters() if p.requires_grad], lr=[0.1, 0.05, 0.2])
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr)
            for m, lr in zip(models, [0.1, 0.05, 0.2])]
    sum(o.square().mean() for o in fused(x)).backward()
    opt.step()
    for m, o in zip(models, opts):
        m(x).square().mean().backward()
        o.step()
    out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)


def test_apply_init_gives_each_model_its_own_init():
    torch.manual_seed(0)
    models = [_convnet() for _ in range(3)]
    fused = hftc.fuse([copy.deepcopy(m) for m in models])
    torch.manual_seed(1)
    assert fused.apply(_init_weights) is fused
    torch.manual_seed(1)
    for m in models:
        m.apply(_init_weights)
    _same_after_step(fused, models)


def test_apply_freezing_every_model_alike_freezes_the_stacked_parameter():
    torch.manual_seed(0)
    models = [_convnet() for _ in range(3)]
    fused = hftc.fuse([copy.deepcopy(m) for m in models])

    def freeze_bn(m: nn.Module) -> None:
        if isinstance(m, nn.BatchNorm2d):
            m.requires_grad_(False)

    fused.apply(freeze_bn)
    for m in models:
        m.apply(freeze_bn)
    assert [n for n, p in fused.named_parameters() if not p.requires_grad] == [
        "1.weight", "1.bias"]
    _same_after_step(fused, models)


def test_apply_freezing_one_model_only_is_refused():
    torch.manual_seed(0)
    fused = hftc.fuse([_convnet() for _ in range(3)])
    seen = []

    def freeze_first(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            seen.append(m)
            if len(seen) == 1:
                m.requires_grad_(False)

    with pytest.raises(FusionNotImplementedError, match="4.weight"):
        fused.apply(freeze_first)


def test_apply_changing_a_python_attribute_fuses_the_models_anew():
    # (YOLOv5's initialize_weights: BatchNorm eps/momentum set by class)
    torch.manual_seed(0)
    models = [_convnet() for _ in range(3)]
    fused = hftc.fuse([copy.deepcopy(m) for m in models])
    params = list(fused.parameters())

    def yolo_init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.1)
        if isinstance(m, nn.BatchNorm2d):
            m.eps, m.momentum = 0.5, 0.9  # (large: an old eps would show in the outputs)

    torch.manual_seed(3)
    fused.apply(yolo_init)
    torch.manual_seed(3)
    for m in models:
        m.apply(yolo_init)
    assert list(fused.parameters()) == params  # (an optimizer made before still steps them)
    assert fused.unfuse_model(1)[1].eps == 0.5
    _same_after_step(fused, models)
    for i, m in enumerate(models):  # (the new momentum in the running stats)
        assert torch.allclose(fused.unfuse_model(i)[1].running_mean, m[1].running_mean)


def test_apply_registering_a_hook_that_does_not_fuse_is_refused_unchanged():
    fused = hftc.fuse([_convnet() for _ in range(3)])
    before = {k: v.clone() for k, v in fused.state_dict().items()}

    def add_hook(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.ReLU):
            m.register_forward_hook(lambda mod, args, out: print(out.shape))

    try:
        fused.apply(add_hook)
    except FusionArgumentError as exc:
        assert "model 0's attribute '2._forward_hooks'" in str(exc)
        assert "m.apply(add_hook)" in str(exc)
        for k, v in fused.state_dict().items():
            assert torch.equal(v, before[k]), k
    else:  # (fused anew with the hook: each model runs it)
        assert all(len(m._forward_hooks) == 1 for m in fused.unfuse() if isinstance(m[2], nn.ReLU))


def test_apply_with_pad_widths_inits_each_model_at_its_own_width():
    def net(w: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(6, w), nn.Tanh(), nn.Linear(w, 3)).double()

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.constant_(m.bias, 0.01)

    torch.manual_seed(0)
    models = [net(w) for w in (4, 8, 6)]
    fused = hftc.fuse([copy.deepcopy(m) for m in models], pad_widths=True)
    torch.manual_seed(2)
    fused.apply(init)
    torch.manual_seed(2)
    for m in models:
        m.apply(init)
    x = torch.randn(5, 6, dtype=torch.float64)
    out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
        for (n, p), q in zip(fused.unfuse_model(i).named_parameters(), m.parameters()):
            assert torch.equal(p, q), (i, n)


@pytest.mark.parametrize("parametrize", [
    torch.nn.utils.parametrizations.weight_norm,
    torch.nn.utils.parametrizations.spectral_norm,
    lambda m: torch.nn.utils.parametrizations.orthogonal(m, "weight"),
])
def test_parametrizing_a_fused_submodule_is_refused_unchanged(parametrize):
    # (after a first call: the cached program went on with the stale stacked weight)
    torch.manual_seed(0)
    fused = hftc.fuse([nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
                       for _ in range(3)])
    x = torch.randn(2, 6)
    before = fused(x)
    with pytest.raises(UnsupportedOperatorError, match=r"(?s)fused\.0 .*before fusing"):
        parametrize(fused.get_submodule("0"))
    assert type(fused.get_submodule("0")).__name__ == "StackedLinear"  # (not parametrize's class)
    assert [n for n, _ in fused.named_parameters()] == ["0.weight", "0.bias", "2.weight",
                                                        "2.bias"]
    torch.testing.assert_close(fused(x), before, rtol=0, atol=0)


def test_models_parametrized_before_fusing_train_as_their_own():
    torch.manual_seed(0)
    models = [_convnet() for _ in range(3)]
    for m in models:
        torch.nn.utils.parametrizations.weight_norm(m[4])
    fused = hftc.fuse([copy.deepcopy(m) for m in models])
    assert "4.parametrizations.weight.original0" in dict(fused.named_parameters())
    _same_after_step(fused, models)


def test_deleting_a_stacked_tensor_is_refused():
    fused = hftc.fuse([nn.Sequential(nn.Linear(4, 4)) for _ in range(2)])
    with pytest.raises(UnsupportedOperatorError, match=r"del fused\.0\.bias"):
        del fused.get_submodule("0").bias
    assert "0.bias" in dict(fused.named_parameters())
