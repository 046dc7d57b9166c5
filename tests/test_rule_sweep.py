"""One op at a time, for the rules whose ops take a dim, reduce, index or pool: each op
after a per-model linear (or 1x1 conv), so every model's values differ, fused for N = 3
and checked against the loop over the models (float64, outputs and parameter gradients).

The op's dim is the one a fused op must shift past the model dim; dim 0 (the batch)
and negative dims are where an off-by-one would show.  test_rules.py covers the
rules in richer models; this sweep covers the spellings no other test names.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn


def _pair(op: Callable) -> Callable:
    """An op returning two tensors, unpacked as model code does (fx traces the unpacking)."""
    def both(h):
        a, b = op(h)
        return a, b

    return both


#: name -> op on a [B=2, T=5, D=4] activation
SEQUENCE_OPS: dict[str, Callable] = {
    "cumsum_0": lambda h: h.cumsum(0),
    "cumprod_1": lambda h: torch.cumprod(h, 1),
    "cummax_-1": _pair(lambda h: h.cummax(-1)),
    "cummin_0": _pair(lambda h: torch.cummin(h, 0)),
    "logcumsumexp_0": lambda h: h.logcumsumexp(0),
    "sort_0": _pair(lambda h: h.sort(0)),
    "sort_-1_descending": _pair(lambda h: torch.sort(h, -1, descending=True)),
    "argsort_1": lambda h: h.argsort(1) * h,
    "topk_0": _pair(lambda h: h.topk(2, 0)),
    "topk_-1": _pair(lambda h: torch.topk(h, 2)),
    "kthvalue_0": _pair(lambda h: h.kthvalue(1, 0)),
    "kthvalue_-1": _pair(lambda h: torch.kthvalue(h, 2)),
    "glu_-1": lambda h: F.glu(h, -1),
    "split_with_sizes_0": _pair(lambda h: h.split_with_sizes([1, 1], 0)),
    "tensor_split_1": _pair(lambda h: h.tensor_split(2, 1)),
    "diff_0": lambda h: h.diff(dim=0),
    "narrow_1": lambda h: h.narrow(1, 1, 2),
    "roll_0": lambda h: h.roll(1, 0),
    "roll_flat": lambda h: h.roll(3),
    "roll_1_2": lambda h: h.roll((1, 2), (1, 2)),
    "unbind_0": _pair(lambda h: h.unbind(0)),
    # cat / stack of a sequence one node made (fuse_cat took it for a list of nodes)
    "cat_chunk_-1": lambda h: torch.cat(h.chunk(2, -1)[::-1], -1),
    "cat_split_0": lambda h: torch.cat(h.split(1, 0), 1),
    "stack_unbind_1": lambda h: torch.stack(h.unbind(1)[::2], 0),
    "aminmax": _pair(lambda h: torch.aminmax(h)),
    "aminmax_0": _pair(lambda h: h.aminmax(dim=0)),
    "count_nonzero_0": lambda h: (h > 0).count_nonzero(0) * h.sum(0),
    "median_0": _pair(lambda h: h.median(0)),
    "nanmedian": lambda h: h.nanmedian(),
    "mode_1": _pair(lambda h: h.round().mode(1)),
    "var_mean_0": _pair(lambda h: torch.var_mean(h, 0)),
    "std_mean": _pair(lambda h: torch.std_mean(h)),
    "min_0": _pair(lambda h: h.min(0)),
    "nansum": lambda h: h.nansum(),
    "nanmean_0": lambda h: h.nanmean(0),
    "gather_0": lambda h: h.gather(0, torch.zeros_like(h, dtype=torch.long)),
    "gather_-1": lambda h: torch.gather(h, -1, torch.zeros_like(h[..., :2], dtype=torch.long)),
    "index_select_0": lambda h: h.index_select(0, torch.tensor([1, 0])),
    "index_select_1": lambda h: torch.index_select(h, 1, torch.tensor([2, 0, 1])),
    "mm": lambda h: h[0].mm(h[0].T),
    "mv": lambda h: h[0].mv(h[0, 0]),
    "softmin_0": lambda h: F.softmin(h, 0),
    "swapaxes_0_1": lambda h: h.swapaxes(0, 1) * torch.arange(2.0, dtype=h.dtype)[:, None],
    "moveaxis": lambda h: torch.moveaxis(h, 0, -1).sum(-1),
    "tril_triu": lambda h: h.tril() + torch.triu(h, 1),
    "new_tensor": lambda h: h * h.new_tensor([1.0, 2.0, 3.0, 4.0]),
    "reshape_as": lambda h: h.reshape_as(h.transpose(0, 1).contiguous()).sum(0),
}

#: name -> (spatial dims, module factory) for the per-channel modules
CHANNEL_MODULES: dict[str, tuple[int, Callable[[], nn.Module]]] = {}
for _spatial, _d in ((1, "1d"), (2, "2d"), (3, "3d")):
    for _name, _make in {
        "AdaptiveAvgPool": lambda cls: cls(3), "AdaptiveMaxPool": lambda cls: cls(2),
        "AvgPool": lambda cls: cls(2), "LPPool": lambda cls: cls(2, 2),
        "ReflectionPad": lambda cls: cls(1), "ReplicationPad": lambda cls: cls(1),
        "CircularPad": lambda cls: cls(1), "ConstantPad": lambda cls: cls(1, 0.3),
        "ZeroPad": lambda cls: cls(1),
    }.items():
        _cls = getattr(nn, f"{_name}{_d}")
        CHANNEL_MODULES[f"{_name}{_d}"] = (_spatial, lambda cls=_cls, make=_make: make(cls))


class AfterLinear(nn.Module):
    """``op(linear(x))``: the linear makes each model's input to the op its own."""

    def __init__(self, op: Callable):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.op = op

    def forward(self, x):
        return self.op(self.linear(x))


class AfterConv(nn.Module):
    """``module(conv1x1(x))`` on a ``[B, 4, 6, ...]`` map."""

    def __init__(self, spatial: int, module: nn.Module):
        super().__init__()
        self.conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[spatial - 1](4, 4, 1)
        self.module = module

    def forward(self, x):
        return self.module(self.conv(x))


@pytest.mark.parametrize("name", sorted(SEQUENCE_OPS))
def test_sequence_op_matches_the_loop(name):
    torch.manual_seed(0)
    models = [AfterLinear(SEQUENCE_OPS[name]) for _ in range(3)]
    check_equivalence(models, torch.randn(2, 5, 4), dtype=torch.float64)


@pytest.mark.parametrize("name", sorted(CHANNEL_MODULES))
def test_channel_module_matches_the_loop(name):
    spatial, make = CHANNEL_MODULES[name]
    torch.manual_seed(0)
    models = [AfterConv(spatial, make()) for _ in range(3)]
    check_equivalence(models, torch.randn(2, 4, *(6,) * spatial), dtype=torch.float64)
