"""Kernels for models that differ in a scalar hyper-parameter.

A sweep over dropout rates, slopes, epsilons or a constant scale still fuses:
the scalar becomes a ``[N, 1, ..., 1]`` tensor broadcast against the fused
activation, so model n computes with its own value::

    before:  dropout(x_n, p=p_n)                  for n in 0..N-1
    after:   x * bernoulli(1 - p[:, None, ...]) / (1 - p[:, None, ...])

Where ATen's fused kernel takes only one scalar (``F.layer_norm``'s ``eps``), the
normalization is written out with the same formula ATen uses, reducing over each
model's own dims only.

This module is the bottom of the per-model scalars: :func:`values_on` and
:func:`scalars` (numbers -> a tensor on the device), the per-model activations and
layer / RMS / group norms.  The per-model batch norm is in :mod:`hftc.lowering.runtime.norms`
(beside the batch norm that falls back to it), the per-model dropout in
:mod:`hftc.lowering.runtime.random`; both build on this module, which imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .layout import fold_channels, pad_model_dims, unfold_channels


def values_on(values: Sequence[float] | Sequence[Sequence[float]], dtype: torch.dtype,
              device: torch.device) -> Tensor:
    """Python numbers as a tensor on ``device`` without stalling a GPU.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which
    synchronizes the stream: the CPU would wait for every queued kernel (the whole
    backward) before issuing the next op. From pinned memory the copy is queued like a
    kernel. The values are made float64 first and cast on the device, so the result is
    what ``torch.tensor(values, dtype=dtype)`` gives on the CPU.

    On a GPU the tensor is made once per (values, dtype, device) and reused: a per-model
    eps or dropout rate then costs no host-to-device copy per call, and a step captured in
    a CUDA graph (``hftc.compile_step``) replays with the same tensor.  Callers never
    write into it.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.float64).to(device=device, dtype=dtype)
    key = (_frozen(values), dtype, device)
    cached = _DEVICE_VALUES.get(key)
    if cached is None:
        if len(_DEVICE_VALUES) >= _DEVICE_VALUES_MAX:
            _DEVICE_VALUES.clear()
        host = torch.tensor(values, dtype=torch.float64)
        cached = _DEVICE_VALUES[key] = host.pin_memory().to(
            device=device, non_blocking=True).to(dtype)
    return cached


#: values_on's GPU tensors; cleared when full (values that change every call, a
#: scheduled dropout rate, must not grow it without bound).
_DEVICE_VALUES: dict[tuple, Tensor] = {}
_DEVICE_VALUES_MAX = 4096


def _frozen(values) -> tuple:
    return tuple(_frozen(v) if isinstance(v, (list, tuple)) else float(v) for v in values)


def scalars(values: Sequence[float], like: Tensor, rank: int) -> Tensor:
    """``values`` (one per model) as a ``[N, 1, ..., 1]`` tensor with ``rank`` per-model dims.

    Its dtype is what the Python scalar would have promoted to (``torch.result_type``),
    so ``x * per_model_scale`` keeps ``x * 0.5``'s dtype.
    """
    dtype = torch.result_type(like, values[0])
    t = values_on(list(values), dtype, like.device)
    return t.reshape(len(values), *([1] * rank))


def _per_model_shape(values: Sequence[float], x: Tensor) -> Tensor:
    """``values`` in ``x``'s dtype, shaped ``[N, 1, ..., 1]`` to ``x [N, ...]``."""
    return values_on(list(values), x.dtype, x.device).reshape(len(values), *[1] * (x.dim() - 1))


def masked_fill(x: Tensor, mask: Tensor, value: Sequence[float]) -> Tensor:
    """``x.masked_fill(mask, value_n)`` on each model's slice of ``x [N, ...]``."""
    return torch.where(mask, _per_model_shape(value, x), x)


def full_like(x: Tensor, fill_value: Sequence[float], *, requires_grad: bool = False,
              **options: Any) -> Tensor:
    """``torch.full_like(x_n, fill_value_n, **options)`` for each model's slice of ``x``."""
    out = torch.empty_like(x, **options)
    out.copy_(_per_model_shape(fill_value, out))
    return out.requires_grad_(requires_grad)


def normalize(x: Tensor, p: float, dim: int, eps: Sequence[float]) -> Tensor:
    """``F.normalize(x_n, p, dim, eps_n)`` for each model's slice: F.normalize's own
    formula (the norm clamped at ``eps`` from below), each model its own ``eps``."""
    denom = x.norm(p, dim, keepdim=True).clamp_min(scalars(eps, x, x.dim() - 1))
    return x / denom.expand_as(x)


def leaky_relu(x: Tensor, negative_slope: Sequence[float]) -> Tensor:
    return torch.where(x > 0, x, x * scalars(negative_slope, x, x.dim() - 1))


def elu(x: Tensor, alpha: Sequence[float]) -> Tensor:
    return torch.where(x > 0, x, scalars(alpha, x, x.dim() - 1) * torch.expm1(x))


def per_channel(values: Sequence[float], channels: int, like: Tensor) -> Tensor:
    """One value per model -> one per fused channel ``[N*C]`` (model n's C channels)."""
    return values_on(list(values), like.dtype, like.device).repeat_interleave(
        channels
    )


def opmath(x: Tensor) -> Tensor:
    """``x`` in the precision ATen's norms compute in: float32 for bf16/fp16 inputs.

    ATen's norms take a bf16 input with float32 weights (what autocast hands them) and
    return bf16, accumulating in float32; the per-model norms written out here do the same:
    compute on ``opmath(x)``, then ``.to(x.dtype)``.
    """
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def layer_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
    eps: Sequence[float], *, x_batched: bool,
) -> Tensor:
    """Layer norm with an eps per model: normalize the last dims of each model's activations."""
    n = len(eps)
    if not x_batched:
        x = x.unsqueeze(0).expand(n, *x.shape)
    xc = opmath(x)
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    mean = xc.mean(dims, keepdim=True)
    var = xc.var(dims, unbiased=False, keepdim=True)
    y = (xc - mean) * torch.rsqrt(var + scalars(eps, xc, x.dim() - 1))
    rank = y.dim() - 1
    if weight is not None:
        y = y * pad_model_dims(weight, rank)
    if bias is not None:
        y = y + pad_model_dims(bias, rank)
    return y.to(x.dtype)


def rms_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None,
    eps: Sequence[float | None], *, x_batched: bool,
) -> Tensor:
    """RMS norm with an eps per model (``None`` means the dtype's machine epsilon)."""
    n = len(eps)
    if not x_batched:
        x = x.unsqueeze(0).expand(n, *x.shape)
    xc = opmath(x)
    values = [torch.finfo(xc.dtype).eps if e is None else e for e in eps]
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    y = xc * torch.rsqrt(xc.pow(2).mean(dims, keepdim=True) + scalars(values, xc, x.dim() - 1))
    if weight is not None:
        y = y * pad_model_dims(weight, y.dim() - 1)
    return y.to(x.dtype)


def group_norm(
    x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None,
    eps: Sequence[float],
) -> Tensor:
    """Group norm with an eps per model, over ``N*G`` groups."""
    n = x.shape[0]
    xf = opmath(fold_channels(x, True))
    b, channels = xf.shape[0], xf.shape[1]
    grouped = xf.reshape(b, n * num_groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    var = grouped.var(-1, unbiased=False, keepdim=True)
    eps_g = per_channel(eps, num_groups, xf).reshape(1, -1, 1)
    y = ((grouped - mean) * torch.rsqrt(var + eps_g)).reshape(xf.shape)
    shape = [1, channels] + [1] * (xf.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return unfold_channels(y.to(x.dtype), n, True)
