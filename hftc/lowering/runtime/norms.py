"""Fused normalization: batch, instance, group, layer and RMS norm over N models.

::

    before:  batch_norm(x_n, mean_n, var_n, w_n, b_n)            for n in 0..N-1
    after:   batch_norm(x, mean, var, w, b)  ->  F.batch_norm on [B, N*C, H, W]
             (each model's channels are their own channels; running stats update in place)

Models that differ in a scalar (``eps``, ``momentum``, or ``num_batches_tracked`` under a
cumulative average) take :func:`per_model_batch_norm`, ``_BatchNorm.forward`` written
out with one value per model (:mod:`hftc.lowering.runtime.per_model`'s scalars).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .layout import canonical_grad, fold_channels, pad_model_dims, unfold_channels
from .per_model import opmath, per_channel
from .tuning import check_lowering, tunable


def _channel_view(t: Tensor | None) -> Tensor | None:
    return t.flatten() if t is not None else None


def batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    num_batches_tracked: Tensor | None,
    training: bool,
    *,
    momentum: float | None,
    eps: float,
    track_running_stats: bool,
) -> Tensor:
    """N batch norms as one batch norm over ``N*C`` channels, each model its own stats.

    Mirrors ``nn.modules.batchnorm._BatchNorm.forward``.  The running stats are
    views of the stacked ``[N, C]`` buffers, so ATen's in-place update writes each
    model's own slice.  ``momentum=None`` (cumulative average) uses each model's
    ``num_batches_tracked``; when those differ across models (models loaded from
    different checkpoints) each model's factor differs, which one ATen call cannot
    take: :func:`hftc.lowering.runtime.per_model.batch_norm` does it.
    """
    n = x.shape[0]
    eaf = 0.0 if momentum is None else momentum
    if training and track_running_stats and num_batches_tracked is not None:
        if momentum is None:
            counts = num_batches_tracked
            if not bool((counts == counts[0]).all()):
                return per_model_batch_norm(
                    x, running_mean, running_var, weight, bias, num_batches_tracked, training,
                    momentum=[None] * n, eps=[eps] * n, track_running_stats=True,
                )
            eaf = 1.0 / float(counts[0] + 1)
        num_batches_tracked.add_(1)
    bn_training = training or (running_mean is None and running_var is None)
    use_stats = not training or track_running_stats
    y = F.batch_norm(
        fold_channels(x, has_batch_dim=True),
        _channel_view(running_mean) if use_stats else None,
        _channel_view(running_var) if use_stats else None,
        _channel_view(weight), _channel_view(bias), bn_training, eaf, eps,
    )
    return unfold_channels(y, n, has_batch_dim=True)


def instance_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    *,
    momentum: float | None,
    eps: float,
    track_running_stats: bool,
    spatial: int,
) -> Tensor:
    """N instance norms as one over ``N*C`` channels (``_InstanceNorm._apply_instance_norm``)."""
    n = x.shape[0]
    has_batch = x.dim() == spatial + 3
    xf = fold_channels(x, has_batch)
    if not has_batch:
        xf = xf.unsqueeze(0)
    args = (_channel_view(running_mean), _channel_view(running_var), _channel_view(weight),
            _channel_view(bias), training or not track_running_stats,
            momentum if momentum is not None else 0.0, eps)
    if xf.shape[0] == 1 and xf[0, 0].numel() > 1:
        # One sample: ATen's instance_norm's view hands batch_norm's backward a gradient
        # with an odd batch stride, which it gets wrong (docs/DESIGN_NOTES.md, "torch
        # behaviour"); called here, unfold_channels' hook restrides it (values unchanged).
        y = F.batch_norm(xf.contiguous(), *args)
        canonical_grad(y)  # here: the squeeze below would hide it from unfold_channels'
    else:
        y = F.instance_norm(xf, *args)
    if not has_batch:
        y = y.squeeze(0)
    return unfold_channels(y, n, has_batch)


def group_norm(
    x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    """N group norms as one with ``N*G`` groups over ``N*C`` channels."""
    n = x.shape[0]
    y = F.group_norm(
        fold_channels(x, True), n * num_groups, _channel_view(weight), _channel_view(bias), eps
    )
    return unfold_channels(y, n, True)


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, norm_ndim: int) -> Tensor:
    """``y * weight + bias`` with ``[N, *D]`` parameters broadcast over ``[N, *lead, *D]``."""
    if weight is None and bias is None:
        return y
    rank = y.dim() - 1
    w = pad_model_dims(weight, rank) if weight is not None else None
    b = pad_model_dims(bias, rank) if bias is not None else None
    if w is not None and b is not None:
        return torch.addcmul(b, y, w)
    return y * w if w is not None else y + b


def layer_norm_lowerings(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None,
                         bias: Tensor | None, eps: float, *, x_batched: bool) -> list[str]:
    """:func:`layer_norm`'s lowerings, the cost model's choice first::

        affine      F.layer_norm over all N models' rows at once (no affine), then each
                    model's weight and bias as one broadcast multiply-add
        per_model   each model's own F.layer_norm on its slice, weight and bias inside
                    ATen's kernel (forward and backward one pass each): what the serial
                    loop computes, stacked

    A shared ``x`` is normalized once (``affine`` only).  On the CPU ``per_model`` comes
    first from ``_PER_MODEL_MIN_NUMEL`` elements a model: the affine's extra passes over
    every element, forward and backward, cost more than N calls (docs/DESIGN_NOTES.md).
    """
    if not x_batched:
        return ["affine"]
    large = x.device.type == "cpu" and x.numel() // len(x) >= _PER_MODEL_MIN_NUMEL
    return ["per_model", "affine"] if large else ["affine", "per_model"]


#: Elements of one model's input from which its own F.layer_norm call beats the shared
#: normalization + affine on the CPU (:func:`layer_norm_lowerings`).
_PER_MODEL_MIN_NUMEL = 1 << 14


@tunable(layer_norm_lowerings)
def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    *,
    x_batched: bool,
    lowering: str | None = None,
) -> Tensor:
    """Per-model ``F.layer_norm`` (``lowering``: one of :func:`layer_norm_lowerings`).

    ``affine``: normalize the last dims once, then each model's affine.  Normalizing needs
    no parameters, so a shared ``x`` is normalized once for all N.  A bf16/fp16 ``x`` is
    normalized and scaled in float32 and rounded once, as ATen's layer norm does:
    rounding the normalized values before the affine (and their gradient after it) loses
    the small differences its backward is made of.  ``per_model``: ``x[i]`` ``[*lead, *shape]``
    through ``F.layer_norm(x[i], shape, weight[i], bias[i], eps)``, stacked.
    """
    names = layer_norm_lowerings(x, normalized_shape, weight, bias, eps, x_batched=x_batched)
    if check_lowering("layer norm", lowering, names) == "per_model":
        xs = x.unbind(0)
        ws = weight.unbind(0) if weight is not None else [None] * len(xs)
        bs = bias.unbind(0) if bias is not None else [None] * len(xs)
        return torch.stack([F.layer_norm(xi, tuple(normalized_shape), wi, bi, eps)
                            for xi, wi, bi in zip(xs, ws, bs)])
    y = F.layer_norm(opmath(x), tuple(normalized_shape), None, None, eps)
    if not x_batched:
        y = y.unsqueeze(0)
    return _affine(y, weight, bias, len(normalized_shape)).to(x.dtype)


def rms_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None,
    *, x_batched: bool,
) -> Tensor:
    """Per-model ``F.rms_norm``: normalize once, then scale by each model's weight (in
    float32 for a bf16/fp16 ``x``, as :func:`layer_norm`)."""
    y = F.rms_norm(opmath(x), tuple(normalized_shape), None, eps)
    if not x_batched:
        y = y.unsqueeze(0)
    return _affine(y, weight, None, len(normalized_shape)).to(x.dtype)


def per_model_batch_norm(
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
    xf = opmath(fold_channels(x, has_batch_dim=True))
    c = xf.shape[1] // n
    dims = [d for d in range(xf.dim()) if d != 1]
    shape = [1, -1] + [1] * (xf.dim() - 2)
    eps_c = per_channel(eps, c, xf).reshape(shape)
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
                f = per_channel(factors, c, xf)
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
    return unfold_channels(y.to(x.dtype), n, has_batch_dim=True)
