"""Kernels for models that differ in a scalar hyper-parameter.

A sweep over dropout rates, slopes, epsilons or a constant scale still fuses:
the scalar becomes a ``[N, 1, ..., 1]`` tensor broadcast against the fused
activation, so model n computes with its own value::

    before:  dropout(x_n, p=p_n)                  for n in 0..N-1
    after:   x * bernoulli(1 - p[:, None, ...]) / (1 - p[:, None, ...])

Where ATen's fused kernel takes only one scalar (``F.batch_norm``'s ``eps``,
``F.layer_norm``'s ``eps``), the normalization is written out with the same
formula ATen uses, reducing over each model's own dims only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..lowering.kernels import bernoulli_mask, fold_channels, pad_model_dims, unfold_channels
from ..utils import values_on


def scalars(values: Sequence[float], like: Tensor, rank: int) -> Tensor:
    """``values`` (one per model) as a ``[N, 1, ..., 1]`` tensor with ``rank`` per-model dims.

    Its dtype is what the Python scalar would have promoted to (``torch.result_type``),
    so ``x * per_model_scale`` keeps ``x * 0.5``'s dtype.
    """
    dtype = torch.result_type(like, values[0])
    t = values_on(list(values), dtype, like.device)
    return t.reshape(len(values), *([1] * rank))


def dropout(x: Tensor, p: Sequence[float], training: bool, *, feature_dims: int = 0) -> Tensor:
    """Per-model dropout rates; ``feature_dims`` > 0 drops whole channels (Dropout1d/2d/3d)."""
    if not training:
        return x
    rank = x.dim() - 1
    keep = 1 - scalars(p, x, rank)
    mask_shape = list(x.shape)
    for d in range(feature_dims):
        mask_shape[-1 - d] = 1
    mask = bernoulli_mask(mask_shape, keep, x)
    scale = torch.where(keep > 0, 1 / keep.clamp_min(torch.finfo(keep.dtype).tiny), 0)
    return x * mask * scale


def leaky_relu(x: Tensor, negative_slope: Sequence[float]) -> Tensor:
    return torch.where(x > 0, x, x * scalars(negative_slope, x, x.dim() - 1))


def elu(x: Tensor, alpha: Sequence[float]) -> Tensor:
    return torch.where(x > 0, x, scalars(alpha, x, x.dim() - 1) * torch.expm1(x))


def _per_channel(values: Sequence[float], channels: int, like: Tensor) -> Tensor:
    """One value per model -> one per fused channel ``[N*C]`` (model n's C channels)."""
    return values_on(list(values), like.dtype, like.device).repeat_interleave(
        channels
    )


def batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    num_batches_tracked: Tensor | None,
    training: bool,
    *,
    momentum: Sequence[float | None],
    eps: Sequence[float],
    track_running_stats: bool,
) -> Tensor:
    """Batch norm with a momentum and an eps per model (``_BatchNorm.forward`` written out)."""
    n = x.shape[0]
    xf = fold_channels(x, has_batch_dim=True)
    c = xf.shape[1] // n
    dims = [d for d in range(xf.dim()) if d != 1]
    shape = [1, -1] + [1] * (xf.dim() - 2)
    eps_c = _per_channel(eps, c, xf).reshape(shape)
    bn_training = training or (running_mean is None and running_var is None)
    if training and track_running_stats and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if bn_training:
        mean = xf.mean(dims)
        var = xf.var(dims, unbiased=False)
        if training and track_running_stats and running_mean is not None:
            with torch.no_grad():
                count = xf.numel() // xf.shape[1]
                factors = [
                    (1.0 / float(num_batches_tracked[i])) if m is None else m
                    for i, m in enumerate(momentum)
                ]
                f = _per_channel(factors, c, xf)
                unbiased = var * (count / max(count - 1, 1))
                running_mean.view(-1).mul_(1 - f).add_(f * mean)
                running_var.view(-1).mul_(1 - f).add_(f * unbiased)
    else:
        mean = running_mean.reshape(-1)
        var = running_var.reshape(-1)
    y = (xf - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + eps_c)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return unfold_channels(y, n, has_batch_dim=True)


def layer_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None,
    eps: Sequence[float], *, x_batched: bool,
) -> Tensor:
    """Layer norm with an eps per model: normalize the last dims of each model's activations."""
    n = len(eps)
    if not x_batched:
        x = x.unsqueeze(0).expand(n, *x.shape)
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, unbiased=False, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + scalars(eps, x, x.dim() - 1))
    rank = y.dim() - 1
    if weight is not None:
        y = y * pad_model_dims(weight, rank)
    if bias is not None:
        y = y + pad_model_dims(bias, rank)
    return y


def rms_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None,
    eps: Sequence[float | None], *, x_batched: bool,
) -> Tensor:
    """RMS norm with an eps per model (``None`` means the dtype's machine epsilon)."""
    n = len(eps)
    if not x_batched:
        x = x.unsqueeze(0).expand(n, *x.shape)
    values = [torch.finfo(x.dtype).eps if e is None else e for e in eps]
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + scalars(values, x, x.dim() - 1))
    if weight is not None:
        y = y * pad_model_dims(weight, y.dim() - 1)
    return y


def group_norm(
    x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None,
    eps: Sequence[float],
) -> Tensor:
    """Group norm with an eps per model, over ``N*G`` groups."""
    n = x.shape[0]
    xf = fold_channels(x, True)
    b, channels = xf.shape[0], xf.shape[1]
    grouped = xf.reshape(b, n * num_groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    var = grouped.var(-1, unbiased=False, keepdim=True)
    eps_g = _per_channel(eps, num_groups, xf).reshape(1, -1, 1)
    y = ((grouped - mean) * torch.rsqrt(var + eps_g)).reshape(xf.shape)
    shape = [1, channels] + [1] * (xf.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return unfold_channels(y, n, True)
