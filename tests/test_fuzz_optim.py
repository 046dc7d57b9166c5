"""Property-based fuzzing of the fused optimizers against stock torch.optim.

One example: an optimizer class, N models of a few random parameter shapes (0-d to
3-d), each with random hyper-parameters of its own (every option the class has),
float32, float64, bfloat16, float16 or complex64, and a random run of steps with random gradients, where

* some models skip some steps (``step(skip_models=...)``; stock: that model does not step),
* some parameters get no gradient on some steps (``grad = None``: stock skips them),
* a model's learning rate or weight decay changes between steps (what a scheduler does),
* the optimizer is saved and loaded into a new one between steps (a resumed job),
* the models may first train alone with stock optimizers for different numbers of
  steps, which :func:`hftc.optim.fuse_optimizers` then continues (state included),
* Adam takes each of its update paths (``_foreach`` ops, one by one, in column blocks,
  ``fused=True``).

Model i's parameters and optimizer state must equal its stock run's bit for bit
(what the default update promises on the CPU), and so must ``fused=True``'s per-model
kernel calls; its one call over all models (they share every hyper-parameter but the
learning rate) is within a rounding of stock's.
``make fuzz`` runs it with random seeds (tests/fuzz_profiles.py).
"""

from __future__ import annotations

import contextlib
import io
from unittest import mock

import pytest
import torch
from fuzz_profiles import examples
from hypothesis import assume, given
from hypothesis import strategies as st
from optim_helpers import StackedModels, single_thread  # noqa: F401  (autouse fixture)
from torch import nn

import hftc.optim as ho
import hftc.optim.adam as adam_module
import hftc.optim.sgd as sgd_module

LRS = st.sampled_from([1e-3, 1e-2, 0.1, 0.5])
WEIGHT_DECAYS = st.sampled_from([0.0, 0.0, 1e-3, 0.1])
EPS = st.sampled_from([1e-8, 1e-6, 1e-3])
BETAS = st.sampled_from([(0.9, 0.999), (0.8, 0.99), (0.5, 0.9), (0.0, 0.99)])


@st.composite
def sgd_config(draw):
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
    nesterov = momentum > 0 and draw(st.booleans())  # stock: nesterov needs dampening 0
    return dict(lr=draw(LRS), momentum=momentum, nesterov=nesterov,
                dampening=0.0 if nesterov else draw(st.sampled_from([0.0, 0.3])),
                weight_decay=draw(WEIGHT_DECAYS), maximize=draw(st.booleans()))


@st.composite
def adam_config(draw, decoupled_choice=True):
    config = dict(lr=draw(LRS), betas=draw(BETAS), eps=draw(EPS),
                  weight_decay=draw(WEIGHT_DECAYS), amsgrad=draw(st.booleans()),
                  maximize=draw(st.booleans()))
    if decoupled_choice:
        config["decoupled_weight_decay"] = draw(st.booleans())
    return config


@st.composite
def rmsprop_config(draw):
    return dict(lr=draw(LRS), alpha=draw(st.sampled_from([0.99, 0.9, 0.5])), eps=draw(EPS),
                weight_decay=draw(WEIGHT_DECAYS), momentum=draw(st.sampled_from([0.0, 0.5, 0.9])),
                centered=draw(st.booleans()), maximize=draw(st.booleans()))


@st.composite
def adagrad_config(draw):
    return dict(lr=draw(LRS), lr_decay=draw(st.sampled_from([0.0, 0.01, 0.5])),
                weight_decay=draw(WEIGHT_DECAYS),
                initial_accumulator_value=draw(st.sampled_from([0.0, 0.1, 1.0])),
                eps=draw(st.sampled_from([1e-10, 1e-6])), maximize=draw(st.booleans()))


@st.composite
def adadelta_config(draw):
    return dict(lr=draw(st.sampled_from([1.0, 0.5, 0.1, 1e-2])),
                rho=draw(st.sampled_from([0.9, 0.95, 0.5, 0.0, 1.0])),
                eps=draw(st.sampled_from([1e-6, 1e-3])), weight_decay=draw(WEIGHT_DECAYS),
                maximize=draw(st.booleans()))


@st.composite
def adamax_config(draw):
    return dict(lr=draw(LRS), betas=draw(BETAS), eps=draw(EPS),
                weight_decay=draw(WEIGHT_DECAYS), maximize=draw(st.booleans()))


#: NAdam's and RAdam's stock foreach and for-loop updates round differently: each model
#: takes its own (set in its param group, as fuse_optimizers does).
FOREACH = st.sampled_from([None, True, False])


@st.composite
def nadam_config(draw):
    return dict(lr=draw(LRS), betas=draw(BETAS), eps=draw(EPS),
                weight_decay=draw(WEIGHT_DECAYS),
                momentum_decay=draw(st.sampled_from([4e-3, 0.0, 0.1])),
                decoupled_weight_decay=draw(st.booleans()), maximize=draw(st.booleans()),
                foreach=draw(FOREACH))


@st.composite
def radam_config(draw):
    # beta2 0.5 and 0.9: never rectified (rho_inf = 3) and rectified from step 6 on.
    betas = draw(BETAS | st.sampled_from([(0.9, 0.5), (0.9, 0.9)]))
    return dict(lr=draw(LRS), betas=betas, eps=draw(EPS), weight_decay=draw(WEIGHT_DECAYS),
                decoupled_weight_decay=draw(st.booleans()), maximize=draw(st.booleans()),
                foreach=draw(FOREACH))


# name -> (fused class, stock class, one model's stock keyword arguments)
OPTIMIZERS = {
    "sgd": (ho.SGD, torch.optim.SGD, sgd_config()),
    "adam": (ho.Adam, torch.optim.Adam, adam_config()),
    "adamw": (ho.AdamW, torch.optim.AdamW, adam_config(decoupled_choice=False)),
    "rmsprop": (ho.RMSprop, torch.optim.RMSprop, rmsprop_config()),
    "adagrad": (ho.Adagrad, torch.optim.Adagrad, adagrad_config()),
    "adadelta": (ho.Adadelta, torch.optim.Adadelta, adadelta_config()),
    "adamax": (ho.Adamax, torch.optim.Adamax, adamax_config()),
    "nadam": (ho.NAdam, torch.optim.NAdam, nadam_config()),
    "radam": (ho.RAdam, torch.optim.RAdam, radam_config()),
}

SHAPES = st.lists(st.lists(st.integers(1, 5), max_size=3).map(tuple), min_size=1, max_size=3)


class Parameters(nn.Module):
    """One model: only parameters, of the given shapes (the optimizer never runs it)."""

    def __init__(self, shapes, generator: torch.Generator, dtype: torch.dtype):
        super().__init__()
        for k, shape in enumerate(shapes):
            self.register_parameter(f"p{k}", nn.Parameter(
                torch.randn(shape, generator=generator, dtype=dtype)))


@st.composite
def runs(draw):
    """One example: everything the docstring lists, as plain data."""
    name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    n = draw(st.integers(1, 4))
    configs = [draw(OPTIMIZERS[name][2]) for _ in range(n)]
    shapes = draw(SHAPES)
    steps = draw(st.integers(1, 5))
    step = st.fixed_dictionaries({
        "skip": st.lists(st.booleans(), min_size=n, max_size=n) | st.none(),
        "no_grad": st.sets(st.integers(0, len(shapes) - 1), max_size=len(shapes) - 1),
        "change": st.none() | st.tuples(st.integers(0, n - 1),
                                        st.sampled_from(["lr", "weight_decay"]),
                                        st.sampled_from([0.0, 1e-3, 0.05, 0.3])),
        "scale": st.sampled_from([1e-3, 1.0, 100.0]),
        "reload": st.sampled_from([False, False, False, True]),
    })
    return {
        "name": name, "configs": configs, "shapes": shapes,
        "dtype": draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16,
                                       torch.float16, torch.complex64])),
        "solo_steps": draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
        "steps": [draw(step) for _ in range(steps)],
        "adam_path": draw(st.sampled_from(["default", "one_by_one", "blocks", "fused"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@contextlib.contextmanager
def adam_path(path: str):
    """Send every parameter down one of Adam's update paths (the sizes that pick one);
    "blocks" sends SGD's common step down its column blocks too."""
    patches = {"default": {}, "fused": {},
               "one_by_one": {"_FOREACH_MAX_NUMEL": 0},
               "blocks": {"_FOREACH_MAX_NUMEL": 0, "_BLOCK_ABOVE": 0, "_BLOCK_NUMEL": 1}}[path]
    with contextlib.ExitStack() as stack:
        for attr, value in patches.items():
            stack.enter_context(mock.patch.object(adam_module, attr, value))
        if path == "blocks":
            for attr, value in {"_FOREACH_MAX_NUMEL": 0, "_BLOCK_NUMEL": 1}.items():
                stack.enter_context(mock.patch.object(sgd_module, attr, value))
        yield


def one_kernel_call_for_all_models(opt: ho.Adam) -> bool:
    """``fused=True`` runs one kernel call over the stacked tensors when the models share
    every hyper-parameter but the learning rate: within a rounding of stock's calls, one
    per model (a model's elements fall in the kernel's vector body or its scalar tail)."""
    hp = opt.hyperparameters()
    return all(len(set(map(str, hp[k]))) == 1 for k in hp if k != "lr")


def assert_model_equals_stock(fused: nn.Module, opt, i: int, solo: nn.Module, stock, exact: bool,
                              context) -> None:
    """Model i's parameter slices and optimizer state equal its stock run's."""
    params = dict(fused.named_parameters())
    for name, p in solo.named_parameters():
        pairs = [("param", params[name][i], p)]
        stock_state, state = stock.state.get(p, {}), opt.state[params[name]]
        for key, value in stock_state.items():
            if key == "step":
                pairs.append((key, state[key][i].to(value.dtype), value))
            elif isinstance(value, torch.Tensor):
                pairs.append((key, state[key][i], value))
        for what, mine, theirs in pairs:
            if exact:  # NaN where stock has NaN (a float16 moment past 65504)
                same = mine.shape == theirs.shape and bool(
                    ((mine == theirs) | (mine.isnan() & theirs.isnan())).all())
            else:  # one kernel call for all models: a rounding of the update per step
                rtol = {torch.float32: 1e-5, torch.float64: 1e-13}.get(theirs.dtype, 1e-2)
                same = torch.allclose(mine, theirs, rtol=rtol, atol=rtol, equal_nan=True)
            assert same, (f"model {i}, {name}, {what}: max |diff| "
                          f"{(mine.double() - theirs.double()).abs().max().item():.3g}", context)


@examples(ci=250)  # nine optimizer classes: ~28 examples each
@given(run=runs())
def test_random_runs_of_fused_optimizers_equal_stock(run):
    fused_cls, stock_cls, _ = OPTIMIZERS[run["name"]]
    configs, dtype, n = run["configs"], run["dtype"], len(run["configs"])
    use_fused = run["name"] in ("adam", "adamw") and run["adam_path"] == "fused"
    assume(not (use_fused and dtype.is_complex))  # stock's fused kernels take no complex
    if use_fused:
        configs = [dict(c, fused=True) for c in configs]
    g = torch.Generator().manual_seed(run["seed"])
    solos = [Parameters(run["shapes"], g, dtype) for _ in range(n)]
    stock = [stock_cls(s.parameters(), **c) for s, c in zip(solos, configs)]

    def stock_step(i: int, grads: list[torch.Tensor | None]) -> None:
        for p, grad in zip(solos[i].parameters(), grads):
            p.grad = None if grad is None else grad.clone()
        stock[i].step()

    def random_grads(scale: float, no_grad=frozenset()) -> list[torch.Tensor | None]:
        """One gradient per parameter, ``[N, *shape]`` (None where it has none)."""
        return [None if k in no_grad else
                scale * torch.randn((n, *p.shape), generator=g, dtype=dtype)
                for k, p in enumerate(solos[0].parameters())]

    # Each model alone first, for its own number of steps; fuse_optimizers continues them.
    convert = any(run["solo_steps"]) and not use_fused  # fused=True is a kernel, not state
    if convert:
        for i, count in enumerate(run["solo_steps"]):
            for _ in range(count):
                stock_step(i, [grad[i] for grad in random_grads(1.0)])
    fused = StackedModels(solos)
    with adam_path(run["adam_path"]):
        keys = sorted(set().union(*configs) - {"fused", "foreach"})
        per_model = {k: [c[k] for c in configs] for k in keys}

        def new_optimizer():
            opt = fused_cls(fused.parameters(), **per_model,
                            **({"fused": True} if use_fused else {}))
            for group, config in zip(opt.param_groups, configs):
                if "foreach" in config:  # one per model, as fuse_optimizers sets it
                    group["foreach"] = config["foreach"]
            return opt

        opt = ho.fuse_optimizers(fused, stock) if convert else new_optimizer()
        exact = True
        for k, step in enumerate(run["steps"]):
            grads = random_grads(step["scale"], step["no_grad"])
            for p, grad in zip(fused.parameters(), grads):
                p.grad = None if grad is None else grad.clone()
            # One rounding apart once, apart from then on (the state carries it).
            exact = exact and not (use_fused and one_kernel_call_for_all_models(opt))
            opt.step(skip_models=step["skip"])
            for i in range(n):
                if not (step["skip"] and step["skip"][i]):
                    stock_step(i, [None if grad is None else grad[i] for grad in grads])
            for i, solo in enumerate(solos):
                assert_model_equals_stock(fused, opt, i, solo, stock[i], exact, (k, run))
            if step["change"] is not None:
                i, key, value = step["change"]
                opt.param_groups[i][key] = value
                stock[i].param_groups[0][key] = value
            if step["reload"]:  # a checkpoint, loaded by a job that builds it anew
                saved = io.BytesIO()
                torch.save(opt.state_dict(), saved)
                saved.seek(0)
                opt = new_optimizer()
                opt.load_state_dict(torch.load(saved))


def test_the_fuzzer_catches_a_wrong_update():
    """The comparison is not vacuous: a fused Adam whose model 1 has a learning rate off
    by one part in 10^6 fails it."""
    g = torch.Generator().manual_seed(0)
    solos = [Parameters([(3, 2)], g, torch.float32) for _ in range(2)]
    stock = [torch.optim.Adam(s.parameters(), lr=1e-2) for s in solos]
    fused = StackedModels(solos)
    opt = ho.Adam(fused.parameters(), lr=[1e-2, 1e-2 * (1 + 1e-6)])
    grad = torch.randn(2, 3, 2, generator=g)
    fused.p0.grad = grad.clone()
    opt.step()
    for i, solo in enumerate(solos):
        solo.p0.grad = grad[i].clone()
        stock[i].step()
    assert_model_equals_stock(fused, opt, 0, solos[0], stock[0], True, "model 0 is right")
    with pytest.raises(AssertionError, match="model 1, p0, param"):
        assert_model_equals_stock(fused, opt, 1, solos[1], stock[1], True, "model 1 is off")
