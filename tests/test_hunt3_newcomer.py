"""hftc as a newcomer meets it: the first mistakes get an hftc error naming what to change,
and the pages' claims hold when their snippets are run as a user runs them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.errors import FusionArgumentError, FusionTypeError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _fused(n=2):
    torch.manual_seed(0)
    return hftc.fuse([Net() for _ in range(n)])


@pytest.mark.parametrize("reach", ["index", "len", "iterate", "stock optimizer"])
def test_reaching_for_model_i_through_the_fused_module_names_unfuse_model(reach):
    """``fused[i]`` (model i?), ``len(fused)``, ``torch.optim.SGD(fused)``: was a bare
    TypeError "'Net' (stacked by hftc) does not support indexing" saying nothing of what
    to write instead."""
    fused = _fused()
    calls = {"index": lambda: fused[0], "len": lambda: len(fused),
             "iterate": lambda: list(fused),
             "stock optimizer": lambda: torch.optim.SGD(fused, lr=0.1)}
    with pytest.raises(FusionTypeError) as caught:
        calls[reach]()
    message = str(caught.value)
    assert "fused.unfuse_model(i)" in message and "fused(x)[i]" in message
    assert "fused.parameters()" in message
    assert __file__ in message  # the user's line
    assert isinstance(caught.value, TypeError)  # what torch's own refusal is


def test_indexing_a_stacked_submodule_says_its_tensors_are_stacked():
    fused = _fused()
    with pytest.raises(FusionTypeError, match=r"fused\.fc1\.weight\[i\]"):
        fused.fc1[0]


def test_a_checkpoint_loaded_into_a_model_before_the_first_fused_call_warns():
    """The newcomer's script: fuse, load each model's checkpoint into the models (not the
    fused module), evaluate. The first fused forwards ran the weights of the fusing with
    no word (the check read one model every 4th call)."""
    torch.manual_seed(0)
    models = [Net() for _ in range(3)]
    fused = hftc.fuse(models)
    models[2].load_state_dict(Net().state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused(torch.randn(5, 4))
    [warning] = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    assert "model 2 given to hftc.fuse had its parameter `fc1.weight` written in place" \
        in str(warning.message)
    assert warning.filename == __file__


def test_untouched_models_keep_the_first_call_quiet():
    fused = _fused(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hftc.UsageWarning)
        fused(torch.randn(5, 4))


@pytest.mark.parametrize("skip", [[1, 0], [0], (2,), torch.tensor([1, 2])])
def test_skip_models_given_model_indices_is_refused(skip):
    """``opt.step(skip_models=[1, 0])`` (models 1 and 0, as the name reads) was read as
    flags: model 0 skipped, model 1 stepped, silently; ``[2, 3]`` skipped every model."""
    fused = _fused()
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    hftc.per_model(F.cross_entropy)(fused(torch.randn(5, 4)),
                                    torch.randint(0, 3, (5,))).sum().backward()
    before = [p.detach().clone() for p in fused.parameters()]
    with pytest.raises(FusionArgumentError, match=r"one bool per model.*range\(2\)"):
        opt.step(skip_models=skip)
    assert all(torch.equal(p, b) for p, b in zip(fused.parameters(), before))


def test_skip_models_flags_still_skip():
    fused = _fused()
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    hftc.per_model(F.cross_entropy)(fused(torch.randn(5, 4)),
                                    torch.randint(0, 3, (5,))).sum().backward()
    before = fused.fc1.weight.detach().clone()
    opt.step(skip_models=torch.tensor([0.0, 1.0]))
    assert not torch.equal(fused.fc1.weight[0], before[0])
    assert torch.equal(fused.fc1.weight[1], before[1])


def test_backward_from_scaled_per_model_losses_names_the_sum_in_words():
    """The message read "take its.sum().backward()"."""
    fused = _fused()
    losses = hftc.per_model(F.cross_entropy)(fused(torch.randn(5, 4)),
                                             torch.randint(0, 3, (5,)))
    with pytest.raises(FusionArgumentError) as caught:
        (losses / 4).backward()
    assert "its.sum()" not in str(caught.value)
    assert "(...).sum().backward()" in str(caught.value)


@pytest.mark.parametrize("helper", ["BestCheckpoint", "EarlyStopping"])
def test_one_number_for_all_models_names_the_per_model_values(helper):
    """``best.update(val_loss.mean().item())``: was a bare "'float' object is not
    iterable"."""
    fused = _fused(3)
    tracker = (hftc.BestCheckpoint(fused) if helper == "BestCheckpoint"
               else hftc.EarlyStopping(fused, patience=2))
    record = tracker.update if helper == "BestCheckpoint" else tracker.step
    with pytest.raises(FusionArgumentError, match=r"one number per model \(3 models") as caught:
        record(0.5)
    assert __file__ in str(caught.value)


def test_calling_a_fused_submodule_names_what_to_call_instead():
    """``fused.features(x)`` (a torchvision habit) was a bare RuntimeError."""
    fused = _fused()
    with pytest.raises(hftc.errors.FusionNotImplementedError) as caught:
        fused.fc1(torch.randn(5, 4))
    message = str(caught.value)
    assert "fused.fc1(...)" in message and __file__ in message
    assert "hftc.fuse([m.fc1 for m in models])" in message
    assert "fused.unfuse_model(i).fc1(x)" in message
    assert isinstance(caught.value, RuntimeError)  # what it was


@pytest.mark.parametrize("init", ["kaiming_normal_", "xavier_uniform_", "orthogonal_"])
def test_a_shaped_init_of_a_stacked_weight_is_each_models_own(init):
    """``nn.init.kaiming_normal_(fused.fc1.weight)`` read the [N, out, in] weight's fan-in
    as out * in (a std sqrt(out) times too small) and orthogonal_ made one matrix of all
    N, silently; now it equals the loop over the models' own weights, bit for bit."""
    fused = _fused(3)
    torch.manual_seed(1)
    getattr(nn.init, init)(fused.fc1.weight)
    torch.manual_seed(1)
    want = torch.stack([getattr(nn.init, init)(torch.empty(8, 4)) for _ in range(3)])
    assert torch.equal(fused.fc1.weight.detach(), want)


def test_a_shaped_init_of_a_stacked_bias_is_refused_as_for_one_model():
    fused = _fused()
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        nn.init.xavier_uniform_(fused.fc1.bias)  # [N, 8]: torch's fan-in N otherwise


@pytest.mark.parametrize("fuse", [hftc.fuse, hftc.fuse_groups], ids=["fuse", "fuse_groups"])
def test_the_models_given_one_by_one_name_the_list(fuse):
    """``hftc.fuse(m0, m1, m2)``: was Python's bare "fuse() takes 1 positional argument
    but 3 were given"."""
    models = [Net() for _ in range(3)]
    with pytest.raises(FusionTypeError) as caught:
        fuse(*models)
    message = str(caught.value)
    assert f"hftc.{fuse.__name__}([m0, m1, ...])" in message and __file__ in message
    assert fuse(models)  # the list, as before


def test_one_input_per_model_as_n_arguments_names_with_in_dims():
    """``fused(x0, x1)`` (one input per model, each an argument) said only to call it as
    one model, not how to give each model its own."""
    fused = _fused()
    x = torch.randn(5, 4)
    with pytest.raises(FusionArgumentError) as caught:
        fused(x, x + 1)
    message = str(caught.value)
    assert "fused.with_in_dims(0)(torch.stack([x_0, ..., x_1]))" in message
    assert __file__ in message
    out = fused.with_in_dims(0)(torch.stack([x, x + 1]))
    torch.testing.assert_close(out[1], fused(x + 1)[1])


def _own_losses(fused):
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    return [F.cross_entropy(o, y) for o in fused(x)]


@pytest.mark.parametrize("backward", ["stacked", "one by one"])
def test_backward_from_the_models_own_losses_names_the_sum(backward):
    """``torch.stack(losses).backward()`` and ``for loss in losses: loss.backward()`` (each
    model's loss taken by the user, as N separate models would take them): were torch's
    bare "grad can be implicitly created only for scalar outputs" / "Trying to backward
    through the graph a second time"."""
    fused = _fused()
    losses = _own_losses(fused)
    with pytest.raises(FusionArgumentError) as caught:
        if backward == "stacked":
            torch.stack(losses).backward()
        else:
            for loss in losses:
                loss.backward()
    message = str(caught.value)
    assert "torch.stack(losses).sum().backward()" in message and __file__ in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_the_sum_of_the_models_own_losses_and_torchs_own_errors_stand():
    fused = _fused()
    torch.stack(_own_losses(fused)).sum().backward()  # what the message says: each its own
    model = nn.Linear(2, 1)
    loss = model(torch.randn(3, 2)).pow(2).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time") as caught:
        loss.backward()  # nothing of a fused module's: torch's error as it is
    assert not isinstance(caught.value, hftc.FusionError)


@pytest.mark.parametrize("flags", [[True, False], [True, False, True],
                                   torch.tensor([True, False, True])])
def test_keep_models_given_flags_is_refused_naming_the_indices(flags):
    """``hftc.keep_models(fused, [True, False])`` (a mask, as skip_models takes) read
    True as 1: models [1, 0] kept, swapped, silently (a full mask: "names model(s) [1]
    more than once")."""
    fused = _fused(3)
    before = fused.fc1.weight.detach().clone()
    with pytest.raises(FusionTypeError, match=r"not model indices.*enumerate\(flags\)"):
        hftc.keep_models(fused, flags)
    assert fused.model_ids == [0, 1, 2] and torch.equal(fused.fc1.weight, before)


@pytest.mark.parametrize(("given", "named"), [("epoch", "did you mean epochs="),
                                              ("n_trial", "did you mean n_trials="),
                                              ("storage", "--storage URL")])
def test_sweep_spec_given_no_field_names_the_field_meant(given, named):
    """``SweepSpec(..., epoch=3)``: was Python's bare "unexpected keyword argument", where
    the same name in a spec file is a SpecError naming the field."""
    import hftc.sweep

    def space(trial):
        return {"lr": trial.suggest_float("lr", 1e-3, 1.0)}

    with pytest.raises(hftc.errors.SpecError, match=named) as caught:
        hftc.sweep.SweepSpec(space=space, model=lambda params: Net(), data=lambda: None,
                             **{given: 3 if given != "storage" else "sqlite:///s.db"})
    assert __file__ in str(caught.value)


def test_compile_step_given_a_per_model_loss_takes_it_as_it_is():
    """``hftc.compile_step(fused, hftc.per_model(F.cross_entropy), opt)`` (the loss as the
    guides write it): was wrapped in per_model again and failed, reading each model's
    [B, C] output as B models."""
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    steps = []
    for loss_fn in (F.cross_entropy, hftc.per_model(F.cross_entropy)):
        fused = _fused(3)
        opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3])
        step = hftc.compile_step(fused, loss_fn, opt)
        steps.append((step(x, y), fused.fc1.weight.detach().clone()))
    (stock_losses, stock_weight), (given_losses, given_weight) = steps
    assert torch.equal(stock_losses, given_losses) and torch.equal(stock_weight, given_weight)


def test_a_sweep_spec_given_a_per_model_loss_says_to_give_one_models():
    """``loss = hftc.per_model(F.cross_entropy)`` in a spec (the loss as the guides write
    it): failed at the first batch, read each model's [B, C] output as B models, and named
    torch's functional.py as where the loss is defined."""
    import hftc.sweep

    with pytest.raises(hftc.errors.SpecError, match=r"spec\.loss is hftc\.per_model"
                                                     r"\(cross_entropy\).*F\.cross_entropy"):
        hftc.sweep.SweepSpec(space=lambda trial: {}, model=lambda params: Net(),
                             data=lambda: None, loss=hftc.per_model(F.cross_entropy))


class Tagger(nn.Module):
    """A tokenizer-fed model, forward(input_ids, attention_mask=None), as HF's."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.head(h.mean(1))


def test_a_batch_dict_given_as_one_input_names_fused_of_the_unpacked_batch():
    """``fused(batch)`` for ``fused(**batch)``: the error named only the Embedding's
    TypeError on a dict."""
    fused = hftc.fuse([Tagger() for _ in range(2)])
    batch = {"input_ids": torch.randint(0, 10, (3, 5)), "attention_mask": torch.ones(3, 5)}
    with pytest.raises(hftc.errors.TraceError, match=r"`input_ids` is a dict.*fused\(\*\*batch\)"):
        fused(batch)
    assert fused(**batch).shape == (2, 3, 2)
