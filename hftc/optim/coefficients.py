"""Per-model coefficients and the stock ops they feed: a Python scalar ``s`` of stock's
update becomes a ``[N, 1, ..., 1]`` tensor ``c`` (or stays ``s`` when all N models share it)::

    x.addcmul_(y, z, value=s)   ->  addcmul_(x, y, z, c)    (x.addcmul_(y * c, z))
    x.addcdiv_(y, z, value=s)   ->  addcdiv_(x, y, z, coef, name)

See :mod:`hftc.optim.optimizer` for why each rewrite rounds as stock does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError
from ..lowering.runtime.per_model import values_on

__all__ = ["Coefficients", "addcdiv_", "addcmul_", "copy_model_state", "scalar_dtype",
           "takes_stock_update", "HALF_DTYPES"]


def scalar_dtype() -> torch.dtype:
    # The dtype stock optimizers give state["step"] (torch.optim.optimizer._get_scalar_dtype).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


#: Half types, whose parameters each model's stock optimizer updates, as complex ones
#: (:meth:`FusedOptimizer._update_by_stock`).
HALF_DTYPES = (torch.float16, torch.bfloat16)


def takes_stock_update(p: Tensor) -> bool:
    """Is ``p`` updated one by one by the stock class (a half or complex dtype)?"""
    return p.dtype in HALF_DTYPES or p.is_complex()


class Coefficients:
    """Per-model scalars, as ``[N, 1, ..., 1]`` tensors that broadcast over ``[N, *shape]``.

    Built from Python values once per step (one host-to-device copy per dtype and
    device, not one per parameter or per coefficient).

    ``persistent`` (a capturable step, :meth:`FusedOptimizer.refresh_hyperparameters`):
    every row stays a tensor (no shared value becomes a Python scalar, which a CUDA graph
    would keep as a constant), and :meth:`assign` writes new values into the same tensors.
    """

    def __init__(self, values: dict[str, Sequence[float]], persistent: bool = False):
        self._row = {name: k for k, name in enumerate(values)}
        self.persistent = persistent
        self._cache: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._views: dict[tuple[Any, ...], Tensor] = {}
        self._set_rows(values)

    def _set_rows(self, values: dict[str, Sequence[float]]) -> None:
        self._rows = [[float(v) for v in vs] for vs in values.values()]
        # Shared by all N models -> that value; else False.  (NaN never compares equal,
        # so a NaN hyper-parameter takes the tensor path; 0.0 and -0.0 are not shared:
        # dividing by them gives infinities of opposite signs.)
        self._uniform: dict[str, float | bool] = {
            name: row[0] if not self.persistent and all(
                v == row[0] and math.copysign(1.0, v) == math.copysign(1.0, row[0])
                for v in row) else False
            for name, row in zip(values, self._rows)
        }

    def assign(self, values: dict[str, Sequence[float]]) -> None:
        """New values for the same rows, written into the tensors made so far in place
        (their views, held by a captured graph, then read the new values)."""
        if list(values) != list(self._row):
            raise ValueError(f"rows {list(values)} are not {list(self._row)}")
        self._set_rows(values)
        for (dtype, device), table in self._cache.items():
            table.copy_(values_on(self._rows, dtype, device), non_blocking=True)

    def __call__(self, name: str, like: Tensor) -> Tensor:
        """Row ``name`` in ``like``'s dtype and device, shaped to broadcast over ``like``."""
        # Memoised per (row, dtype, device, rank): an update asks for the same few views
        # once per parameter, and each view costs more than the op it feeds at small N.
        view_key = (name, like.dtype, like.device, like.dim())
        view = self._views.get(view_key)
        if view is not None:
            return view
        key = (like.dtype, like.device)
        table = self._cache.get(key)
        if table is None:
            if self.persistent and like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise FusionArgumentError(
                    "a fused optimizer's step is being captured in a CUDA graph before an "
                    "eager step made its coefficient tensors: run optimizer.step() once "
                    "eagerly (a warm-up step) before capturing it")
            # Its own copy: values_on's GPU tensors are shared read-only, and assign()
            # writes into this one.
            table = self._cache[key] = values_on(self._rows, like.dtype, like.device).clone()
        view = table[self._row[name]].view(-1, *([1] * (like.dim() - 1)))
        self._views[view_key] = view
        return view

    def row(self, name: str) -> list[float]:
        """Row ``name`` as N Python floats (model i's value at index i)."""
        return self._rows[self._row[name]]

    def mask(self, name: str, like: Tensor) -> Tensor:
        """Row ``name`` (0/1 values) as a bool ``[N, 1, ..., 1]`` tensor on ``like``'s device."""
        return self(name, like) != 0

    def get(self, name: str, like: Tensor) -> float | Tensor:
        """Row ``name`` as one Python float if all N models share it, else as ``self(name, like)``.

        A shared value then goes to the kernel as a Python scalar, exactly as stock torch
        passes it (one op fewer where the tensor form needs a multiply first, and the
        scalar fast paths of the elementwise kernels).
        """
        uniform = self._uniform[name]
        return self(name, like) if uniform is False else uniform


def addcmul_(x: Tensor, y: Tensor, z: Tensor, c: float | Tensor) -> Tensor:
    """``x += c * y * z`` as stock writes ``x.addcmul_(y, z, value=c)``, with ``c`` per model."""
    if isinstance(c, Tensor):
        return x.addcmul_(y * c, z)
    return x.addcmul_(y, z, value=c)


#: On the CPU, a per-model ``value`` of :func:`addcdiv_` over slices of at least this many
#: elements per model is applied by one ``addcdiv_`` per model (stock's very call, its
#: value a Python float): one pass over ``[N, ...]`` fewer than the product ``y * c``
#: first.  Below, the calls cost more than the pass (docs/DESIGN_NOTES.md).
ONE_BY_ONE_MIN = 1 << 15


def addcdiv_(x: Tensor, y: Tensor, z: Tensor, coef: Coefficients, name: str,
             scratch: Tensor | None = None, one_by_one: bool = True) -> Tensor:
    """``x += c * y / z`` as stock writes ``x.addcdiv_(y, z, value=c)``, with ``c`` the
    per-model row ``name`` of ``coef``.

    One value for all models: stock's call.  Per model: one call per model, one by one,
    each with its own value where the slices are large (``ONE_BY_ONE_MIN``, unless
    ``one_by_one`` is false) or of a half type,
    else one call on the product ``y * c`` (into ``scratch`` if given), which rounds as
    stock does in float32 and float64: ``addcdiv_`` computes ``(value * y) / z``.  In
    float16 / bfloat16 it computes that in float32 and rounds once, where the product
    rounds first (fp16 Adam: 695 of 768 elements a step off stock's by an ulp; 0 / 0
    where ``y * c`` underflows).
    """
    c = coef.get(name, x)
    if not isinstance(c, Tensor):
        return x.addcdiv_(y, z, value=c)
    half = x.dtype in (torch.float16, torch.bfloat16)
    if half or (one_by_one and x.device.type == "cpu"
                and x.numel() // x.shape[0] >= ONE_BY_ONE_MIN):
        for i, value in enumerate(coef.row(name)):
            x[i].addcdiv_(y[i], z[i], value=value)
        return x
    return x.addcdiv_(torch.mul(y, c, out=scratch) if scratch is not None else y * c, z)


def copy_model_state(target: Tensor, value: Tensor, blocks: int = 1) -> None:
    """``target.copy_(value)``; a ``value`` narrower than ``target`` (a model padded to the
    widest, ``hftc.fuse(..., pad_widths=True)``) goes where the padding put the model's
    entries (the leading ones; ``blocks`` > 1: each of dim 0's blocks, as
    ``in_proj_weight``'s q, k, v), zeros on the padding."""
    if isinstance(value, Tensor) and value.dim() == target.dim() and value.shape != target.shape:
        from ..module.padding import into_padded

        into_padded(target, value, blocks)
        return
    target.copy_(value)
