"""Fused embedding lookups: N models' tables ``[N, V, D]`` read as one ``[N*V, D]`` table.

::

    before:  emb_n[idx_n]                       for n in 0..N-1
    after:   embedding(idx, W)  ->  F.embedding(idx + n*V, W.reshape(N*V, D))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def embedding(
    indices: Tensor,
    weight: Tensor,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
    *,
    indices_batched: bool,
) -> Tensor:
    """N embedding tables as one ``[N*V, D]`` table, model n's indices offset by ``n*V``.

    ``padding_idx`` is per model (HFTA honoured model 0's only): the lookup is
    exact, and the gradient at positions holding a model's padding index is cut,
    which is what ``F.embedding(padding_idx=...)`` does to that row's gradient.
    """
    n, vocab, dim = weight.shape
    _check_indices(indices, vocab)
    if not indices_batched:
        indices = indices.unsqueeze(0).expand(n, *indices.shape)
    offsets = torch.arange(n, device=indices.device, dtype=indices.dtype) * vocab
    shifted = indices + offsets.view(n, *([1] * (indices.dim() - 1)))
    out = F.embedding(
        shifted, weight.reshape(n * vocab, dim), None, max_norm, norm_type,
        scale_grad_by_freq, sparse,
    )
    if padding_idx is not None:
        pad = padding_idx if padding_idx >= 0 else padding_idx + vocab
        out = torch.where((indices == pad).unsqueeze(-1), out.detach(), out)
    return out


def _check_indices(indices: Tensor, vocab: int) -> None:
    """Each model's indices must lie in its own table, as ``F.embedding`` demands: offset
    by ``n*V``, model n's index ``V + k`` would silently read model n+1's row k."""
    if indices.numel() == 0:
        return
    low, high = torch.aminmax(indices)
    in_range = (low >= 0) & (high < vocab)
    if indices.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(in_range, "index out of range in self")  # no host sync
    elif not in_range:
        raise IndexError("index out of range in self")
