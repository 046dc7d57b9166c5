"""Memory the update reuses across steps: scratch buffers, cache-sized blocks and row
pieces, per-model scalars and coefficient tensors made once while the values stay::

    whole tensors:  op1 over P, op2 over P, ...          (each pass from memory)
    in blocks:      op1, op2, ... over P[:, 0:c], then P[:, c:2c], ...   (in cache)

The mixin :class:`UpdateMemory` of :class:`~hftc.optim.optimizer.FusedOptimizer`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .coefficients import Coefficients

__all__ = ["UpdateMemory"]


class UpdateMemory(Optimizer):
    """Scratch buffers, blocks and cached coefficients, kept in ``__dict__`` (not in
    ``state_dict``) and dropped when the models change (``_keep_models``)."""

    num_models: int
    _capturable: Any  # CapturableStep's: a capturable step keeps one entry per group

    def _scratch(self, like: Tensor, slot: int = 0) -> Tensor:
        """A reusable temporary shaped like ``like``: slot ``slot`` of a buffer kept across steps.

        The update's temporaries (Adam's denominator, a per-model step) would otherwise
        be allocated and freed once per parameter per step; freed large blocks go back
        to the OS and come back as fresh page faults, which cost more than the
        arithmetic (docs/DESIGN_NOTES.md).  One buffer per slot holds the
        largest parameter, so the memory cost is ``slots x`` the largest parameter, not
        a copy of the model.  Not part of ``state_dict`` (nor of pickling, which
        ``torch.optim.Optimizer.__getstate__`` limits to defaults, state, groups).
        """
        views = self.__dict__.setdefault("_scratch_views", {})
        view = views.get((slot, like))
        if view is not None and view.shape == like.shape and view.dtype == like.dtype \
                and view.device == like.device:
            return view
        buffers = self.__dict__.setdefault("_scratch_buffers", {})
        key = (slot, like.dtype, like.device)
        buf = buffers.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
            buffers[key] = buf
            views.clear()  # views of the old buffer would keep it alive
        view = buf[: like.numel()].view(like.shape)
        views[(slot, like)] = view
        return view

    def _column_blocks(self, tensors: list[Tensor], scratch_slots: int, block_numel: int):
        """Yield ``(blocks, scratch)``: the same column block of every tensor's ``[N, numel / N]``
        view (all shaped like ``tensors[0]`` and contiguous), and ``scratch_slots`` scratch
        tensors of the block's shape::

            whole tensors:  op1 over P, op2 over P, ...          (each pass from memory)
            in blocks:      op1, op2, ... over P[:, 0:c], then P[:, c:2c], ...   (in cache)

        Every element sees the same ops in the same order, so the results do not change;
        only the passes over memory do (one read and write per tensor instead of one per op).
        """
        n = self.num_models
        width = tensors[0].numel() // n
        columns = max(64, block_numel // n // 64 * 64)  # whole vectors per row of a block
        rows = [t.view(n, width) for t in tensors]
        scratch = [self._scratch(tensors[0], k).view(-1) for k in range(scratch_slots)]
        for start in range(0, width, columns):
            c = min(columns, width - start)
            yield ([t[:, start:start + c] for t in rows],
                   [s[: n * c].view(n, c) for s in scratch])

    def _row_chunks(self, tensors: list[Tensor], chunk_numel: int
                    ) -> tuple[list[int], list[tuple[Tensor, ...]]]:
        """Model by model, consecutive 1-D pieces of each row of every tensor's
        ``[N, numel / N]`` view (all shaped like ``tensors[0]`` and contiguous)::

            whole tensors:  op1 over P, op2 over P, ...          (each pass from memory)
            in row chunks:  op1, op2, ... over P[0, 0:c], P[0, c:2c], ..., P[N-1, ...]

        Returns ``(sizes, pieces)``: ``sizes`` one row's piece sizes (whole multiples of 64
        elements of ``chunk_numel`` float32 elements' bytes, the last ragged) and
        ``pieces[t][i * len(sizes) + j]`` tensor ``t``'s piece ``j`` of model ``i``'s row.
        Within a piece every element is model ``i``'s, so an update can call stock's very
        ops with model ``i``'s values as Python scalars, on contiguous memory in cache.
        Every piece but a row's last is a whole number of the kernels' vector steps, so
        each element meets the vectorised or the scalar-tail code exactly as in stock's
        call over model ``i``'s tensor: the same ops, the same rounding.
        """
        width = tensors[0].numel() // self.num_models
        chunk = max(64, chunk_numel * 4 // tensors[0].element_size() // 64 * 64)
        sizes = [chunk] * (width // chunk) + ([width % chunk] if width % chunk else [])
        # All pieces of a tensor in one call (cheaper than a slice per piece).
        return sizes, [t.view(-1).split(sizes * self.num_models) for t in tensors]

    def _row_scratch(self, like: Tensor, numel: int, slots: int) -> list[Tensor]:
        """``slots`` reusable ``numel``-element buffers in ``like``'s dtype (for the
        updates in :meth:`_row_chunks`: small enough to stay in cache)."""
        buffers = self.__dict__.setdefault("_row_scratch_buffers", {})
        key = (like.dtype, like.device)
        buf = buffers.get(key)
        if buf is None or buf.numel() < slots * numel:
            buf = buffers[key] = torch.empty(slots * numel, dtype=like.dtype,
                                             device=like.device)
        return [buf[k * numel:(k + 1) * numel] for k in range(slots)]

    def _row_scalars(self, dtype: torch.dtype, rows: list[list[float]]) -> list[tuple]:
        """Model i's values of ``rows`` (the operands of ``mul_``, ``div_``, ``add_``) as
        ``scalars[i]``: in float32 / float64 as 0-dim tensors of ``dtype``, made once per
        step for all parameters (a Python float is wrapped and cast to the tensor's dtype on
        every call; the 0-dim tensor is the same CPU scalar to the kernel), else the floats."""
        per_model = list(zip(*rows))
        if dtype not in (torch.float32, torch.float64):
            return per_model
        cache = self.__dict__.setdefault("_row_scalar_cache", {})
        key = array("d", [v for row in rows for v in row]).tobytes()  # bit for bit: -0.0
        hit = cache.get(dtype)
        if hit is None or hit[0] != key:
            values = torch.tensor(per_model, dtype=dtype)
            hit = cache[dtype] = (key, [tuple(row.unbind()) for row in values])
        return hit[1]

    def _coefficients(self, values: dict[str, Sequence[float]]) -> Coefficients:
        """``Coefficients(values)``, the very object of the last step while the values stay
        the same (compared bit for bit, so ``-0.0`` is not ``0.0``): its per-model tensors
        and their views are then made once, not on every step (on a GPU also one
        host-to-device copy per step).  One cache entry per set of row names, i.e. per
        call site; a scheduler's change misses once and replaces the entry."""
        cache = self.__dict__.setdefault("_coefficient_cache", {})
        names = tuple(values)
        persistent = self._capturable()
        if persistent:  # one entry per param group (their values differ)
            names = (self.__dict__.get("_group_in_update", 0), *names)
        key = tuple(array("d", row).tobytes() for row in values.values())
        hit = cache.get(names)
        if hit is not None and hit[0] == key:
            return hit[1]
        if persistent and hit is not None and hit[1].persistent:
            hit[1].assign(values)  # in place: a captured step reads the same tensors
            cache[names] = (key, hit[1])
            return hit[1]
        coef = Coefficients(values, persistent)
        cache[names] = (key, coef)
        return coef
