"""Whole-program input layout: feature maps with their channels stored last.

::

    x  [B, C, H, W]      (per model; [N, B, C, H, W] when stacked, 5-D volumes alike)
    -> the same values, strides (H*W*C, 1, W*C, C): torch.channels_last

A convolution given a channels-last input returns a channels-last output, and
batch norm, activations and residual adds keep the layout, so converting the
program's inputs once lays out the whole chain of feature maps channels-last:
no permute between consecutive convolutions.  On a CPU core, oneDNN's
convolutions run MobileNetV2 at 32x32 about 1.2x faster per model that way and
ResNet-18 a little slower (measured), so it is not a default: ``hftc.fuse(...,
autotune=True)`` times the fused program and the whole-model loop in both
layouts (:func:`hftc.lowering.autotune.choose_program`) and keeps the fastest.

Values are unchanged (only strides move), and so are the program's results,
save the summation order inside the convolutions; outputs are returned
contiguous, as the default layout's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

CHANNELS_LAST = "channels_last"


def _is_feature_map(value: Any, batched: bool) -> bool:
    return (isinstance(value, Tensor) and value.is_floating_point()
            and value.dim() - batched in (4, 5))


def _channels_last(value: Tensor, batched: bool) -> Tensor:
    # Move the channel dim last in memory, keep the logical order: for an unbatched 4-D
    # (5-D) tensor this is torch.channels_last (channels_last_3d); for the stacked
    # [N, B, C, ...] each model's slice is.
    channels = 1 + batched
    return value.movedim(channels, -1).contiguous().movedim(-1, channels)


def applies(values: Sequence[Any], batched: Sequence[bool]) -> bool:
    """Is there a feature-map input whose layout converting would change?"""
    return any(_is_feature_map(v, b) and _channels_last(v, b).stride() != v.stride()
               for v, b in zip(values, batched))


#: Norms whose CPU backward torch 2.13 gets wrong on channels-last tensors (:func:`safe`).
_UNSAFE_MODULES = (nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
_UNSAFE_FUNCTIONS = ("group_norm", "instance_norm")


def safe(model: nn.Module, graph: fx.Graph, device: torch.device) -> bool:
    """May the program run channels-last on ``device``?  Not on the CPU if the model
    has a group or instance norm (``model``: one model, its modules; ``graph``: its
    traced graph, its calls).  On torch 2.13's CPU:

    * the group-norm backward crashes the process (segmentation fault) on a
      channels-last input when only the norm's weight and bias need gradients (a
      norm on the inputs, or after frozen layers): every shape tried, float32 and
      float64;
    * the instance-norm backward returns wrong input gradients for one sample with a
      channels-last gradient (its batch_norm reads it through a view with an odd
      batch stride); a batch of one can come at any epoch's end.

    Batch and layer norms do neither.  Whether an input will need its gradient, or
    how large a batch will be, is not known when the program is chosen, so a model
    with such a norm keeps its inputs as given on the CPU.  (hftc's own fused norms
    are exact in either layout: ``kernels.instance_norm``; the whole-model loop runs
    the models' own modules.)
    """
    if device.type != "cpu":
        return True
    if any(isinstance(m, _UNSAFE_MODULES) for m in model.modules()):
        return False
    return not any(node.op == "call_function"
                   and any(f in getattr(node.target, "__name__", "") for f in _UNSAFE_FUNCTIONS)
                   for node in graph.nodes)


def sample_shapes(values: Sequence[Any], batched: Sequence[bool]) -> tuple:
    """The feature maps' shapes without the model and batch dims: what a layout is
    tuned and checked for."""
    return tuple(tuple(v.shape[1 + b:]) if _is_feature_map(v, b) else None
                 for v, b in zip(values, batched))


def to_layout(values: Sequence[Any], batched: Sequence[bool]) -> list[Any]:
    """The program's inputs with every feature map channels-last."""
    return [_channels_last(v, b) if _is_feature_map(v, b) else v
            for v, b in zip(values, batched)]


def contiguous_outputs(out: Any) -> Any:
    """Outputs laid out as the default program returns them: contiguous."""
    return pytree.tree_map(lambda t: t.contiguous() if isinstance(t, Tensor) else t, out)


__all__ = ["CHANNELS_LAST", "applies", "contiguous_outputs", "safe", "sample_shapes",
           "to_layout"]
