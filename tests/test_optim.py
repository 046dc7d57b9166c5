"""Fused optimizers vs stock torch.optim, model by model.

Every test trains N models fused (one stacked update, per-model hyper-parameters)
and each model alone with its stock optimizer, then asserts that model i's slice
equals the solo model (float64: relative difference <= 1e-9, float32: <= 1e-4).
The fused module here is ``StackedModels`` (exact per-model gradients), so a
failure points at the optimizer; tests/test_optim_fuse.py runs ``hftc.fuse``.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from optim_helpers import (
    StackedModels,
    assert_all_match,
    make_batches,
    make_models,
    per_model_losses,
    single_thread,  # noqa: F401  (autouse fixture)
    tolerance,
    train_fused,
    train_solo,
)

import hftc.optim as ho
import hftc.optim.adam as adam_module
import hftc.optim.coefficients as coefficients_module
import hftc.optim.sgd as sgd_module
from hftc.errors import FusionArgumentError

# name -> (fused class, stock class, one stock kwargs dict per model)
CASES = {
    "sgd": (ho.SGD, torch.optim.SGD, [
        dict(lr=0.1),
        dict(lr=0.05, momentum=0.9),
        dict(lr=0.02, momentum=0.5, dampening=0.3, weight_decay=0.01),
        dict(lr=0.03, momentum=0.9, nesterov=True, weight_decay=1e-3),
    ]),
    "sgd_maximize": (ho.SGD, torch.optim.SGD, [
        dict(lr=0.1, maximize=True),
        dict(lr=0.05, momentum=0.9, maximize=True, weight_decay=0.1),
        dict(lr=0.02, momentum=0.9, nesterov=True),
    ]),
    # Every model with a momentum (per-model values), nesterov for none / for all: the
    # common step (hftc.optim.sgd._SGDStep), after each model's first step.
    "sgd_momentum": (ho.SGD, torch.optim.SGD, [
        dict(lr=0.1, momentum=0.9),
        dict(lr=0.05, momentum=0.5, dampening=0.3, weight_decay=0.01),
        dict(lr=0.02, momentum=0.8, weight_decay=1e-3, maximize=True),
    ]),
    "sgd_nesterov": (ho.SGD, torch.optim.SGD, [
        dict(lr=0.1, momentum=0.9, nesterov=True),
        dict(lr=0.03, momentum=0.5, nesterov=True, weight_decay=0.01, maximize=True),
    ]),
    "sgd_plain": (ho.SGD, torch.optim.SGD, [
        dict(lr=0.1), dict(lr=0.05, weight_decay=0.01), dict(lr=0.02, maximize=True),
    ]),
    "adam": (ho.Adam, torch.optim.Adam, [
        dict(lr=1e-2),
        dict(lr=3e-2, betas=(0.8, 0.99), amsgrad=True),
        dict(lr=1e-3, weight_decay=0.1, eps=1e-6),
        dict(lr=5e-3, betas=(0.5, 0.9), maximize=True, amsgrad=True, weight_decay=0.01),
    ]),
    # Neither amsgrad nor maximize: the foreach update of small parameters.
    "adam_plain": (ho.Adam, torch.optim.Adam, [
        dict(lr=1e-2),
        dict(lr=3e-2, betas=(0.8, 0.99), weight_decay=0.1),
        dict(lr=1e-3, eps=1e-6),
    ]),
    "adam_decoupled_mixed": (ho.Adam, torch.optim.Adam, [
        dict(lr=1e-2, weight_decay=0.1),
        dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
        dict(lr=3e-2, weight_decay=0.0, decoupled_weight_decay=True),
    ]),
    "adamw": (ho.AdamW, torch.optim.AdamW, [
        dict(lr=1e-2),
        dict(lr=3e-2, betas=(0.8, 0.99), amsgrad=True, weight_decay=0.1),
        dict(lr=1e-3, weight_decay=0.0, eps=1e-6, maximize=True),
    ]),
    "rmsprop": (ho.RMSprop, torch.optim.RMSprop, [
        dict(lr=1e-2),
        dict(lr=3e-3, momentum=0.9),
        dict(lr=1e-3, alpha=0.9, weight_decay=0.1, centered=True),
        dict(lr=5e-3, momentum=0.5, centered=True, eps=1e-4, maximize=True),
    ]),
    # No model with momentum: the update ends in addcdiv_ with each model's -lr.
    "rmsprop_plain": (ho.RMSprop, torch.optim.RMSprop, [
        dict(lr=1e-2),
        dict(lr=3e-3, alpha=0.9, centered=True),
        dict(lr=1e-3, weight_decay=0.1, eps=1e-4),
    ]),
    "adagrad": (ho.Adagrad, torch.optim.Adagrad, [
        dict(lr=1e-2),
        dict(lr=3e-2, lr_decay=0.01, initial_accumulator_value=0.1),
        dict(lr=1e-1, weight_decay=0.1, eps=1e-6, maximize=True),
    ]),
    # pytorch/examples' MNIST and siamese networks: Adadelta(lr=1.0) and StepLR(gamma=0.7).
    "adadelta": (ho.Adadelta, torch.optim.Adadelta, [
        dict(lr=1.0),
        dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=0.1),
        dict(lr=0.1, rho=0.95, weight_decay=0.01, maximize=True),
    ]),
    "adamax": (ho.Adamax, torch.optim.Adamax, [
        dict(lr=2e-3),
        dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        dict(lr=5e-3, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.01, maximize=True),
    ]),
    "nadam": (ho.NAdam, torch.optim.NAdam, [
        dict(lr=2e-3),
        dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, momentum_decay=1e-2),
        dict(lr=5e-3, weight_decay=0.1, decoupled_weight_decay=True, maximize=True),
        dict(lr=3e-3, betas=(0.5, 0.9), eps=1e-6, momentum_decay=0.0),
    ]),
    # beta2 = 0.5: rho_inf = 3, never rectified, while the others are from step 6 on.
    "radam": (ho.RAdam, torch.optim.RAdam, [
        dict(lr=1e-3),
        dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        dict(lr=5e-3, weight_decay=0.1, decoupled_weight_decay=True, maximize=True),
        dict(lr=3e-3, betas=(0.9, 0.5), eps=1e-6),
    ]),
}
#: The classes added with hftc.optim.Adadelta/Adamax/NAdam/RAdam.
NEW_CASES = ["adadelta", "adamax", "nadam", "radam"]

DTYPES = [torch.float64, torch.float32]


def fused_kwargs(stock_cls, configs: list[dict]) -> dict:
    """Per-model lists for the fused constructor, filling in the stock defaults."""
    defaults = {k: p.default for k, p in inspect.signature(stock_cls).parameters.items()}
    keys = sorted(set().union(*configs))
    return {k: [c.get(k, defaults[k]) for c in configs] for k in keys}


def run_case(case: str, dtype: torch.dtype, steps: int = 10):
    fused_cls, stock_cls, configs = CASES[case]
    n = len(configs)
    models = make_models(n, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = fused_cls(fused.parameters(), **fused_kwargs(stock_cls, configs))
    batches = make_batches(steps, dtype)
    train_fused(fused, opt, batches)
    for solo, config in zip(solos, configs):
        train_solo(solo, stock_cls(solo.parameters(), **config), batches)
    return fused, opt, solos


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_model_matches_its_stock_run(case, dtype):
    fused, _, solos = run_case(case, dtype)
    assert_all_match(fused, solos, tolerance(dtype))


@pytest.mark.parametrize("case", ["sgd", "adam", "rmsprop", *NEW_CASES])
def test_matches_stock_bit_for_bit_on_cpu(case):
    # The update repeats stock's ops with the same rounding, so on the CPU the
    # result is identical, not just close. (A GPU may round x*c+y differently.)
    assert_stock_bit_for_bit(case, torch.float64)
    if case in NEW_CASES:
        assert_stock_bit_for_bit(case, torch.float32)


def assert_stock_bit_for_bit(case: str, dtype: torch.dtype) -> None:
    """Train ``case`` fused and solo; every model's slice must equal its solo run exactly
    (NaN where the solo run has NaN: float16's eps of 1e-8 rounds to 0)."""
    fused, _, solos = run_case(case, dtype)
    params = dict(fused.named_parameters())
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            where = f"{case} {dtype} model {i} {name}"
            torch.testing.assert_close(params[name][i], p, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, where=where: f"{where}: {m}")


def randn(shape, g: torch.Generator, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """Normal values of ``dtype`` (complex ones with an imaginary part of their own)."""
    draw_dtype = dtype if dtype.is_complex else torch.float32
    return torch.randn(shape, generator=g, dtype=draw_dtype).to(device, dtype)


def stacked_and_solos(n: int, width: int, dtype=torch.float32, device="cpu", seed: int = 0):
    """One stacked ``[n, width]`` parameter and n solo copies of its rows, and the
    generator the gradients are drawn from."""
    g = torch.Generator().manual_seed(seed)
    start = randn((n, width), g, dtype, device)
    solos = [torch.nn.Parameter(start[i].clone()) for i in range(n)]
    return torch.nn.Parameter(start.clone()), solos, g


def step_alongside_stock(opt, fused, stock, solos, g, steps: int, before_step=None) -> None:
    """``steps`` steps of the fused optimizer over ``fused`` and of each model's stock
    optimizer over its solo copy, fed the same random gradients (``before_step(k)``
    first: a scheduler's change)."""
    for k in range(steps):
        if before_step is not None:
            before_step(k)
        grad = randn(fused.shape, g, fused.dtype, fused.device)
        fused.grad = grad.clone()
        opt.step()
        for i, solo in enumerate(solos):
            solo.grad = grad[i].clone()
            stock[i].step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_half_precision_parameters_step_as_stock_bit_for_bit(case, dtype):
    # A half type's kernels take a scalar alpha in float32 and round once; per-model
    # coefficient tensors in the parameter's dtype were rounded first (SGD with lr=0.1 in
    # bfloat16 was off stock from its first step).  Half parameters take each model's
    # stock update on its slices.
    assert_stock_bit_for_bit(case, dtype)


def test_half_precision_capturable_on_the_cpu_is_refused_as_stock_refuses_it():
    p = torch.nn.Parameter(torch.randn(2, 5).to(torch.bfloat16))
    p.grad = torch.randn(2, 5).to(torch.bfloat16)
    opt = ho.Adam([p], lr=[1e-3, 2e-3], capturable=True)
    with pytest.raises(FusionArgumentError, match=r"capturable=True.*bfloat16.*Drop"):
        opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.complex64, torch.float32], ids=str)
def test_steps_of_stock_updated_dtypes_are_not_offered_for_capture(dtype):
    # compile_step captures an optimizer step only where is_capturable says so; a half or
    # complex parameter's stock update reads its values on the host, so it runs after
    # the graph instead.
    p = torch.nn.Parameter(torch.zeros(2, 5, dtype=dtype))
    q = torch.nn.Parameter(torch.zeros(2, 3))
    opt = ho.Adam([q, p], lr=[1e-3, 2e-3], capturable=True)
    assert opt._capturable()
    assert opt.is_capturable is (dtype == torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_sgd_momentum_switched_on_later_starts_like_stock(dtype):
    # No momentum buffer until a scheduler turns momentum on for model 1 only: its first
    # step with it starts the buffer from the gradient (stock's clone), model 0 has none.
    fused, solos, g = stacked_and_solos(2, 70, dtype)
    opt = ho.SGD([fused], lr=[0.1, 0.05], weight_decay=1e-2)
    stock = [torch.optim.SGD([solos[0]], lr=0.1, weight_decay=1e-2),
             torch.optim.SGD([solos[1]], lr=0.05, weight_decay=1e-2)]

    def momentum_on_for_model_1(step: int) -> None:
        if step == 2:
            opt.param_groups[1]["momentum"] = 0.9
            stock[1].param_groups[0]["momentum"] = 0.9

    step_alongside_stock(opt, fused, stock, solos, g, 4, momentum_on_for_model_1)
    for i in range(2):
        assert torch.equal(fused[i], solos[i]), i
    assert opt.state[fused]["has_momentum_buffer"].tolist() == [0, 1]
    assert torch.equal(opt.state[fused]["momentum_buffer"][1],
                       stock[1].state[solos[1]]["momentum_buffer"])


@pytest.mark.parametrize("foreach_max_numel", [0, 1 << 16], ids=["one-by-one", "foreach"])
@pytest.mark.parametrize("case", ["adam_plain", "adam_decoupled_mixed"])
def test_adam_foreach_and_one_by_one_updates_are_stock_bit_for_bit(case, foreach_max_numel,
                                                                    monkeypatch):
    # Small parameters take _foreach ops, large ones per-tensor ops into scratch space;
    # a threshold of 0 sends every parameter of these small models the second way.
    monkeypatch.setattr(adam_module, "_FOREACH_MAX_NUMEL", foreach_max_numel)
    for dtype in DTYPES:
        assert_stock_bit_for_bit(case, dtype)


@pytest.mark.parametrize("case", ["adam", "adam_plain", "adam_decoupled_mixed", "adamw"])
def test_adam_updates_in_column_blocks_are_stock_bit_for_bit(case, monkeypatch):
    # Every parameter takes the per-tensor update in column blocks of 64 elements per
    # model: the Linear weight (90 per model) in a full block and a ragged one.
    monkeypatch.setattr(adam_module, "_FOREACH_MAX_NUMEL", 0)
    monkeypatch.setattr(adam_module, "_BLOCK_ABOVE", 0)
    monkeypatch.setattr(adam_module, "_BLOCK_NUMEL", 1)
    for dtype in DTYPES:
        assert_stock_bit_for_bit(case, dtype)


@pytest.mark.parametrize("path", ["foreach", "blocks", "rows"])
@pytest.mark.parametrize("case", ["sgd", "sgd_maximize", "sgd_momentum", "sgd_nesterov",
                                  "sgd_plain"])
def test_sgd_foreach_block_and_row_updates_are_stock_bit_for_bit(case, path, monkeypatch):
    # Small parameters take _foreach ops over all of them, large ones (on the CPU) the
    # ops on one column block after another ("blocks") or, with wide rows, on one piece
    # of one model's row after another ("rows", each model's values as scalars); those
    # send every parameter of these small models that way, in blocks or pieces of 64
    # elements per model (the Linear weight, 90 per model, in a full one and a ragged one).
    if path != "foreach":
        monkeypatch.setattr(sgd_module, "_FOREACH_MAX_NUMEL", 0)
        monkeypatch.setattr(sgd_module, "_BLOCK_NUMEL", 1)
        monkeypatch.setattr(sgd_module, "_ROW_MIN_NUMEL", 1 if path == "rows" else 1 << 62)
    for dtype in DTYPES:
        assert_stock_bit_for_bit(case, dtype)


@pytest.mark.parametrize("n, width", [(2, 600_003), (80, 14_000)], ids=["rows", "blocks"])
def test_sgd_blocks_a_large_parameter_as_stock_would_update_it(n, width):
    # Past _FOREACH_MAX_NUMEL elements the update runs piece by piece of each model's
    # row (wide rows) or in column blocks, with the module's own sizes; each model's
    # slice is still stock SGD's, bit for bit.
    assert n * width > sgd_module._FOREACH_MAX_NUMEL
    assert (width >= sgd_module._ROW_MIN_NUMEL) is (width == 600_003)
    fused, solos, g = stacked_and_solos(n, width)
    configs = [dict(lr=1e-2 / (i + 1), momentum=0.9, nesterov=True,
                    weight_decay=0.1 * (i % 2)) for i in range(n)]
    opt = ho.SGD([fused], **fused_kwargs(torch.optim.SGD, configs))
    stock = [torch.optim.SGD([solo], **config) for solo, config in zip(solos, configs)]
    step_alongside_stock(opt, fused, stock, solos, g, 3)
    for i in range(n):
        assert torch.equal(fused[i], solos[i])
        assert torch.equal(opt.state[fused]["momentum_buffer"][i],
                           stock[i].state[solos[i]]["momentum_buffer"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16,
                                   torch.float16, torch.complex64], ids=str)
def test_sgd_row_pieces_in_every_dtype_are_stock_bit_for_bit(dtype, monkeypatch):
    # Every parameter in row pieces of 64 elements (150 per model: two whole pieces and a
    # ragged one), each model its own lr, momentum, dampening, decay, nesterov, maximize.
    monkeypatch.setattr(sgd_module, "_FOREACH_MAX_NUMEL", 0)
    monkeypatch.setattr(sgd_module, "_BLOCK_NUMEL", 1)
    monkeypatch.setattr(sgd_module, "_ROW_MIN_NUMEL", 1)
    configs = [dict(lr=0.1, momentum=0.9, weight_decay=1e-2),
               dict(lr=0.05, momentum=0.5, dampening=0.3),
               dict(lr=0.02, momentum=0.8, nesterov=True, weight_decay=1e-3, maximize=True)]
    fused, solos, g = stacked_and_solos(len(configs), 150, dtype)
    opt = ho.SGD([fused], **fused_kwargs(torch.optim.SGD, configs))
    stock = [torch.optim.SGD([solo], **config) for solo, config in zip(solos, configs)]
    step_alongside_stock(opt, fused, stock, solos, g, 4)
    n = len(configs)
    for i in range(n):
        assert torch.equal(fused[i], solos[i]), i
        assert torch.equal(opt.state[fused]["momentum_buffer"][i],
                           stock[i].state[solos[i]]["momentum_buffer"]), i


@pytest.mark.parametrize("one_by_one_min", [0, 1 << 62], ids=["one-by-one", "product"])
@pytest.mark.parametrize("case", ["adam", "adam_plain", "adam_decoupled_mixed", "adamw",
                                  "rmsprop_plain", "adagrad"])
def test_per_model_addcdiv_values_either_way_are_stock_bit_for_bit(case, one_by_one_min,
                                                                   monkeypatch):
    # Models with different learning rates: the last addcdiv_ runs as one call per model
    # with its own value= (stock's call), or on the product y * value over [N, ...]
    # first (addcdiv_ computes value * y first, so the rounding is the same).
    monkeypatch.setattr(adam_module, "_FOREACH_MAX_NUMEL", 0)
    monkeypatch.setattr(coefficients_module, "ONE_BY_ONE_MIN", one_by_one_min)
    for dtype in DTYPES:
        assert_stock_bit_for_bit(case, dtype)


def test_adam_blocks_a_parameter_larger_than_the_cache_as_stock_would_update_it():
    # Past _BLOCK_ABOVE elements (here 2 x 1.1M) the update runs block by block with
    # the module's own sizes; each model's slice is still stock Adam's, bit for bit.
    width = 1_100_003
    assert 2 * width > adam_module._BLOCK_ABOVE
    fused, solos, g = stacked_and_solos(2, width)
    opt = ho.Adam([fused], lr=[1e-2, 3e-3], weight_decay=[0.0, 0.1])
    stock = [torch.optim.Adam([solos[0]], lr=1e-2),
             torch.optim.Adam([solos[1]], lr=3e-3, weight_decay=0.1)]
    step_alongside_stock(opt, fused, stock, solos, g, 3)
    for i in range(2):
        assert torch.equal(fused.detach()[i], solos[i].detach()), i


def test_shared_scalars_equal_lists_of_equal_values():
    models = make_models(3)
    a, b = StackedModels(models), StackedModels(models)
    opt_a = ho.Adam(a.parameters(), lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
    opt_b = ho.Adam(b.parameters(), lr=[1e-2] * 3, betas=[(0.8, 0.9)] * 3,
                    weight_decay=[0.1] * 3)
    batches = make_batches(5)
    train_fused(a, opt_a, batches)
    train_fused(b, opt_b, batches)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_param_groups_are_models():
    models = make_models(3)
    fused = StackedModels(models)
    opt = ho.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3], momentum=0.9)
    assert opt.num_models == 3
    assert len(opt.param_groups) == 3
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2, 0.3]
    assert all(g["momentum"] == 0.9 for g in opt.param_groups)
    # Each stacked parameter appears once: in group 0.
    assert opt.param_groups[0]["params"] == list(fused.parameters())
    assert all(g["params"] == [] for g in opt.param_groups[1:])
    assert "momentum" in opt.defaults


def test_named_parameters_keep_their_names():
    fused = StackedModels(make_models(2))
    opt = ho.Adam(fused.named_parameters(), lr=[1e-3, 1e-2])
    assert opt.param_groups[0]["param_names"] == [n for n, _ in fused.named_parameters()]
    assert opt.param_groups[1]["param_names"] == []


def test_a_fused_module_can_be_passed_directly():
    fused = StackedModels(make_models(3))
    opt = ho.SGD(fused, lr=[0.1, 0.2, 0.3])
    assert opt.num_models == 3
    assert len(opt.param_groups[0]["params"]) == len(list(fused.parameters()))


def test_betas_one_pair_or_one_per_model():
    fused = StackedModels(make_models(2))
    shared = ho.Adam(fused.parameters(), betas=(0.8, 0.9))
    assert [g["betas"] for g in shared.param_groups] == [(0.8, 0.9), (0.8, 0.9)]
    per_model = ho.Adam(fused.parameters(), betas=[(0.8, 0.9), (0.7, 0.95)])
    assert [g["betas"] for g in per_model.param_groups] == [(0.8, 0.9), (0.7, 0.95)]
    tensor_lr = ho.Adam(fused.parameters(), lr=torch.tensor([1e-3, 1e-2]))
    assert [g["lr"] for g in tensor_lr.param_groups] == pytest.approx([1e-3, 1e-2])


def test_hyperparameters_are_read_at_every_step():
    # A change to param_groups[i] (what schedulers do) applies to model i only, at once.
    dtype = torch.float64
    momenta = [0.0, 0.9, 0.9]
    models = make_models(3, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = ho.SGD(fused.parameters(), lr=0.1, momentum=momenta)
    solo_opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=m)
                 for s, m in zip(solos, momenta)]

    def change(groups_1, groups_2):
        groups_1["lr"] = 0.01
        groups_2["momentum"] = 0.5

    batches = make_batches(8, dtype)
    train_fused(fused, opt, batches, after_step=lambda k, _: k == 3 and change(
        opt.param_groups[1], opt.param_groups[2]))
    for k, (x, y) in enumerate(batches):
        for s, o in zip(solos, solo_opts):
            o.zero_grad()
            torch.nn.functional.cross_entropy(s(x), y).backward()
            o.step()
        if k == 3:
            change(solo_opts[1].param_groups[0], solo_opts[2].param_groups[0])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01, 0.1]
    assert_all_match(fused, solos, 1e-9)


def test_momentum_switched_on_later_starts_its_buffer_like_stock():
    # Model 1 has no momentum for 3 steps, then gets one: stock SGD starts its buffer
    # then, as a copy of that step's gradient (no dampening on that first step).
    dtype = torch.float64
    models = make_models(2, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = ho.SGD(fused.parameters(), lr=0.1, momentum=[0.9, 0.0], dampening=0.5)
    solo_opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=m, dampening=0.5)
                 for s, m in zip(solos, [0.9, 0.0])]
    batches = make_batches(7, dtype)
    for k, (x, y) in enumerate(batches):
        if k == 3:
            opt.param_groups[1]["momentum"] = 0.8
            solo_opts[1].param_groups[0]["momentum"] = 0.8
        opt.zero_grad()
        per_model_losses(fused, x, y).sum().backward()
        opt.step()
        for s, o in zip(solos, solo_opts):
            o.zero_grad()
            torch.nn.functional.cross_entropy(s(x), y).backward()
            o.step()
    assert_all_match(fused, solos, 1e-9)


# ----------------------------------------------------------------- skipping models


@pytest.mark.parametrize("case", ["sgd", "adam", "rmsprop", "adagrad", *NEW_CASES])
def test_skip_models_leaves_a_model_exactly_as_it_was(case):
    fused_cls, stock_cls, configs = CASES[case]
    n = len(configs)
    fused = StackedModels(make_models(n))
    opt = fused_cls(fused.parameters(), **fused_kwargs(stock_cls, configs))
    batches = make_batches(4)
    train_fused(fused, opt, batches[:3])
    before = {name: p.detach().clone() for name, p in fused.named_parameters()}
    state_before = {name: {k: v.clone() for k, v in opt.state[p].items()}
                    for name, p in fused.named_parameters()}
    x, y = batches[3]
    opt.zero_grad()
    per_model_losses(fused, x, y).sum().backward()
    opt.step(skip_models=[False, True] + [False] * (n - 2))
    for name, p in fused.named_parameters():
        assert torch.equal(p[1], before[name][1]), name
        assert not torch.equal(p[0], before[name][0]), name
        for key, value in opt.state[p].items():
            assert torch.equal(value[1], state_before[name][key][1]), (name, key)


def test_skipped_steps_make_step_counts_diverge_like_solo_runs():
    # Model 1 skips steps 2 and 4: its Adam bias corrections use its own count,
    # as a solo model that never saw those batches would.
    dtype = torch.float64
    configs = [dict(lr=1e-2), dict(lr=3e-2, amsgrad=True), dict(lr=1e-3)]
    models = make_models(3, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = ho.Adam(fused.parameters(), **fused_kwargs(torch.optim.Adam, configs))
    batches = make_batches(8, dtype)
    skipped = {2, 4}
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        per_model_losses(fused, x, y).sum().backward()
        opt.step(skip_models=torch.tensor([False, k in skipped, False]))
    for i, (solo, config) in enumerate(zip(solos, configs)):
        mine = [b for k, b in enumerate(batches) if i != 1 or k not in skipped]
        train_solo(solo, torch.optim.Adam(solo.parameters(), **config), mine)
    assert_all_match(fused, solos, 1e-9)
    step = opt.state[next(fused.parameters())]["step"]
    assert step.tolist() == [8.0, 6.0, 8.0]


def test_skipping_every_model_changes_nothing():
    fused = StackedModels(make_models(2))
    opt = ho.Adam(fused.parameters())
    x, y = make_batches(1)[0]
    per_model_losses(fused, x, y).sum().backward()
    before = [p.detach().clone() for p in fused.parameters()]
    opt.step(skip_models=[True, True])
    assert all(torch.equal(a, b) for a, b in zip(before, fused.parameters()))
    assert not any(opt.state[p] for p in fused.parameters())


# ----------------------------------------------------------------------- isolation


@pytest.mark.parametrize("case", sorted(CASES))
def test_non_finite_gradients_of_one_model_leave_the_others_alone(case):
    fused_cls, stock_cls, configs = CASES[case]
    n = len(configs)
    dtype = torch.float64
    models = make_models(n, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = fused_cls(fused.parameters(), **fused_kwargs(stock_cls, configs))
    batches = make_batches(6, dtype)
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        per_model_losses(fused, x, y).sum().backward()
        if k == 2:
            grads = [p.grad for p in fused.parameters()]
            grads[0][1].fill_(float("nan"))
            grads[-1][1][0] = float("inf")
        opt.step()
    for solo, config in zip(solos, configs):
        train_solo(solo, stock_cls(solo.parameters(), **config), batches)
    others = [i for i in range(n) if i != 1]
    assert_all_match(fused, solos, 1e-9, models=others)
    assert not all(torch.isfinite(p[1]).all() for p in fused.parameters())


DIVERGING = {
    "sgd": (ho.SGD, torch.optim.SGD, [dict(lr=0.1), dict(lr=1e200), dict(lr=0.05, momentum=0.9)]),
    "sgd_momentum": (ho.SGD, torch.optim.SGD, [
        dict(lr=0.1, momentum=0.9), dict(lr=1e200, momentum=0.9),
        dict(lr=0.05, momentum=0.9, nesterov=True)]),
    "adam": (ho.Adam, torch.optim.Adam, [dict(lr=1e-2), dict(lr=1e300), dict(lr=3e-3)]),
    "adamw": (ho.AdamW, torch.optim.AdamW, [dict(lr=1e-2), dict(lr=1e300), dict(lr=3e-3)]),
    "rmsprop": (ho.RMSprop, torch.optim.RMSprop, [
        dict(lr=1e-2), dict(lr=1e300), dict(lr=1e-3, centered=True, momentum=0.5)]),
    "adagrad": (ho.Adagrad, torch.optim.Adagrad, [dict(lr=1e-2), dict(lr=1e300), dict(lr=1e-1)]),
    "adadelta": (ho.Adadelta, torch.optim.Adadelta, [
        dict(lr=1.0), dict(lr=1e300), dict(lr=0.5, weight_decay=0.01)]),
    "adamax": (ho.Adamax, torch.optim.Adamax, [dict(lr=1e-2), dict(lr=1e300), dict(lr=3e-3)]),
    "nadam": (ho.NAdam, torch.optim.NAdam, [dict(lr=1e-2), dict(lr=1e300), dict(lr=3e-3)]),
    "radam": (ho.RAdam, torch.optim.RAdam, [dict(lr=1e-2), dict(lr=1e300), dict(lr=3e-3)]),
}


@pytest.mark.parametrize("case", sorted(DIVERGING))
def test_a_diverging_model_does_not_touch_the_others(case):
    fused_cls, stock_cls, configs = DIVERGING[case]
    dtype = torch.float64
    models = make_models(3, dtype, activation=torch.nn.ReLU)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = fused_cls(fused.parameters(), **fused_kwargs(stock_cls, configs))
    batches = make_batches(6, dtype)
    losses = train_fused(fused, opt, batches)
    assert not all(torch.isfinite(p[1]).all() for p in fused.parameters()), "1 did not diverge"
    assert not all(torch.isfinite(torch.tensor(loss[1])) for loss in losses)
    for i in (0, 2):
        train_solo(solos[i], stock_cls(solos[i].parameters(), **configs[i]), batches)
    assert_all_match(fused, solos, 1e-9, models=[0, 2])


# -------------------------------------------------------------------------- errors


def test_parameters_with_different_leading_dims_are_rejected():
    a = torch.nn.Parameter(torch.zeros(3, 4))
    b = torch.nn.Parameter(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="leading dims differ"):
        ho.SGD([a, b], lr=0.1)
    with pytest.raises(ValueError, match="0-dim"):
        ho.SGD([torch.nn.Parameter(torch.tensor(1.0))], lr=0.1)
    with pytest.raises(ValueError, match="num_models=4.*\\[3, 4\\]"):
        ho.SGD([a], num_models=4, lr=0.1)


def test_hyperparameter_lists_must_have_one_value_per_model():
    fused = StackedModels(make_models(3))
    with pytest.raises(ValueError, match="lr has 2 values but there are 3 models"):
        ho.Adam(fused.parameters(), lr=[1e-3, 1e-2])
    with pytest.raises(ValueError, match="betas has 2 values"):
        ho.Adam(fused.parameters(), betas=[(0.9, 0.99), (0.8, 0.9)])


def test_bad_hyperparameter_values_name_the_model():
    fused = StackedModels(make_models(3))
    with pytest.raises(ValueError, match="lr for model 2"):
        ho.SGD(fused.parameters(), lr=[0.1, 0.1, -0.1])
    with pytest.raises(ValueError, match="beta parameter at index 1 for model 0"):
        ho.Adam(fused.parameters(), betas=[(0.9, 1.5), (0.9, 0.9), (0.9, 0.9)])
    with pytest.raises(ValueError, match="Nesterov.*model 1"):
        ho.SGD(fused.parameters(), lr=0.1, momentum=[0.9, 0.0, 0.9], nesterov=True)
    with pytest.raises(TypeError, match="must be a number"):
        ho.SGD(fused.parameters(), lr="fast")
    with pytest.raises(TypeError, match="must be a bool"):
        ho.Adam(fused.parameters(), amsgrad=[True, "no", False])


def test_added_groups_and_param_groups_with_their_own_lr_are_rejected():
    fused = StackedModels(make_models(2))
    params = list(fused.parameters())
    with pytest.raises(TypeError, match="param group 1 sets lr; param_groups\\[i\\] of a "
                                        "fused optimizer is model i"):
        ho.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.2}], lr=0.1)
    with pytest.raises(TypeError, match="not both"):
        ho.SGD([{"params": params[:1]}, params[1]], lr=0.1)
    with pytest.raises(TypeError, match="unknown hyper-parameter.*'dampning'"):
        ho.SGD([{"params": params, "dampning": 0.1}], lr=0.1)
    with pytest.raises(ValueError, match="Invalid weight_decay for model 1"):
        ho.SGD([{"params": params, "weight_decay": [0.1, -1.0]}], lr=0.1)
    opt = ho.SGD(fused.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="groups cannot be added"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 3))]})
    with pytest.raises(TypeError, match="single Tensor"):
        ho.SGD(next(fused.parameters()), lr=0.1)
    with pytest.raises(TypeError, match="can only optimize Tensors"):
        ho.SGD([next(fused.parameters()), 3.0], lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        ho.SGD([], lr=0.1)


def test_skip_models_must_have_one_flag_per_model():
    fused = StackedModels(make_models(3))
    opt = ho.SGD(fused.parameters(), lr=0.1)
    x, y = make_batches(1)[0]
    per_model_losses(fused, x, y).sum().backward()
    with pytest.raises(ValueError, match="skip_models has 2 entries but there are 3 models"):
        opt.step(skip_models=[True, False])


def test_closure_is_evaluated_and_returned():
    fused = StackedModels(make_models(2))
    opt = ho.SGD(fused.parameters(), lr=0.1)
    x, y = make_batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = per_model_losses(fused, x, y).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.isfinite(loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["sgd", "adam", "rmsprop", "adagrad"])
def test_cuda_matches_stock(case):
    # Stock optimizers take their foreach path on CUDA and a GPU may round x*c+y
    # differently, so this checks closeness, not bits.
    fused_cls, stock_cls, configs = CASES[case]
    dtype, device = torch.float64, torch.device("cuda")
    models = [m.to(device) for m in make_models(len(configs), dtype)]
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = fused_cls(fused.parameters(), **fused_kwargs(stock_cls, configs))
    batches = [(x.to(device), y.to(device)) for x, y in make_batches(10, dtype)]
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        per_model_losses(fused, x, y).sum().backward()
        opt.step(skip_models=[k == 4] + [False] * (len(configs) - 1))
    for i, (solo, config) in enumerate(zip(solos, configs)):
        mine = [b for k, b in enumerate(batches) if i != 0 or k != 4]
        train_solo(solo, stock_cls(solo.parameters(), **config), mine)
    assert_all_match(fused, solos, 1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["sgd", "adam", "rmsprop", "nadam"])
def test_cuda_half_precision_parameters_step_as_stock_bit_for_bit(case):
    # bfloat16 parameters on CUDA take each model's stock update (stock's CUDA default,
    # foreach): the same kernels on the same gradients, so equal bit for bit.  (Fed the
    # gradients directly: a forward on slices may pick other GEMM kernels.)
    assert_steps_fed_the_same_gradients_equal_stock(case, torch.bfloat16, torch.device("cuda"))


def assert_steps_fed_the_same_gradients_equal_stock(case: str, dtype: torch.dtype, device: torch.device) -> None:
    fused_cls, stock_cls, configs = CASES[case]
    n = len(configs)
    fused, solos, g = stacked_and_solos(n, 70, dtype, device)
    opt = fused_cls([fused], **fused_kwargs(stock_cls, configs))
    stock = [stock_cls([solo], **config) for solo, config in zip(solos, configs)]
    step_alongside_stock(opt, fused, stock, solos, g, 4)
    for i in range(n):
        torch.testing.assert_close(fused[i], solos[i], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", ["sgd", "adam", "rmsprop", "nadam", "adagrad"])
def test_half_precision_steps_fed_the_same_gradients_equal_stock(case):
    assert_steps_fed_the_same_gradients_equal_stock(case, torch.float16, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_complex_parameters_step_as_stock_bit_for_bit(case, dtype):
    # Stock updates a complex parameter as its real view (each component its own
    # moments); the stacked update squared complex gradients (wrong moments) or failed
    # in amsgrad's maximum.  Complex parameters take each model's stock update.
    assert_steps_fed_the_same_gradients_equal_stock(case, dtype, torch.device("cpu"))


@pytest.mark.parametrize("case", ["sgd", "adam", "adam_plain", "rmsprop"])
def test_compiled_step_is_the_eager_update_and_never_recompiles(case):
    # A user following torch's "compile the optimizer step" recipe: torch.compile(opt.step).
    # The step runs eagerly (step counts would otherwise be traced as constants and
    # recompile every step), so the result is stock's bit for bit and dynamo compiles
    # nothing more after the first call.
    import torch._dynamo

    fused_cls, stock_cls, configs = CASES[case]
    models = make_models(len(configs), torch.float64)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = fused_cls(fused.parameters(), **fused_kwargs(stock_cls, configs))
    torch._dynamo.reset()
    compiled_step = torch.compile(opt.step)
    batches = make_batches(6, torch.float64)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for x, y in batches:
            opt.zero_grad()
            per_model_losses(fused, x, y).sum().backward()
            compiled_step()
    for solo, config in zip(solos, configs):
        train_solo(solo, stock_cls(solo.parameters(), **config), batches)
    params = dict(fused.named_parameters())
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            assert torch.equal(params[name][i], p), (case, i, name)


def test_per_model_coefficients_are_built_once_while_the_values_stay_the_same():
    # The [N, 1, ...] coefficient tensors are reused step to step; any change, even
    # 0.0 -> -0.0 (another bit pattern, another product's sign), builds new ones.
    fused = StackedModels(make_models(2))
    opt = ho.SGD(fused.parameters(), lr=[0.1, 0.2], weight_decay=[0.0, 0.0])
    first = opt._coefficients({"wd": [0.0, 0.0], "neg_lr": [-0.1, -0.2]})
    assert opt._coefficients({"wd": [0.0, 0.0], "neg_lr": [-0.1, -0.2]}) is first
    signed = opt._coefficients({"wd": [0.0, -0.0], "neg_lr": [-0.1, -0.2]})
    assert signed is not first
    like = torch.zeros(2, 3, dtype=torch.float64)
    assert torch.equal(torch.signbit(signed("wd", like)).flatten(), torch.tensor([False, True]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_param_groups_with_their_own_weight_decay_match_stock(dtype):
    """nanoGPT's AdamW grouping: weight decay on the matrices, none on biases, the
    models' learning rates their own and scheduled.  Each model equals stock AdamW over
    the same two groups, with the same schedule."""
    models = make_models(3, dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    lrs, wds = [1e-2, 3e-2, 5e-3], [0.1, 0.0, 0.3]

    def groups(module, wd):
        named = list(module.named_parameters())
        return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": wd},
                {"params": [p for n, p in named if not n.endswith("weight")],
                 "weight_decay": 0.0}]

    opt = ho.AdamW(groups(fused, wds), lr=lrs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    stock = [torch.optim.AdamW(groups(m, wd), lr=lr) for m, lr, wd in zip(solos, lrs, wds)]
    stock_scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step)
                    for o in stock]
    for x, y in make_batches(3, dtype):
        opt.zero_grad()
        per_model_losses(fused, x, y).sum().backward()
        opt.step()
        sched.step()
        for m, o, s in zip(solos, stock, stock_scheds):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            s.step()
    assert_all_match(fused, solos, tolerance(dtype))
    # The groups survive a pickle (deepcopy) of the optimizer.
    assert copy.deepcopy(opt)._group_overrides == opt._group_overrides


def test_state_dict_keeps_param_group_hyperparameters_and_refuses_other_state():
    """Per-parameter hyper-parameters from param-group dicts (nanoGPT's weight decay on
    matrices only) were not in state_dict: loading into an optimizer built with other
    values trained with those, silently. A stock optimizer's state loaded into N = 1
    failed inside the next step; into other N, with torch's generic message."""
    import io

    from torch import nn

    import hftc
    from hftc.errors import FusionArgumentError

    torch.manual_seed(0)
    fused = hftc.fuse([nn.Linear(4, 3).double() for _ in range(2)])
    x = torch.randn(5, 4, dtype=torch.float64)

    def make(decay_of_weight):
        return ho.AdamW([{"params": [fused.weight], "weight_decay": decay_of_weight},
                         {"params": [fused.bias], "weight_decay": 0.0}], lr=[1e-2, 2e-2])

    opt = make(0.5)
    for _ in range(2):
        opt.zero_grad()
        (fused(x) ** 2).sum().backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_model = copy.deepcopy(fused)
    resumed = ho.AdamW([{"params": [resumed_model.weight], "weight_decay": 0.01},
                        {"params": [resumed_model.bias], "weight_decay": 0.01}],
                       lr=[1e-2, 2e-2])
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for model, optimizer in ((fused, opt), (resumed_model, resumed)):
        for _ in range(2):
            optimizer.zero_grad()
            (model(x) ** 2).sum().backward()
            optimizer.step()
    torch.testing.assert_close(resumed_model.weight, fused.weight, rtol=0, atol=0)
    torch.testing.assert_close(resumed_model.bias, fused.bias, rtol=0, atol=0)

    stock = torch.optim.Adam(nn.Linear(4, 3).parameters())
    with pytest.raises(FusionArgumentError,
                       match="1 param group.*one per model, 2.*fuse_optimizers"):
        ho.Adam(fused.parameters(), lr=1e-3).load_state_dict(stock.state_dict())
    single = hftc.fuse([nn.Linear(4, 3)])
    layer = nn.Linear(4, 3)
    stock = torch.optim.Adam(layer.parameters())
    layer(torch.randn(2, 4)).sum().backward()
    stock.step()
    with pytest.raises(FusionArgumentError, match="exp_avg.*not a fused optimizer's state"):
        ho.Adam(single.parameters(), lr=1e-3).load_state_dict(stock.state_dict())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_per_model_addcdiv_in_half_types_is_stocks_call(dtype):
    # ATen's addcdiv_ computes value * y / z in float32 for half types and rounds once;
    # the product y * c in the half type rounded first (fp16 RMSprop: 685 of 768
    # elements a step off stock's).  In half types it is one call per model, stock's.
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(3, 64, 32, generator=g).to(dtype) for _ in range(2))
    z = (torch.rand(3, 64, 32, generator=g) + 0.5).to(dtype)
    values = [-1e-3, -3e-3, -1e-2]
    want = x.clone()
    for i, v in enumerate(values):
        want[i].addcdiv_(y[i], z[i], value=v)
    got = coefficients_module.addcdiv_(x.clone(), y, z,
                                    coefficients_module.Coefficients({"neg_lr": values}), "neg_lr")
    assert torch.equal(got, want)


# ------------------------------------------- Adadelta, Adamax, NAdam, RAdam specifics


def train_against_stock(fused_cls, stock_cls, configs, dtype, steps, *, skip=None):
    """Train N models fused (``configs[i]`` per model, its ``foreach`` set in
    ``param_groups[i]`` after construction, as fuse_optimizers sets it) and each alone with
    its stock optimizer; ``skip(k)`` lists the models that skip step k. Returns
    (fused, solos)."""
    group_keys = ("foreach",)
    models = make_models(len(configs), dtype)
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    opt = fused_cls(fused.parameters(), **fused_kwargs(
        stock_cls, [{k: v for k, v in c.items() if k not in group_keys} for c in configs]))
    for group, config in zip(opt.param_groups, configs):
        group.update({k: config[k] for k in group_keys if k in config})
    batches = make_batches(steps, dtype)
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        per_model_losses(fused, x, y).sum().backward()
        opt.step(skip_models=None if skip is None else
                 [i in skip(k) for i in range(len(configs))])
    for i, (solo, config) in enumerate(zip(solos, configs)):
        mine = [b for k, b in enumerate(batches) if skip is None or i not in skip(k)]
        train_solo(solo, stock_cls(solo.parameters(), **config), mine)
    return fused, solos


def assert_bit_for_bit(fused, solos) -> None:
    params = dict(fused.named_parameters())
    for i, solo in enumerate(solos):
        for name, p in solo.named_parameters():
            assert torch.equal(params[name][i], p), (i, name, (params[name][i] - p).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["nadam", "radam"])
def test_nadam_and_radam_take_each_models_foreach_update_as_stock_does(case, dtype):
    # Stock NAdam and RAdam round their foreach and for-loop updates differently (the
    # denominators: sqrt(v / bc2) against sqrt(v) / sqrt(bc2)); each model gets the one
    # its group's foreach picks, as fuse_optimizers carries it over per model.
    fused_cls, stock_cls, configs = CASES[case]
    flags = [None, True, False, True]
    configs = [dict(c, foreach=f) for c, f in zip(configs, flags)]
    fused, solos = train_against_stock(fused_cls, stock_cls, configs, dtype, 10)
    assert_bit_for_bit(fused, solos)
    # Not vacuous: model 1 alone with the other update ends elsewhere.
    other = train_against_stock(fused_cls, stock_cls, [dict(configs[1], foreach=False)],
                                dtype, 10)[0]
    assert not torch.equal(next(other.parameters())[0], next(fused.parameters())[1])


@pytest.mark.parametrize("foreach", [False, True])
def test_radam_rectifies_each_model_by_its_own_step_count(foreach):
    # Model 0 skips steps 2-4: it reaches step 6 (rho_t > 5, the first rectified step)
    # three steps after the others, so for three steps the models take stock's two
    # forms of the update at once.
    configs = [dict(lr=1e-2, foreach=foreach), dict(lr=3e-3, foreach=foreach),
               dict(lr=5e-3, weight_decay=0.1, foreach=foreach)]
    fused, solos = train_against_stock(ho.RAdam, torch.optim.RAdam, configs, torch.float64, 10,
                                       skip=lambda k: {0} if 2 <= k <= 4 else set())
    assert_bit_for_bit(fused, solos)


@pytest.mark.parametrize("case", NEW_CASES)
def test_state_dict_resumes_the_new_optimizers_as_stock_continues(case):
    import io

    fused_cls, stock_cls, configs = CASES[case]
    models = make_models(len(configs))
    solos = [copy.deepcopy(m) for m in models]
    fused = StackedModels(models)
    kwargs = fused_kwargs(stock_cls, configs)
    opt = fused_cls(fused.parameters(), **kwargs)
    batches = make_batches(8)
    train_fused(fused, opt, batches[:3])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = fused_cls(fused.parameters(), **kwargs)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    train_fused(fused, resumed, batches[3:])
    for solo, config in zip(solos, configs):
        train_solo(solo, stock_cls(solo.parameters(), **config), batches)
    assert_bit_for_bit(fused, solos)
    for p in fused.parameters():  # per-model scalars stay on the CPU in their dtype
        for key in ("step", "mu_product"):
            if key in opt.state[p]:
                assert resumed.state[p][key].dtype == opt.state[p][key].dtype == torch.float32
                assert resumed.state[p][key].device.type == "cpu"


def test_new_optimizers_refuse_bad_values_naming_the_model():
    fused = StackedModels(make_models(3))
    with pytest.raises(ValueError, match="Invalid rho value for model 1: 1.5"):
        ho.Adadelta(fused.parameters(), rho=[0.9, 1.5, 0.9])
    with pytest.raises(ValueError, match="Invalid momentum_decay for model 2"):
        ho.NAdam(fused.parameters(), momentum_decay=[4e-3, 4e-3, -1.0])
    with pytest.raises(ValueError, match="beta parameter at index 1 for model 0"):
        ho.RAdam(fused.parameters(), betas=[(0.9, 1.0), (0.9, 0.9), (0.9, 0.9)])
    with pytest.raises(ValueError, match="Invalid eps for model 0"):
        ho.Adamax(fused.parameters(), eps=[-1.0, 1e-8, 1e-8])


def test_zero_and_minus_zero_are_not_one_shared_coefficient():
    # RAdam's foreach update divides by a per-model -0.0 (an unrectified model): a row
    # of 0.0 and -0.0 taken as one shared 0.0 gives one model the other's infinity.
    coef = coefficients_module.Coefficients({"bc2_step": [0.0, -0.0], "same": [-0.0, -0.0]})
    like = torch.ones(2, 3)
    shared = coef.get("bc2_step", like)
    assert isinstance(shared, torch.Tensor)
    assert torch.equal(like / shared, torch.tensor([[1.0], [-1.0]]) * float("inf") * like)
    assert coef.get("same", like) == 0.0 and str(coef.get("same", like)) == "-0.0"
