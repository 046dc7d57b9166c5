"""Convolutions: N convs are one grouped conv.

::

    before (per model i):   y_i = conv2d(x_i, W_i [Cout, Cin/g, k, k], groups=g)
    after:                  y   = conv2d(x [B, N*Cin, H, W], W [N*Cout, Cin/g, k, k], groups=N*g)
    shared x, g == 1:       y   = conv2d(x [B, Cin, H, W],   W [N*Cout, Cin, k, k])   (no groups)

The stacked weight ``[N, Cout, Cin/g, k, k]`` is a free view of the grouped
weight; the output ``[B, N*Cout, H', W']`` is viewed as ``[N, B, Cout, H', W']``.
One rule per op serves ``nn.Conv2d``, ``F.conv2d`` and ``aten.convolution``: the
arguments are bound by name, and stride, padding and dilation handed to the runtime
as one tuple per spatial dim whichever spelling gave them (:func:`per_dim`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedOperatorError
from ..frontends.export import Emitter
from ..ir import EXAMPLE_VALUE, bind_arguments
from ..lowering.runtime import conv as rt_conv
from ..lowering.runtime import layout as rt_layout
from . import padded
from .registry import FusionGroup, GraphBuilder, Widens, rule

aten = torch.ops.aten

_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_CONV_TRANSPOSES = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3}


def conv_parameters(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``F.conv{1,2,3}d``'s parameters (torch's two schemas for them differ only in
    ``padding``'s type, an int list or a string), to bind a call's arguments by."""


def conv_transpose_parameters(input, weight, bias=None, stride=1, padding=0, output_padding=0,
                              groups=1, dilation=1):
    """``F.conv_transpose{1,2,3}d``'s parameters, to bind a call's arguments by."""


def per_dim(value: Any, spatial: int) -> Any:
    """A stride, padding or dilation as one value per spatial dim: ``2 -> (2, 2)``,
    ``[1, 1] -> (1, 1)``; a padding string (``"same"``) or a graph node as it is.  The one
    place the spellings' forms (a module's tuple, a functional's int, a schema's list
    default) meet, so the lowerings see one form
    (:func:`hftc.lowering.runtime.conv.conv_lowerings`)."""
    if isinstance(value, (list, tuple, torch.Size)):
        return tuple(value)
    if isinstance(value, (str, fx.Node)):
        return value
    return (value,) * spatial


def _spatial(group: FusionGroup, functions: dict) -> int:
    if group.module is not None:
        return len(group.module.kernel_size)
    return functions[group.node.target]


def _optional(builder: GraphBuilder, value: fx.Node | None) -> fx.Node | None:
    """A weight must carry the model dim; a weight shared by all models is expanded."""
    return None if value is None else builder.broadcast(value)


def convolution_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding,
    groups)`` -> ``F.conv{1,2,3}d`` or ``F.conv_transpose{1,2,3}d`` by its spatial rank,
    bound by name."""
    a = bind_arguments(e.source.target, args, kwargs)
    spatial = len(a["stride"])
    common = (a["input"], a["weight"], a["bias"], a["stride"], a["padding"])
    if a["transposed"]:
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1]
        return e.call(fn, *common, a["output_padding"], a["groups"], a["dilation"])
    fn = (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]
    return e.call(fn, *common, a["dilation"], a["groups"])


def channels_last_safe(conv: nn.Module | fx.Node) -> bool:
    """May a CPU program run channels-last with this conv (module or call)?  Not a strided
    1x1 2-d / 3-d conv over few channels (:func:`~hftc.lowering.runtime.layout.
    unsafe_strided_pointwise_conv`: oneDNN's weight gradients), nor one not known."""
    if isinstance(conv, nn.Module):
        return not (isinstance(conv, (nn.Conv2d, nn.Conv3d)) and rt_layout.
                    unsafe_strided_pointwise_conv(conv.in_channels // conv.groups,
                                                  conv.kernel_size, conv.stride))
    if conv.op != "call_function" or conv.target not in (F.conv2d, F.conv3d):
        return True
    weight = conv.args[1] if len(conv.args) > 1 else conv.kwargs.get("weight")
    shape = getattr(getattr(weight, "meta", {}).get(EXAMPLE_VALUE), "shape", None)
    stride = conv.args[3] if len(conv.args) > 3 else conv.kwargs.get("stride", 1)
    if shape is None or not isinstance(stride, (int, tuple, list)):
        return False  # not known: assume the worst
    return not rt_layout.unsafe_strided_pointwise_conv(shape[1], shape[2:], stride)


def widened_conv(conv: nn.Module, others, widths, where) -> nn.Module:
    """A convolution at the widest channels (pad_widths=True); not a grouped one."""
    if conv.groups != 1:
        raise UnsupportedOperatorError(
            f"pad_widths=True cannot pad {where}: groups={conv.groups} (a grouped "
            f"conv's channels per group would move with the padding). Give every model "
            f"the same channels there, or groups=1", [type(conv).__name__])
    out_channels, in_channels = widths["weight"][:2]
    return padded.widened(conv, widths, in_channels=in_channels, out_channels=out_channels)


@rule(*[("call_module", cls) for cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d)],
      *[("call_function", fn) for fn in _CONVS], aten={aten.convolution: convolution_as_functional},
      channels_last=channels_last_safe, widens=Widens(widened_conv, weight=True))
def fuse_conv(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    spatial = _spatial(group, _CONVS)
    a = group.arguments(builder, conv_parameters)
    x, conv = a["input"], group.module
    padding_mode = "zeros" if conv is None else conv.padding_mode
    explicit_padding = None if conv is None else tuple(conv._reversed_padding_repeated_twice)
    return builder.call(
        rt_conv.conv, x, builder.broadcast(a["weight"]), _optional(builder, a["bias"]),
        per_dim(a["stride"], spatial), per_dim(a["padding"], spatial),
        per_dim(a["dilation"], spatial), a["groups"],
        spatial=spatial, x_batched=builder.is_batched(x), padding_mode=padding_mode,
        explicit_padding=explicit_padding,
    )


@rule(*[("call_module", cls) for cls in (nn.ConvTranspose1d, nn.ConvTranspose2d,
                                         nn.ConvTranspose3d)],
      *[("call_function", fn) for fn in _CONV_TRANSPOSES],
      aten={aten.conv_transpose1d: F.conv_transpose1d, aten.conv_transpose2d: F.conv_transpose2d,
            aten.conv_transpose3d: F.conv_transpose3d})
def fuse_conv_transpose(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``nn.ConvTransposeNd(...)(x, output_size)`` and ``F.conv_transposeNd``; a module's
    ``output_size`` becomes the output padding that reaches it, computed at run time from
    model 0's input (every model's input has its shape)."""
    spatial = _spatial(group, _CONV_TRANSPOSES)
    a = group.arguments(builder, conv_transpose_parameters)
    x = a["input"]
    stride, padding, output_padding, dilation = (
        per_dim(a[name], spatial) for name in ("stride", "padding", "output_padding", "dilation"))
    output_size = group.arg(1, "output_size") if group.module is not None else None
    if output_size is not None:
        x = builder.broadcast(x)
        output_padding = builder.call(
            rt_conv.conv_transpose_output_padding, x, output_size, stride, padding,
            group.module.kernel_size, dilation, spatial=spatial, batched=False,
        )
    return builder.call(
        rt_conv.conv_transpose, x, builder.broadcast(a["weight"]), _optional(builder, a["bias"]),
        stride, padding, output_padding, a["groups"], dilation,
        spatial=spatial, x_batched=builder.is_batched(x),
    )
