"""hftc.optim.Adam / AdamW with ``fused=True`` (the benchmark suite's fast optimizer path).

Reference: N stock ``torch.optim.Adam(fused=True)`` (or ``AdamW``), one per model.
Where the N models differ only in their learning rates, hftc computes the unit step
once for all of them and scales it per model, which may round the step differently
from stock (a relative 1e-6 of the step); everywhere else it calls stock's kernel
per model and must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import hftc

SHAPES = [(5, 7), (7,), (3, 2, 4)]


def _run(n, stock_cls, fused_cls, stock_kwargs, fused_kwargs, steps=6, grad_fn=None, seed=0):
    torch.manual_seed(seed)
    init = [torch.randn(n, *s) for s in SHAPES]
    stock_params = [[t[i].clone().requires_grad_() for t in init] for i in range(n)]
    stocks = [stock_cls(ps, fused=True, **kw) for ps, kw in zip(stock_params, stock_kwargs)]
    fused_params = [t.clone().requires_grad_() for t in init]
    opt = fused_cls(fused_params, fused=True, **fused_kwargs)
    for _ in range(steps):
        grads = [torch.randn(n, *s) for s in SHAPES]
        for i in range(n):
            for p, g in zip(stock_params[i], grads):
                p.grad = g[i].clone()
            stocks[i].step()
        for p, g in zip(fused_params, grads):
            p.grad = grad_fn(g) if grad_fn else g.clone()
        opt.step()
    want = [torch.stack([stock_params[i][k].detach() for i in range(n)]) for k in range(len(SHAPES))]
    return [p.detach() for p in fused_params], want, opt


def _per_model(n, **kw):
    return [{k: (v[i] if isinstance(v, list) else v) for k, v in kw.items()} for i in range(n)]


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_shared_settings_are_stock_fused_bit_for_bit(cls):
    hcls = hftc.optim.Adam if cls is torch.optim.Adam else hftc.optim.AdamW
    kw = {"lr": 3e-3, "weight_decay": 0.1}
    got, want, _ = _run(3, cls, hcls, _per_model(3, **kw), kw)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("cls,wd,maximize", [
    (torch.optim.Adam, 0.0, False), (torch.optim.Adam, 0.05, True), (torch.optim.Adam, 0.05, False),
    (torch.optim.AdamW, 0.05, False), (torch.optim.AdamW, 0.05, True),
])
def test_learning_rate_sweep_is_stock_fused_within_rounding(cls, wd, maximize):
    hcls = hftc.optim.Adam if cls is torch.optim.Adam else hftc.optim.AdamW
    lrs = [1e-3, 3e-3, 1e-2, 3e-2]
    kw = {"lr": lrs, "weight_decay": wd, "maximize": maximize}
    got, want, _ = _run(4, cls, hcls, _per_model(4, **kw), kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_per_model_algorithm_switches_are_stock_fused_bit_for_bit():
    kw = {"lr": [1e-3, 1e-2, 3e-3], "betas": [(0.9, 0.999), (0.8, 0.99), (0.9, 0.9)],
          "amsgrad": [False, True, False], "eps": [1e-8, 1e-6, 1e-8], "weight_decay": 0.01}
    got, want, _ = _run(3, torch.optim.Adam, hftc.optim.Adam, _per_model(3, **kw), kw)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_non_contiguous_gradient_takes_the_exact_default_path():
    # The fused kernel reads raw memory; a gradient laid out unlike its parameter must
    # not reach it.  The default path then matches stock's default Adam bit for bit.
    n, lrs = 2, [1e-3, 1e-2]
    torch.manual_seed(0)
    p0 = torch.randn(n, 4, 6)
    stock_params = [p0[i].clone().requires_grad_() for i in range(n)]
    stocks = [torch.optim.Adam([p], lr=lr) for p, lr in zip(stock_params, lrs)]
    fused_param = p0.clone().requires_grad_()
    opt = hftc.optim.Adam([fused_param], lr=lrs, fused=True)
    for _ in range(3):
        g = torch.randn(n, 6, 4).transpose(1, 2)            # [n, 4, 6], not contiguous
        for i in range(n):
            stock_params[i].grad = g[i].clone()
            stocks[i].step()
        fused_param.grad = g
        opt.step()
    assert torch.equal(fused_param.detach(), torch.stack([p.detach() for p in stock_params]))


def test_skipped_models_are_untouched_and_others_step():
    torch.manual_seed(0)
    p = torch.randn(3, 4, requires_grad=True)
    before = p.detach().clone()
    opt = hftc.optim.Adam([p], lr=[1e-2, 2e-2, 3e-2], fused=True)
    p.grad = torch.randn(3, 4)
    opt.step(skip_models=[False, True, False])
    assert torch.equal(p[1].detach(), before[1])
    assert not torch.equal(p[0].detach(), before[0]) and not torch.equal(p[2].detach(), before[2])
    assert opt.state[p]["step"].tolist() == [1.0, 0.0, 1.0]
    p.grad = torch.randn(3, 4)
    opt.step()  # steps now differ across models: each model's own in the one launch
    assert opt.state[p]["step"].tolist() == [2.0, 1.0, 2.0]


@pytest.mark.parametrize("lrs", [[3e-3] * 3, [1e-3, 3e-3, 1e-2]], ids=["shared", "sweep"])
def test_step_counts_that_differ_after_a_skip_are_each_models_own(lrs):
    # One kernel launch takes a step count per model: a model that skipped a step
    # (GradScaler overflow) then runs with its own bias correction, as its stock
    # optimizer, which was not stepped, does.
    torch.manual_seed(0)
    init = torch.randn(3, 5, 4)
    stock_params = [init[i].clone().requires_grad_() for i in range(3)]
    stocks = [torch.optim.Adam([q], lr=lr, fused=True) for q, lr in zip(stock_params, lrs)]
    p = init.clone().requires_grad_()
    opt = hftc.optim.Adam([p], lr=lrs, fused=True)
    for step in range(4):
        g = torch.randn(3, 5, 4)
        skipped = {1} if step == 1 else set()
        for i in range(3):
            stock_params[i].grad = g[i].clone()
            if i not in skipped:
                stocks[i].step()
        p.grad = g.clone()
        opt.step(skip_models=[i in skipped for i in range(3)])
    assert opt.state[p]["step"].tolist() == [4.0, 3.0, 4.0]
    want = torch.stack([q.detach() for q in stock_params])
    if len(set(lrs)) == 1:
        assert torch.equal(p.detach(), want)
    else:  # the unit step scaled per model (module docstring)
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_step_counts_are_kept_where_and_as_stock_fused_keeps_them():
    # (CUDA's fused kernel reads them on the device: float32 there, also under a
    # float64 default dtype; tests/test_optim_mixed.py runs it on a GPU.)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        q = torch.randn(4, requires_grad=True)
        stock = torch.optim.Adam([q], fused=True)
        q.grad = torch.randn(4)
        stock.step()
        p = torch.randn(2, 4, requires_grad=True)
        opt = hftc.optim.Adam([p], fused=True)
        p.grad = torch.randn(2, 4)
        opt.step()
    finally:
        torch.set_default_dtype(saved)
    want, got = stock.state[q]["step"], opt.state[p]["step"]
    assert (got.dtype, got.device) == (want.dtype, want.device) == (torch.float32, q.device)


def test_loaded_step_counts_stay_where_the_fused_kernel_reads_them():
    # torch's load_state_dict moves a fused group's step counts to the parameter's
    # device as float32; hftc keeps them there (it kept them on the CPU as saved, which
    # CUDA's kernel refuses), and training goes on as if never saved.
    torch.manual_seed(0)
    init = torch.randn(3, 4, 5, dtype=torch.float64)
    grads = [torch.randn(3, 4, 5, dtype=torch.float64) for _ in range(4)]

    def train(p, opt, gs):
        for g in gs:
            p.grad = g.clone()
            opt.step()

    a = init.clone().requires_grad_()
    opt_a = hftc.optim.Adam([a], lr=[1e-2, 2e-2, 3e-2], fused=True)
    train(a, opt_a, grads)
    b = init.clone().requires_grad_()
    opt_b = hftc.optim.Adam([b], lr=[1e-2, 2e-2, 3e-2], fused=True)
    train(b, opt_b, grads[:2])
    saved = opt_b.state_dict()
    saved["state"][0]["step"] = saved["state"][0]["step"].double()  # as an older hftc saved
    opt_c = hftc.optim.Adam([b], lr=[1e-2, 2e-2, 3e-2], fused=True)
    opt_c.load_state_dict(saved)
    step = opt_c.state[b]["step"]
    assert (step.dtype, step.device, step.tolist()) == (torch.float32, b.device, [2.0] * 3)
    train(b, opt_c, grads[2:])
    assert torch.equal(a, b)


def test_fused_flag_survives_pickling():
    import pickle

    p = torch.randn(2, 3, requires_grad=True)
    opt = hftc.optim.AdamW([p], lr=[1e-3, 1e-2], fused=True)
    assert pickle.loads(pickle.dumps(opt)).defaults["fused"] is True
    assert hftc.optim.Adam([p]).defaults["fused"] is False
