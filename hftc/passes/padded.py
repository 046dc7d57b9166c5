"""The padded modules ``pad_widths=True`` builds (:func:`hftc.module.padding.pad_models`):
a module at the widest model's widths, its own tensors zero-padded, and norms whose
statistics count each model's real units only.  The rules say which module is padded
how (``@rule(..., widens=Widens(...))``: :class:`hftc.passes.registry.Widens`)::

    nn.Linear(20, h_i)       ->  widened(linear, widths, in_features=20, out_features=H)
    nn.LayerNorm(h_i)        ->  MaskedLayerNorm(H): mean and variance over the h_i real units

A padded entry is exactly 0 and its gradient is masked (:mod:`hftc.module.padding`), so a
stock forward at the widest widths adds exact zeros to the real units.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn


def mask(shape: Sequence[int], real: Sequence[int], like: Tensor) -> Tensor:
    """1 on ``[:real[0], :real[1], ...]`` of a ``shape`` tensor, 0 elsewhere."""
    mask = torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)
    mask[tuple(slice(0, r) for r in real)] = 1
    return mask


def padded(t: Tensor, shape: Sequence[int]) -> Tensor:
    """``t`` in the first entries of a zero tensor of ``shape``."""
    out = torch.zeros(tuple(shape), dtype=t.dtype, device=t.device)
    out[tuple(slice(0, s) for s in t.shape)] = t.detach()
    return out


def model_like(module: nn.Module) -> Tensor:
    """A tensor of the module's dtype and device, for its masks: its first parameter or
    buffer, else (a norm without affine parameters) the model's, which
    :func:`pad_models` records as ``module._hftc_model_like``."""
    own = next(iter(module.parameters()), None)
    return own if own is not None else module.__dict__["_hftc_model_like"]


class PaddedModule(nn.Module):
    """Holds padded parameters and their masks: ``self.masked(name)`` is the parameter
    times its mask (the mask a non-persistent buffer, so ``state_dict`` has only the
    parameters and buffers the original module had)."""

    def _take(self, source: nn.Module, widths: dict[str, Sequence[int]]) -> None:
        for name, p in source.named_parameters(recurse=False):
            shape = widths[name]
            self.register_parameter(name, nn.Parameter(padded(p, shape), p.requires_grad))
            self.register_buffer(f"{name}_mask", mask(shape, p.shape, p), persistent=False)
        for name, b in source.named_buffers(recurse=False):
            shape = widths.get(name, b.shape)
            self.register_buffer(name, padded(b, shape) if b.dim() else b.detach().clone())
        for name in ("weight", "bias"):
            if name not in self._parameters:
                self.register_parameter(name, None)
        self.training = source.training

    def masked(self, name: str) -> Tensor | None:
        p = getattr(self, name)
        return None if p is None else p * getattr(self, f"{name}_mask")

    def _real_units(self, source: nn.Module, normalized_shape: Sequence[int]) -> None:
        """A norm over the widest ``normalized_shape``: ``unit_mask`` (1 on the source's
        real units) and ``count`` (how many), for statistics over the real units only."""
        real = tuple(source.normalized_shape)
        self.normalized_shape = tuple(normalized_shape)
        like = model_like(source)
        self.register_buffer("unit_mask", mask(normalized_shape, real, like), persistent=False)
        self.register_buffer("count", torch.tensor(float(torch.Size(real).numel()),
                                                   dtype=like.dtype), persistent=False)


def widened(source: nn.Module, widths: dict[str, Sequence[int]],
              blocks: dict[str, int] | None = None, **sizes: int) -> nn.Module:
    """``source`` at the widest widths: a copy of the same class and settings whose own
    tensors are zero-padded to ``widths`` (``blocks[name]`` blocks along dim 0 padded
    each on its own: a packed q, k, v projection), with its size attributes ``sizes``.
    Its forward is the stock one: the padded entries are exactly zero and their
    gradients are masked (module docstring), so they add exact zeros to the real units."""
    wide = copy.deepcopy(source)
    wide.__dict__.pop("_hftc_model_like", None)  # pad_models' note on the source
    for name, p in source.named_parameters(recurse=False):
        value = padded_blocks(p, widths[name], (blocks or {}).get(name, 1))
        wide._parameters[name] = nn.Parameter(value, p.requires_grad)
    for name, b in source.named_buffers(recurse=False):
        if b is not None and b.dim():
            wide._buffers[name] = padded(b, widths.get(name, b.shape))
    for name, value in sizes.items():
        setattr(wide, name, value)
    return wide


def padded_blocks(t: Tensor, shape: Sequence[int], blocks: int) -> Tensor:
    """``t`` padded to ``shape``, its dim 0 as ``blocks`` equal blocks each padded alone::

        [q_i; k_i; v_i]  ([3 e_i, e_i])  ->  [q_i, 0; k_i, 0; v_i, 0]  ([3 E, E])
    """
    if blocks == 1:
        return padded(t, shape)
    inner = (shape[0] // blocks, *shape[1:])
    parts = [padded(part, inner) for part in t.detach().chunk(blocks, 0)]
    return torch.cat(parts, 0)


class MaskedLayerNorm(PaddedModule):
    """``nn.LayerNorm`` over the widest normalized shape, its statistics over the real
    units only::

        mean = sum(x * m) / count;  xc = (x - mean) * m;  var = sum(xc**2) / count
        y = xc / sqrt(var + eps) * (weight * m) + bias * m
    """

    def __init__(self, source: nn.LayerNorm, widths: dict[str, Sequence[int]],
                 normalized_shape: Sequence[int]):
        super().__init__()
        self.eps = source.eps
        self._real_units(source, normalized_shape)
        self._take(source, widths)

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        mean = (x * self.unit_mask).sum(dims, keepdim=True) / self.count
        centred = (x - mean) * self.unit_mask
        var = (centred * centred).sum(dims, keepdim=True) / self.count
        y = centred * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.masked("weight")
        if self.bias is not None:
            y = y + self.masked("bias")
        return y


class MaskedRMSNorm(PaddedModule):
    """``nn.RMSNorm`` over the widest normalized shape, the mean square over the real
    units only: ``y = x * m / sqrt(sum((x * m)**2) / count + eps) * (weight * m)``."""

    def __init__(self, source: nn.Module, widths: dict[str, Sequence[int]],
                 normalized_shape: Sequence[int]):
        super().__init__()
        # eps=None is the input dtype's machine epsilon: the model's dtype (a traced
        # forward cannot read an input's dtype)
        self.eps = torch.finfo(model_like(source).dtype).eps if source.eps is None else source.eps
        self._real_units(source, normalized_shape)
        self._take(source, widths)

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        eps = self.eps
        real = x * self.unit_mask
        y = real * torch.rsqrt((real * real).sum(dims, keepdim=True) / self.count + eps)
        return y if self.weight is None else y * self.masked("weight")


class MaskedGroupNorm(PaddedModule):
    """``nn.GroupNorm`` at the widest channels, each group's statistics over its real
    channels only.  Channel c of model i is in group ``c // (C_i / G_i)``
    (``group_onehot[c, g]``); padded channels are in none::

        group_sum[b, g] = sum_c,s x[b, c, s] * group_onehot[c, g]    (the same for var)
        mean[b, c] = (group_sum / group_size)[b, :] @ group_onehot[c, :]
    """

    def __init__(self, source: nn.GroupNorm, widths: dict[str, Sequence[int]],
                 channels: int, groups: int):
        super().__init__()
        self.num_channels, self.num_groups, self.eps = channels, groups, source.eps
        self.affine = source.affine
        like = model_like(source)
        size = source.num_channels // source.num_groups
        onehot = torch.zeros(channels, groups, dtype=like.dtype)
        real = torch.arange(source.num_channels)
        onehot[real, real // size] = 1
        # a padded group counts 1 channel (its sums are zero): no 0 / 0
        group_size = torch.ones(groups, dtype=like.dtype)
        group_size[:source.num_groups] = size
        self.register_buffer("group_onehot", onehot, persistent=False)
        self.register_buffer("group_onehot_t", onehot.t().contiguous(), persistent=False)
        self.register_buffer("group_size", group_size, persistent=False)
        self.register_buffer("channel_mask", mask([channels], [source.num_channels], like)
                             .unsqueeze(-1), persistent=False)
        self._take(source, widths)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.flatten(2) * self.channel_mask  # [B, C, L]
        count = self.group_size * flat.shape[-1]
        mean = (flat.sum(-1) @ self.group_onehot / count) @ self.group_onehot_t
        centred = (flat - mean.unsqueeze(-1)) * self.channel_mask
        var = (centred * centred).sum(-1) @ self.group_onehot / count
        y = centred * (torch.rsqrt(var + self.eps) @ self.group_onehot_t).unsqueeze(-1)
        y = y.view_as(x)
        if self.affine:
            shape = (-1,) + (1,) * (x.dim() - 2)
            y = y * self.masked("weight").view(shape) + self.masked("bias").view(shape)
        return y


__all__ = ["MaskedGroupNorm", "MaskedLayerNorm", "MaskedRMSNorm", "PaddedModule", "mask",
           "model_like", "padded", "padded_blocks", "widened"]
