"""A new user's first mistakes converting a loop to hftc (bug hunt "errors"): each one
gets an hftc warning or error naming the model, the parameter and what to write."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def _usage_warnings(call, times=8):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            call()
    return [w for w in caught if issubclass(w.category, hftc.UsageWarning)]


@pytest.mark.parametrize("edit", ["zero_", "load_state_dict", "init"])
def test_an_in_place_edit_of_a_model_given_to_fuse_warns_at_the_fused_forward(edit):
    """``models[1].load_state_dict(ckpt)`` (or ``nn.init``, ``w.zero_()``) after fusing
    reaches none of the fused module's copies, which ran the weights of the fusing
    silently; the next fused forwards warn once, naming the model, the parameter and
    the fused module's copy to change instead."""
    torch.manual_seed(0)
    models = [MLP() for _ in range(3)]
    x = torch.randn(5, 4)
    fused = hftc.fuse(models)
    assert _usage_warnings(lambda: fused(x)) == []  # untouched models: quiet
    with torch.no_grad():
        if edit == "zero_":
            models[1].b.bias.zero_()
        elif edit == "load_state_dict":
            models[1].load_state_dict(MLP().state_dict())
        else:
            nn.init.zeros_(models[1].a.weight)
    [warning] = _usage_warnings(lambda: fused(x))
    text = str(warning.message)
    name = {"zero_": "b.bias", "load_state_dict": "a.weight", "init": "a.weight"}[edit]
    assert f"model 1 given to hftc.fuse had its parameter `{name}` written in place" in text
    assert f"fused.get_parameter('{name}')[1].copy_(w)" in text
    assert "hftc.replace_models(fused, {1: model})" in text
    assert warning.filename == __file__
    # what it says: the fused module's copy changed, and model 1 runs the edited weights
    with torch.no_grad():
        for key, w in models[1].named_parameters():
            fused.get_parameter(key)[1].copy_(w)
    torch.testing.assert_close(fused(x)[1], models[1](x))


def test_replaced_models_and_the_fused_modules_own_training_are_quiet():
    """Training the fused module, and a model replace_models took out and then edited,
    are no edit of a model the fused module still runs."""
    torch.manual_seed(0)
    models = [MLP() for _ in range(3)]
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    fused = hftc.fuse(models)
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()
    assert _usage_warnings(step) == []
    hftc.replace_models(fused, {1: MLP()})
    with torch.no_grad():
        models[1].a.weight.zero_()  # no longer model 1 of the fused module
    assert _usage_warnings(step) == []


class WithScripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.jit.script(nn.Linear(4, 8)), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


@pytest.mark.parametrize("make, what", [
    (lambda: torch.jit.script(MLP()), "model 0 is a TorchScript module (MLP"),
    (lambda: torch.jit.trace(MLP(), torch.randn(5, 4)), "model 0 is a TorchScript module (MLP"),
    (WithScripted, "model 0's submodule `a` is a TorchScript module (Linear"),
])
def test_a_torchscript_model_names_the_python_module_to_fuse(make, what):
    """A model (or a submodule) made by torch.jit.script / trace raised a bare
    AttributeError from hftc's tracer (``'_CachedForward' object has no attribute
    '__getattr__'``) or a TypeError of a ParameterDict; now an hftc error naming the
    model, the submodule and the Python module to fuse instead."""
    with pytest.raises(hftc.errors.FusionTypeError, match="TorchScript") as caught:
        hftc.fuse([make() for _ in range(2)])
    assert what in str(caught.value)
    assert "net.load_state_dict(scripted.state_dict())" in str(caught.value)


def test_models_held_in_a_module_list_fuse_and_in_a_dict_name_its_values():
    """``hftc.fuse(nn.ModuleList(models))`` was refused as "a single nn.Module; wrap it
    in a list" (advice that makes a list of one ModuleList), and a dict of models was
    read by its keys ("model 0 is a str").  A ModuleList is the list of models; a dict
    or ModuleDict names its values, a Sequential says how to pass the models it holds."""
    torch.manual_seed(0)
    models = [MLP() for _ in range(3)]
    x = torch.randn(5, 4)
    out = hftc.fuse(nn.ModuleList(models))(x)
    torch.testing.assert_close(out, torch.stack([m(x) for m in models]))
    for held in ({"a": models[0], "b": models[1]}, nn.ModuleDict({"a": models[0]})):
        with pytest.raises(hftc.errors.FusionTypeError,
                           match=r"hftc\.fuse\(list\(models\.values\(\)\)\)"):
            hftc.fuse(held)
    with pytest.raises(hftc.errors.FusionTypeError, match=r"hftc\.fuse\(list\(models\)\)"):
        hftc.fuse(nn.Sequential(*models))
    with pytest.raises(hftc.errors.FusionTypeError, match=r"wrap it in a list: hftc\.fuse"):
        hftc.fuse(models[0])


def test_a_fused_state_dict_of_another_number_of_models_names_both_counts():
    """A checkpoint of a fused module of 3 models loaded into one of 2 (saved before
    EarlyStopping dropped one) was torch's bare "size mismatch" RuntimeError; now an
    hftc error naming both counts and how to pick the models, the rows it names loading."""
    torch.manual_seed(0)
    three, two = hftc.fuse([MLP() for _ in range(3)]), hftc.fuse([MLP() for _ in range(2)])
    sd = three.state_dict()
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"state dict of a fused module of 3 models .*this one holds 2"):
        two.load_state_dict(sd)
    two.load_state_dict({k: v[[2, 0]] for k, v in sd.items()})  # what it says
    x = torch.randn(5, 4)
    torch.testing.assert_close(two(x), three(x)[[2, 0]])
    with pytest.raises(RuntimeError, match="size mismatch"):  # another architecture: torch's
        hftc.fuse([nn.Sequential(nn.Linear(5, 8), nn.Linear(8, 3))] * 3).load_state_dict(
            hftc.fuse([nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))] * 3).state_dict())


def test_replace_models_names_itself_and_the_new_positions():
    """replace_models with a position out of range said "keep_models: model index 7",
    naming a function the user did not call; a new model that does not fuse is named
    by its position."""
    torch.manual_seed(0)
    fused = hftc.fuse([MLP() for _ in range(3)])
    with pytest.raises(hftc.errors.FusionIndexError,
                       match=r"^replace_models: the positions of models holds model index 7"):
        hftc.replace_models(fused, {7: MLP()})
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"^replace_models: the new model\(s\) at position\(s\) \[1\]"):
        hftc.replace_models(fused, {1: MLP().double()})
    with pytest.raises(hftc.errors.FusionIndexError, match=r"^keep_models: keep holds model"):
        hftc.keep_models(fused, [0, 3])


def test_a_list_of_one_input_per_model_names_torch_stack_and_in_dims():
    """``fused([x0, x1, x2])`` (one input per model, as a loop over the models passed
    them) said only that Linear takes no list; it now names the stacking and in_dims,
    which gives model i its own input."""
    torch.manual_seed(0)
    models = [MLP() for _ in range(3)]
    xs = [torch.randn(5, 4) for _ in range(3)]
    fused = hftc.fuse(models)
    with pytest.raises(hftc.errors.TraceError,
                       match=r"`x` is a list of 3 tensors \[5, 4\]: .*fused\.with_in_dims\(0\)"
                             r"\(torch\.stack\(x\)\)"):
        fused(xs)
    out = fused.with_in_dims(0)(torch.stack(xs))  # what it says
    torch.testing.assert_close(out, torch.stack([m(x) for m, x in zip(models, xs)]))


def test_an_input_the_models_cannot_take_names_the_users_call_and_the_models_line():
    """The TraceError of a first call with inputs the models cannot take named the node
    and its module path, but neither the user's call nor the line of the model's forward;
    it names both now."""
    fused = hftc.fuse([MLP() for _ in range(2)])
    with pytest.raises(hftc.errors.TraceError) as caught:
        fused(torch.randn(5, 7))  # the call named
    text = str(caught.value)
    assert f"at {__file__}:" in text and "`fused(torch.randn(5, 7))  # the call named`" in text
    assert "node `a` (module path `a`, Linear) (" in text
    assert "in forward: `return self.b(F.relu(self.a(x)))`" in text


@pytest.mark.parametrize("loss, target", [
    (F.cross_entropy, lambda y, n: y.repeat(n)),
    (F.mse_loss, lambda y, n: torch.cat([y.float().unsqueeze(1)] * n)),
])
def test_a_target_repeated_for_the_models_says_per_model_shares_one(loss, target):
    """``hftc.per_model(loss)(out, y.repeat(N))`` (the target as one loss over all models
    would take it) failed with torch's batch-size words only; the message now says the
    target is N x the batch and that per_model shares one model's, which then runs."""
    torch.manual_seed(0)
    fused = hftc.fuse([MLP() for _ in range(3)])
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    out = fused(x)[..., :1] if loss is F.mse_loss else fused(x)
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"Argument 1's dim 0 is 3 x the batch 5: a target repeated "
                             r"for the 3 models \(y\.repeat\(3\)"):
        hftc.per_model(loss)(out, target(y, 3))
    one = y if loss is F.cross_entropy else y.float().unsqueeze(1)
    assert hftc.per_model(loss)(out, one).shape == (3,)  # what it says


def test_a_whole_fused_module_loaded_as_a_state_dict_names_model_state_dict(tmp_path):
    """``torch.save(fused, path)``, then ``model.load_state_dict(torch.load(path, ...))``
    was torch's "Expected state_dict to be dict-like, got FusedModule"; now an hftc error
    at the user's line naming model_state_dict(i), which then loads."""
    torch.manual_seed(0)
    fused = hftc.fuse([MLP() for _ in range(3)])
    torch.save(fused, tmp_path / "fused.pt")
    loaded = torch.load(tmp_path / "fused.pt", weights_only=False)
    one = MLP()
    with pytest.raises(hftc.errors.FusionTypeError,
                       match=r"MLP\.load_state_dict at .*got a fused module of 3 models .*"
                             r"model\.load_state_dict\(loaded\.model_state_dict\(i\)\)"):
        one.load_state_dict(loaded)
    with pytest.raises(hftc.errors.FusionTypeError,
                       match=r"fused\.load_state_dict\(loaded\.state_dict\(\)\)"):
        fused.load_state_dict(loaded)
    one.load_state_dict(loaded.model_state_dict(2))  # what it says
    x = torch.randn(5, 4)
    torch.testing.assert_close(one(x), fused(x)[2])
    with pytest.raises(TypeError, match="dict-like"):  # anything else: torch's own
        one.load_state_dict(nn.Linear(2, 2))
