"""Stock ``torch.optim`` optimizers on a fused module's stacked parameters.

Elementwise ones (each element's update reads only its own gradient and state) train
each of the N models as it trains alone; the ones that reduce over a parameter or over
all of them (LBFGS, Adafactor, Muon) would couple the models, silently, and are refused
with a ``FusionArgumentError`` naming the parameter and what to use.  ``hftc.optim.LBFGS``
runs one stock L-BFGS per model (its own line search) and matches N separate runs.
"""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from optim_helpers import StackedModels, single_thread  # noqa: F401  (autouse fixture)
from torch import nn

import hftc
import hftc.optim as ho
from hftc.errors import FusionArgumentError
from hftc.lowering.runtime.modules import register_fused


def make_mlp(seed: int, batch_norm: bool = False, out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 5)] + ([nn.BatchNorm1d(5)] if batch_norm else [])
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(5, out)).double()


def batches(steps: int = 3, regression: bool = False, batch: int = 16):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 6, generator=g, dtype=torch.float64)
        y = (torch.randn(batch, 1, generator=g, dtype=torch.float64) if regression
             else torch.randint(0, 3, (batch,), generator=g))
        out.append((x, y))
    return out


# ------------------------------------------------------------------ elementwise: they work

ELEMENTWISE = {
    "SGD": dict(lr=0.1, momentum=0.9), "Adam": dict(lr=1e-2), "AdamW": dict(lr=1e-2),
    "RMSprop": dict(lr=1e-2, centered=True, momentum=0.5), "Adagrad": dict(lr=0.1),
    "Adadelta": dict(lr=1.0), "Adamax": dict(lr=1e-2), "NAdam": dict(lr=1e-2),
    "RAdam": dict(lr=1e-2), "ASGD": dict(lr=0.05, t0=1), "Rprop": dict(lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_stock_optimizers_train_each_fused_model_as_alone(name):
    # The ground for refusing only the others: measured on every torch.optim class.
    cls, kwargs = getattr(torch.optim, name), ELEMENTWISE[name]
    models = [make_mlp(s) for s in range(3)]
    solos = copy.deepcopy(models)
    fused = hftc.fuse(models)
    opt = cls(fused.parameters(), **kwargs)
    loss_fn = hftc.per_model(F.cross_entropy)
    data = batches(4)
    for x, y in data:
        opt.zero_grad()
        loss_fn(fused(x), y).sum().backward()
        opt.step()
    params = dict(fused.named_parameters())
    for i, solo in enumerate(solos):
        stock = cls(solo.parameters(), **kwargs)
        for x, y in data:
            stock.zero_grad()
            F.cross_entropy(solo(x), y).backward()
            stock.step()
        for key, p in solo.named_parameters():
            torch.testing.assert_close(params[key][i], p, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ coupling: refused

COUPLING = ["LBFGS", "Adafactor", "Muon"]
WHAT_TO_USE = {"LBFGS": r"hftc\.optim\.LBFGS", "Adafactor": r"hftc\.optim\.Adam",
               "Muon": r"fused\.unfuse\(\)"}


def fused_mlp():
    return hftc.fuse([make_mlp(s) for s in range(3)])


@pytest.mark.parametrize("name", COUPLING)
@pytest.mark.parametrize("form", ["parameters", "named", "bias_group"])
def test_coupling_stock_optimizers_are_refused_on_fused_parameters(name, form):
    fused = fused_mlp()
    params = {"parameters": lambda: fused.parameters(),
              "named": lambda: fused.named_parameters(),
              "bias_group": lambda: [{"params": [fused.get_parameter("2.bias")]}]}[form]()
    shown = "'2.bias' (shape [3, 3]" if form == "bias_group" else "'0.weight' (shape [3, 5, 6]"
    with pytest.raises(FusionArgumentError, match=re.escape(
            f"torch.optim.{name} cannot optimize a fused module's stacked parameter {shown}: "
            f"3 models")) as e:
        getattr(torch.optim, name)(params)
    assert e.match(WHAT_TO_USE[name])
    assert e.match(r"fused\.unfuse\(\)")


def test_lbfgs_refusal_names_why_and_covers_subclasses_and_added_groups():
    fused = fused_mlp()

    class MyLBFGS(torch.optim.LBFGS):
        pass

    with pytest.raises(FusionArgumentError, match=r"MyLBFGS \(a torch\.optim\.LBFGS\).*"
                       r"line search.*hftc\.optim\.LBFGS\(fused\.parameters\(\)"):
        MyLBFGS(fused.parameters())
    adafactor = torch.optim.Adafactor([torch.zeros(3, requires_grad=True)])
    with pytest.raises(FusionArgumentError, match="Adafactor cannot optimize"):
        adafactor.add_param_group({"params": list(fused.parameters())})
    assert len(adafactor.param_groups) == 1  # left as it was


def test_coupling_optimizers_still_take_plain_parameters():
    model = make_mlp(0)
    for name in COUPLING:
        params = [p for p in model.parameters() if p.dim() == 2] if name == "Muon" \
            else model.parameters()
        getattr(torch.optim, name)(params)


def test_stock_lbfgs_on_stacked_parameters_does_couple_the_models():
    # Why it is refused: on stacked parameters hftc does not know of (StackedModels is
    # not registered), stock LBFGS's steps differ from three separate runs by far.
    models = [make_mlp(s) for s in range(3)]
    solos = copy.deepcopy(models)
    stacked = StackedModels(models)
    opt = torch.optim.LBFGS(stacked.parameters(), lr=0.5, max_iter=3)
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        out = stacked(x)
        loss = sum(F.cross_entropy(out[i], y) for i in range(3))
        loss.backward()
        return loss

    opt.step(closure)
    stock = torch.optim.LBFGS(solos[0].parameters(), lr=0.5, max_iter=3)

    def solo_closure():
        stock.zero_grad()
        loss = F.cross_entropy(solos[0](x), y)
        loss.backward()
        return loss

    stock.step(solo_closure)
    assert (stacked.get_parameter("0.weight")[0] - solos[0][0].weight).abs().max() > 1e-3


# ------------------------------------------------------------------ hftc.optim.LBFGS


class StackedWithBuffers(StackedModels):
    """``StackedModels`` with the models' buffers stacked too (batch norm's statistics,
    written by each model's call) and registered as a fused module is, so that
    ``hftc.optim.LBFGS`` finds them.  Each model runs alone on its slices: its gradients
    are exactly its own, so the optimizers can be compared bit for bit."""

    def __init__(self, models):
        super().__init__(models)
        self._buffer_names = [name for name, _ in models[0].named_buffers()]
        for name in self._buffer_names:
            stacked = torch.stack([dict(m.named_buffers())[name] for m in models]).clone()
            self.register_buffer(name.replace(".", "__"), stacked)
        register_fused(self)

    def model_buffers(self, i: int) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name.replace(".", "__"))[i] for name in self._buffer_names}

    def forward(self, x):
        outs = [torch.func.functional_call(
            self._template[0], {**self.model_parameters(i), **self.model_buffers(i)}, (x,))
            for i in range(self.num_models)]
        return torch.stack(outs)


def run_fused_lbfgs(fused, data, regression=False, **kwargs):
    opt = ho.LBFGS(fused.parameters(), **kwargs)
    loss_fn = F.mse_loss if regression else F.cross_entropy
    for x, y in data:
        def closure(x=x, y=y):
            opt.zero_grad()
            out = fused(x)
            losses = torch.stack([loss_fn(out[i], y) for i in range(out.shape[0])])
            losses.sum().backward()
            return losses
        opt.step(closure)
    return opt


def run_stock_lbfgs(model, data, regression=False, **kwargs):
    opt = torch.optim.LBFGS(model.parameters(), **kwargs)
    loss_fn = F.mse_loss if regression else F.cross_entropy
    for x, y in data:
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    return opt.state[opt.param_groups[0]["params"][0]]["func_evals"]


LBFGS_CASES = [dict(lr=0.5), dict(lr=1, line_search_fn="strong_wolfe"),
               dict(lr=0.8, max_iter=7, history_size=3),
               dict(lr=1, max_iter=6, line_search_fn="strong_wolfe", tolerance_change=1e-4)]


@pytest.mark.parametrize("kwargs", LBFGS_CASES, ids=[str(k) for k in LBFGS_CASES])
@pytest.mark.parametrize("batch_norm", [False, True])
def test_hftc_lbfgs_is_stock_lbfgs_per_model_bit_for_bit(kwargs, batch_norm):
    models = [make_mlp(s, batch_norm) for s in range(3)]
    solos = copy.deepcopy(models)
    fused = StackedWithBuffers(models)
    data = batches(3)
    opt = run_fused_lbfgs(fused, data, **kwargs)
    evals = [run_stock_lbfgs(solo, data, **kwargs) for solo in solos]
    fused_evals = [m.state[m.param_groups[0]["params"][0]]["func_evals"] for m in opt._models]
    assert fused_evals == evals
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            assert torch.equal(fused.get_parameter(name)[i], p), (i, name)
        for name, b in solo.named_buffers():  # extra calls while it waited: put back
            assert torch.equal(fused.model_buffers(i)[name], b), (i, name)


def test_hftc_lbfgs_models_that_stop_at_different_times():
    # Models whose line searches take different numbers of evaluations: while one
    # waits, the shared closure calls leave its parameters and statistics alone.
    models = [make_mlp(s, batch_norm=True) for s in range(3)]
    solos = copy.deepcopy(models)
    fused = StackedWithBuffers(models)
    data = batches(3)
    per_model = dict(lr=[1.0, 0.3, 1.0], max_iter=[20, 4, 9],
                     line_search_fn=["strong_wolfe", None, "strong_wolfe"])
    run_fused_lbfgs(fused, data, **per_model)
    evals = [run_stock_lbfgs(solo, data, **{k: v[i] for k, v in per_model.items()})
             for i, solo in enumerate(solos)]
    assert len(set(evals)) == 3, evals
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            assert torch.equal(fused.get_parameter(name)[i], p), (i, name)
        for name, b in solo.named_buffers():
            assert torch.equal(fused.model_buffers(i)[name], b), (i, name)


@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_hftc_lbfgs_on_a_fused_module_matches_separate_runs(line_search_fn):
    models = [make_mlp(s, out=1) for s in range(3)]
    solos = copy.deepcopy(models)
    fused = hftc.fuse(models)
    data = batches(3, regression=True, batch=64)
    kwargs = dict(lr=0.8, max_iter=7, history_size=3, line_search_fn=line_search_fn)
    run_fused_lbfgs(fused, data, regression=True, **kwargs)
    for i, solo in enumerate(solos):
        run_stock_lbfgs(solo, data, regression=True, **kwargs)
        for name, p in solo.named_parameters():  # the fused forward's roundings only
            torch.testing.assert_close(fused.get_parameter(name)[i], p, rtol=0, atol=1e-10)


def test_hftc_lbfgs_state_dict_continues_exactly():
    data = batches(3)
    straight = StackedModels([make_mlp(s) for s in range(2)])
    run_fused_lbfgs(straight, data, lr=1, line_search_fn="strong_wolfe")
    resumed = StackedModels([make_mlp(s) for s in range(2)])
    first = run_fused_lbfgs(resumed, data[:2], lr=1, line_search_fn="strong_wolfe")
    saved = first.state_dict()
    second = ho.LBFGS(resumed.parameters(), lr=1, line_search_fn="strong_wolfe")
    second.load_state_dict(saved)
    x, y = data[2]

    def closure():
        second.zero_grad()
        out = resumed(x)
        losses = torch.stack([F.cross_entropy(out[i], y) for i in range(2)])
        losses.sum().backward()
        return losses

    second.step(closure)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_hftc_lbfgs_refuses_a_summed_loss():
    fused = fused_mlp()
    opt = ho.LBFGS(fused.parameters())
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in fused.parameters()]

    def closure():
        opt.zero_grad()
        loss = hftc.per_model(F.cross_entropy)(fused(x), y).sum()
        loss.backward()
        return loss

    with pytest.raises(FusionArgumentError, match=r"the closure returned a tensor of shape "
                       r"\[\]; it must return the 3 per-model losses"):
        opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, fused.parameters()))


def test_hftc_lbfgs_takes_torchs_arguments_in_torchs_order():
    def positional(cls):
        return [(k, p.default) for k, p in inspect.signature(cls).parameters.items()
                if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional(ho.LBFGS) == positional(torch.optim.LBFGS)
    fused = fused_mlp()
    opt = ho.LBFGS(fused.parameters(), 0.5, 7, None, 1e-7, 1e-9, 3, "strong_wolfe")
    assert opt.param_groups[2]["lr"] == 0.5 and opt.param_groups[2]["max_eval"] == 8
    assert opt.param_groups[1]["line_search_fn"] == "strong_wolfe"
    with pytest.raises(FusionArgumentError, match="lr has 2 values but there are 3 models"):
        ho.LBFGS(fused.parameters(), lr=[1, 2])
