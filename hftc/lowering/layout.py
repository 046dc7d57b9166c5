"""Whole-program input layout: feature maps with their channels stored last.

::

    x  [B, C, H, W]      (per model; [N, B, C, H, W] when stacked, 5-D volumes alike)
    -> the same values, strides (H*W*C, 1, W*C, C): torch.channels_last

A convolution given a channels-last input returns a channels-last output, and
batch norm, activations and residual adds keep the layout, so converting the
program's inputs once lays out the whole chain of feature maps channels-last:
no permute between consecutive convolutions.  On a CPU core, oneDNN's
convolutions run some models faster that way and others slower
(docs/DESIGN_NOTES.md), so it is not a default: ``hftc.fuse(...,
autotune=True)`` times the fused program and the models one by one in both
layouts (:func:`hftc.lowering.autotune.choose_program`) and keeps the fastest.

Values are unchanged (only strides move), and so are the program's results,
save the summation order inside the convolutions; outputs are returned
contiguous, as the default layout's are.

This module is the choice (:func:`safe`, :func:`applies`, :func:`given`) and the
conversion of the program's inputs; the memory-format helpers the kernels ask at run
time (``is_channels_last``, ``unsafe_strided_pointwise_conv``) are in
:mod:`hftc.lowering.runtime.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from ..ir import CHANNELS_LAST
from ..passes.registry import channels_last_safe
from .runtime.layout import is_channels_last, unsafe_strided_pointwise_conv


def _is_feature_map(value: Any, batched: bool) -> bool:
    return (isinstance(value, Tensor) and value.is_floating_point()
            and value.dim() - batched in (4, 5))



def _channels_last(value: Tensor, batched: bool) -> Tensor:
    # Move the channel dim last in memory, keep the logical order: for an unbatched 4-D
    # (5-D) tensor this is torch.channels_last (channels_last_3d); for the stacked
    # [N, B, C, ...] each model's slice is.
    channels = 1 + batched
    return value.movedim(channels, -1).contiguous().movedim(-1, channels)



def given(values: Sequence[Any], batched: Sequence[bool]) -> bool:
    """Is a feature-map input already channels-last (and not also contiguous)?"""
    return any(_is_feature_map(v, b) and not v.is_contiguous()
               and _channels_last(v, b).stride() == v.stride()
               for v, b in zip(values, batched))



def applies(values: Sequence[Any], batched: Sequence[bool]) -> bool:
    """Is there a feature-map input whose layout converting would change?"""
    return any(_is_feature_map(v, b) and _channels_last(v, b).stride() != v.stride()
               for v, b in zip(values, batched))



def safe(model: nn.Module, graph: fx.Graph, device: torch.device) -> bool:
    """May the program run channels-last on ``device``?  Not on the CPU if the model
    has a group or instance norm, or a strided 1x1 convolution over few channels
    (:func:`unsafe_strided_pointwise_conv`) (``model``: one model, its modules;
    ``graph``: its traced graph, its calls).  On torch 2.13's CPU:

    * the group-norm backward crashes the process (segmentation fault) on a
      channels-last input when only the norm's weight and bias need gradients (a
      norm on the inputs, or after frozen layers): every shape tried, float32 and
      float64;
    * the instance-norm backward returns wrong input gradients for one sample with a
      channels-last gradient (its batch_norm reads it through a view with an odd
      batch stride); a batch of one can come at any epoch's end;
    * oneDNN's strided 1x1 convolutions over fewer than 16 channels get their weight
      gradients wrong on channels-last inputs and write past their workspace.

    Batch and layer norms do neither.  Whether an input will need its gradient, or
    how large a batch will be, is not known when the program is chosen, so such a
    model keeps its inputs as given on the CPU.  (hftc's own fused kernels
    are exact in either layout: ``norms.instance_norm``, ``conv.conv``; the
    models one by one run their own modules.)

    Which ops are unsafe is declared on their rules (``@rule(..., channels_last=...)``:
    :func:`hftc.passes.registry.channels_last_safe`).
    """
    if device.type != "cpu":
        return True
    return all(channels_last_safe(m) for m in model.modules()) and all(
        channels_last_safe(node) for node in graph.nodes)



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



__all__ = ["CHANNELS_LAST", "applies", "contiguous_outputs", "given", "is_channels_last", "safe",
           "sample_shapes", "to_layout", "unsafe_strided_pointwise_conv"]

