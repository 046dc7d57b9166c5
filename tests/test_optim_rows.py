"""hftc.optim.Adam's row-chunk update (``Adam._update_rows``) against stock torch.optim.

On the CPU, a parameter with at least ``_ROW_CHUNKS_MIN_WIDTH`` elements per model is
updated model by model in chunks of its row with stock's own calls; each model's slice and
state must equal stock Adam's / AdamW's bit for bit, float64 and float32.
"""

from __future__ import annotations

import pytest
import torch
from optim_helpers import single_thread  # noqa: F401  (autouse fixture)
from test_optim import assert_stock_bit_for_bit

import hftc.optim as ho
import hftc.optim.adam as adam_module

DTYPES = [torch.float64, torch.float32]

# One config per model: every per-model switch of the update (maximize, coupled and
# decoupled decay, amsgrad for some models), each model its own lr, betas and eps.
CONFIGS = [
    dict(lr=1e-2),
    dict(lr=3e-2, betas=(0.8, 0.99), amsgrad=True, weight_decay=0.1),
    dict(lr=1e-3, eps=1e-6, maximize=True, weight_decay=0.05),
    dict(lr=5e-3, weight_decay=0.2, decoupled_weight_decay=True, maximize=True),
]


@pytest.mark.parametrize("case", ["adam", "adam_plain", "adam_decoupled_mixed", "adamw"])
def test_adam_row_chunks_of_small_models_are_stock_bit_for_bit(case, monkeypatch):
    # Every parameter of these small models takes the row-chunk update in chunks of 64
    # elements: the Linear weight (90 per model) in a full chunk and a ragged one.
    monkeypatch.setattr(adam_module, "_FOREACH_MAX_NUMEL", 0)
    monkeypatch.setattr(adam_module, "_ROW_CHUNKS_MIN_WIDTH", 1)
    monkeypatch.setattr(adam_module, "_ROW_CHUNK_NUMEL", 64)
    for dtype in DTYPES:
        assert_stock_bit_for_bit(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adam_row_chunks_of_a_wide_parameter_are_stock_bit_for_bit(dtype):
    # The module's own sizes: 100_003 elements per model (past _ROW_CHUNKS_MIN_WIDTH,
    # several chunks, the last ragged), every per-model switch; parameters and state.
    width, n = 100_003, len(CONFIGS)
    assert width >= adam_module._ROW_CHUNKS_MIN_WIDTH
    assert width % adam_module._ROW_CHUNK_NUMEL != 0
    g = torch.Generator().manual_seed(0)
    start = torch.randn(n, width, generator=g, dtype=dtype)
    fused = torch.nn.Parameter(start.clone())
    solos = [torch.nn.Parameter(start[i].clone()) for i in range(n)]
    opt = ho.Adam([fused], **{k: [c.get(k, d) for c in CONFIGS] for k, d in [
        ("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0.0),
        ("amsgrad", False), ("maximize", False), ("decoupled_weight_decay", False)]})
    stock = [torch.optim.Adam([s], **c) for s, c in zip(solos, CONFIGS)]
    for _ in range(3):
        grad = torch.randn(n, width, generator=g, dtype=dtype)
        fused.grad = grad.clone()
        opt.step()
        for i in range(n):
            solos[i].grad = grad[i].clone()
            stock[i].step()
    state = opt.state[fused]
    for i in range(n):
        assert torch.equal(fused.detach()[i], solos[i].detach()), i
        stock_state = stock[i].state[solos[i]]
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if CONFIGS[i].get("amsgrad")
                                             else [])
        for name in names:
            assert torch.equal(state[name][i], stock_state[name]), (i, name)
