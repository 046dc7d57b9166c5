"""Convolutions: N convs are one grouped conv.

::

    before (per model i):   y_i = conv2d(x_i, W_i [Cout, Cin/g, k, k], groups=g)
    after:                  y   = conv2d(x [B, N*Cin, H, W], W [N*Cout, Cin/g, k, k], groups=N*g)
    shared x, g == 1:       y   = conv2d(x [B, Cin, H, W],   W [N*Cout, Cin, k, k])   (no groups)

The stacked weight ``[N, Cout, Cin/g, k, k]`` is a free view of the grouped
weight; the output ``[B, N*Cout, H', W']`` is viewed as ``[N, B, Cout, H', W']``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..frontends.export import Emitter
from ..runtime import conv as rt_conv
from .registry import FusionGroup, GraphBuilder, rule

aten = torch.ops.aten

_SPATIAL = {
    nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3,
    nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3,
    F.conv1d: 1, F.conv2d: 2, F.conv3d: 3,
    F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3,
}


def _stacked(builder: GraphBuilder, value: fx.Node | None) -> fx.Node | None:
    """A weight must carry the model dim; a weight shared by all models is expanded."""
    return None if value is None else builder.broadcast(value)


@rule(("call_module", nn.Conv1d), ("call_module", nn.Conv2d),
               ("call_module", nn.Conv3d))
def fuse_conv_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    conv = group.module
    x = group.args[0]
    return builder.call(
        rt_conv.conv, x, builder.module_attr(group, "weight"), builder.module_attr(group, "bias"),
        conv.stride, conv.padding, conv.dilation, conv.groups,
        spatial=_SPATIAL[type(conv)] if type(conv) in _SPATIAL else len(conv.kernel_size),
        x_batched=builder.is_batched(x), padding_mode=conv.padding_mode,
        explicit_padding=tuple(conv._reversed_padding_repeated_twice),
    )


def convolution_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding,
    groups)`` -> ``F.conv{1,2,3}d`` or ``F.conv_transpose{1,2,3}d`` by its spatial rank."""
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = args
    spatial = len(stride)
    if transposed:
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1]
        return e.call(fn, x, w, b, stride, padding, output_padding, groups, dilation)
    fn = (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]
    return e.call(fn, x, w, b, stride, padding, dilation, groups)


@rule(("call_function", F.conv1d), ("call_function", F.conv2d),
      ("call_function", F.conv3d), aten={aten.convolution: convolution_as_functional})
def fuse_conv_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x = group.arg(0, "input")
    return builder.call(
        rt_conv.conv, x, _stacked(builder, group.arg(1, "weight")),
        _stacked(builder, group.arg(2, "bias")),
        group.arg(3, "stride", 1), group.arg(4, "padding", 0), group.arg(5, "dilation", 1),
        group.arg(6, "groups", 1),
        spatial=_SPATIAL[group.node.target], x_batched=builder.is_batched(x),
    )


@rule(("call_module", nn.ConvTranspose1d), ("call_module", nn.ConvTranspose2d),
               ("call_module", nn.ConvTranspose3d))
def fuse_conv_transpose_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    conv = group.module
    spatial = len(conv.kernel_size)
    x = builder.broadcast(group.args[0])
    output_padding = conv.output_padding
    output_size = group.arg(1, "output_size")
    if output_size is not None:
        output_padding = builder.call(
            rt_conv.conv_transpose_output_padding, x, output_size, conv.stride, conv.padding,
            conv.kernel_size, conv.dilation, spatial=spatial, batched=False,
        )
    return builder.call(
        rt_conv.conv_transpose, x, builder.module_attr(group, "weight"),
        builder.module_attr(group, "bias"), conv.stride, conv.padding, output_padding,
        conv.groups, conv.dilation, spatial=spatial, x_batched=True,
    )


@rule(("call_function", F.conv_transpose1d), ("call_function", F.conv_transpose2d),
      ("call_function", F.conv_transpose3d),
      aten={aten.conv_transpose1d: F.conv_transpose1d, aten.conv_transpose2d: F.conv_transpose2d,
            aten.conv_transpose3d: F.conv_transpose3d})
def fuse_conv_transpose_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x = group.arg(0, "input")
    return builder.call(
        rt_conv.conv_transpose, x, _stacked(builder, group.arg(1, "weight")),
        _stacked(builder, group.arg(2, "bias")),
        group.arg(3, "stride", 1), group.arg(4, "padding", 0), group.arg(5, "output_padding", 0),
        group.arg(6, "groups", 1), group.arg(7, "dilation", 1),
        spatial=_SPATIAL[group.node.target], x_batched=builder.is_batched(x),
    )
