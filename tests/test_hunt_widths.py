"""Bug hunt: models that differ in widths (``hftc.fuse(models, pad_widths=True)``,
``hftc.fuse_groups``, ``hftc.keep_models`` / ``replace_models``), each checked against the
same models trained alone with stock ``torch.optim``."""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import hftc
from tests.optim_helpers import single_thread  # noqa: F401  (fixture)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


class ScaledEmbedding(nn.Module):
    """The Annotated Transformer's embedding: ``self.lut(x) * math.sqrt(self.d_model)``,
    d_model a per-model float read in C by math.sqrt."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = float(d_model)
        self.lut = nn.Embedding(11, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 11)

    def forward(self, idx):
        return self.head(self.norm(self.lut(idx) * math.sqrt(self.d_model)))


def test_a_per_model_width_read_in_c_pads_and_trains_as_alone():
    """d_model 8 and 16 padded into one array: each model scales by its own sqrt(d_model)
    and trains (Adam, weight decay, float64) as alone. Before, the number trace baked model
    0's math.sqrt(8) into every model's graph and pad_widths=True was refused with a
    MismatchError saying forward mixes across a padded width."""
    torch.manual_seed(0)
    models = [ScaledEmbedding(d).double() for d in (8, 16)]
    alone = [copy.deepcopy(m) for m in models]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = hftc.fuse(models, pad_widths=True)
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-2, 2e-2], weight_decay=[1e-2, 1e-2])
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2 * (i + 1), weight_decay=1e-2)
            for i, m in enumerate(alone)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        idx, y = torch.randint(0, 11, (3, 5), generator=g), torch.randint(0, 11, (3, 5), generator=g)
        opt.zero_grad()
        out = fused(idx)
        sum(F.cross_entropy(out[i].reshape(-1, 11), y.reshape(-1)) for i in range(2)).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            want = m(idx)
            assert _relative(out[i].detach(), want.detach()) <= 1e-12
            F.cross_entropy(want.reshape(-1, 11), y.reshape(-1)).backward()
            o.step()
    assert fused.strategy == "fused" and fused.padding is not None
    for i, m in enumerate(alone):
        got = fused.model_state_dict(i)
        for name, want in m.state_dict().items():
            assert _relative(got[name], want) <= 1e-12, (i, name)
