"""Per-channel ops: pooling, channel dropout, padding, upsampling, pixel shuffle.

They treat every channel alike, so N models' channels side by side are one call::

    before (per model):  max_pool2d(x_i [B, C, H, W])
    after:               max_pool2d(x [B, N*C, H, W]) viewed back as [N, B, C, H', W']

Ops that mix a sample's channels (local response norm, channel shuffle) would mix the
models that way; they take the models as more samples instead (so do im2col's
``unfold``/``fold`` and the spatial transformer's ``affine_grid``/``grid_sample``)::

    before (per model):  local_response_norm(x_i [B, C, H, W], size)
    after:               local_response_norm(x [N*B, C, H, W], size) viewed as [N, B, C, H, W]

The module forms call the (parameterless) module itself on the folded input, so
its hyper-parameters and train/eval mode are exactly the original's.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import ir
from ..frontends.export import Emitter
from ..ir import bind_arguments
from ..runtime import random as rt_random
from ..runtime import spatial as rt_spatial
from .registry import FusionGroup, GraphBuilder, NotFusable, rule

aten = torch.ops.aten

_SPATIAL_MODULES = {
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3,
    nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3,
    nn.AdaptiveMaxPool1d: 1, nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3,
    nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3,
    nn.LPPool1d: 1, nn.LPPool2d: 2, nn.LPPool3d: 3,
    nn.Dropout1d: 1, nn.Dropout2d: 2, nn.Dropout3d: 3,
    nn.ZeroPad1d: 1, nn.ZeroPad2d: 2, nn.ZeroPad3d: 3,
    nn.ConstantPad1d: 1, nn.ConstantPad2d: 2, nn.ConstantPad3d: 3,
    nn.ReflectionPad1d: 1, nn.ReflectionPad2d: 2, nn.ReflectionPad3d: 3,
    nn.ReplicationPad1d: 1, nn.ReplicationPad2d: 2, nn.ReplicationPad3d: 3,
    nn.CircularPad1d: 1, nn.CircularPad2d: 2, nn.CircularPad3d: 3,
    nn.PixelShuffle: 2, nn.PixelUnshuffle: 2,
    nn.Upsample: None, nn.UpsamplingNearest2d: 2,
    nn.UpsamplingBilinear2d: 2, nn.FeatureAlphaDropout: None,
}
_RANDOM = {nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout}

_SPATIAL_FUNCTIONS = {
    F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3,
    F.max_pool1d_with_indices: 1, F.max_pool2d_with_indices: 2, F.max_pool3d_with_indices: 3,
    F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3,
    F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3,
    F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
    F.lp_pool1d: 1, F.lp_pool2d: 2, F.lp_pool3d: 3,
    F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3,
    F.pixel_shuffle: 2, F.pixel_unshuffle: 2, F.interpolate: None, F.upsample: None,
    F.feature_alpha_dropout: None,
}
_RANDOM_FUNCTIONS = {F.dropout1d, F.dropout2d, F.dropout3d, F.feature_alpha_dropout}


def _spatial(known: int | None, group: FusionGroup) -> int:
    # Ops that take any rank see a per-model [B, C, *S] input.
    return known if known is not None else group.arg_example(0).dim() - 2


def fuse_channelwise_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    spatial = _spatial(_SPATIAL_MODULES[_base(type(group.module))], group)
    if group.per_model:
        if "p" not in group.per_model or not isinstance(
            group.module, (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
        ):
            raise NotFusable("per-model hyper-parameters of this module")
        return builder.call(
            rt_random.per_model_dropout, builder.broadcast(group.args[0]),
            tuple(group.per_model["p"]),
            builder.training_flag(group), feature_dims=spatial,
        )
    module = builder.attr(group.node.target, batched=False)
    return builder.call(rt_spatial.channelwise, module, builder.broadcast(group.args[0]),
                        *group.args[1:], spatial=spatial, **group.kwargs)


def _base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c in _SPATIAL_MODULES)


def fuse_channelwise_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    fn = group.node.target
    spatial = _spatial(_SPATIAL_FUNCTIONS[fn], group)
    if fn is F.pad:
        spatial = len(group.arg(1, "pad")) // 2
    return builder.call(ir.bind(rt_spatial.channelwise, fn), builder.broadcast(group.args[0]),
                        *group.args[1:], spatial=spatial, **group.kwargs)


#: Ops that mix the channels of one sample (or work on sample at a time, as im2col
#: does): the models go into the batch.
_SAMPLEWISE = [("call_module", nn.LocalResponseNorm), ("call_module", nn.ChannelShuffle),
               ("call_function", F.local_response_norm), ("call_function", F.channel_shuffle),
               ("call_module", nn.Unfold), ("call_module", nn.Fold),
               ("call_function", F.unfold), ("call_function", F.fold)]


def fuse_samplewise(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    if group.per_model:
        raise NotFusable("per-model hyper-parameters of this op")
    if group.node.op == "call_module":
        kernel, fn = rt_spatial.samplewise, builder.attr(group.node.target, batched=False)
        args: tuple = (fn, builder.broadcast(group.args[0]))
    else:
        kernel = ir.bind(rt_spatial.samplewise, group.node.target)
        args = (builder.broadcast(group.args[0]),)
    return builder.call(kernel, *args, *group.args[1:], **group.kwargs)


def fuse_grid_sample(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``F.grid_sample(x, grid)``: sample b of model n reads its own map with its own grid;
    both fold into a batch of N*B (a shared one is broadcast first, a view)."""
    x, grid = group.arg(0, "input"), group.arg(1, "grid")
    rest = {k: v for k, v in group.kwargs.items() if k not in ("input", "grid")}
    return builder.call(rt_spatial.grid_sample, builder.broadcast(x), builder.broadcast(grid),
                        *group.args[2:], **rest)


def fuse_affine_grid(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``F.affine_grid(theta, size)`` (the spatial transformer's sampling grid): each
    model's ``[B, 2, 3]`` thetas as a batch of N*B, for ``size`` with N*B samples."""
    theta = group.arg(0, "theta")
    rest = {k: v for k, v in group.kwargs.items() if k != "theta"}
    return builder.call(rt_spatial.affine_grid, builder.broadcast(theta), *group.args[1:], **rest)


def fuse_pad(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """Constant padding is elementwise-safe on any rank; reflect/replicate/circular need
    the per-model [B, C, *S] layout, so they go through the channel fold."""
    mode = group.arg(2, "mode", "constant")
    if mode == "constant":
        from .elementwise import fuse_pointwise

        return fuse_pointwise(group, builder)
    return fuse_channelwise_function(group, builder)


def _with_indices(fn):
    """``aten.adaptive_max_pool2d(x, size)`` returns the indices too: ``F.*(..., True)``."""
    def adaptive_max_pool_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
        return e.call(fn, *args, return_indices=True)

    return adaptive_max_pool_as_functional


def constant_pad_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.constant_pad_nd(x, pad, value)`` -> ``F.pad(x, pad, "constant", value)``."""
    a = bind_arguments(e.source.target, args, kwargs)
    return e.call(F.pad, a["input"], a["pad"], "constant", a["value"])


def grid_sampler_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.grid_sampler(x, grid, 0, 0, False)`` -> ``F.grid_sample`` with the modes named."""
    a = bind_arguments(e.source.target, args, kwargs)
    return e.call(F.grid_sample, a["input"], a["grid"],
                  ("bilinear", "nearest", "bicubic")[a["interpolation_mode"]],
                  ("zeros", "border", "reflection")[a["padding_mode"]], a["align_corners"])


#: The ATen ops torch.export records for these functions (``@rule(aten=...)``).
_EXPORTED_AS = {
    **{fn: {getattr(aten, fn.__name__): fn} for fn in (
        F.max_pool1d, F.max_pool2d, F.max_pool3d, F.max_pool1d_with_indices,
        F.max_pool2d_with_indices, F.max_pool3d_with_indices, F.avg_pool1d, F.avg_pool2d,
        F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
        F.pixel_shuffle, F.pixel_unshuffle, F.feature_alpha_dropout)},
    **{fn: {getattr(aten, fn.__name__): _with_indices(fn)} for fn in (
        F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d)},
}

for _cls in _SPATIAL_MODULES:
    rule(("call_module", _cls), name=f"fuse_channelwise[{_cls.__name__}]",
         random=_cls in _RANDOM, per_model=("p",) if _cls in _RANDOM else ())(
        fuse_channelwise_module)
for _fn in _SPATIAL_FUNCTIONS:
    rule(("call_function", _fn), name=f"fuse_channelwise[{_fn.__name__}]",
         random=_fn in _RANDOM_FUNCTIONS, aten=_EXPORTED_AS.get(_fn))(fuse_channelwise_function)
for _key in _SAMPLEWISE:
    rule(_key, name=f"fuse_samplewise[{_key[1].__name__}]")(fuse_samplewise)
_SPATIAL_FUNCTIONS[F.pad] = None  # (fuse_pad's non-constant modes fold channels)
rule(("call_function", F.pad),
     aten={aten.pad: F.pad, aten.constant_pad_nd: constant_pad_as_functional})(fuse_pad)
rule(("call_function", F.grid_sample),
     aten=dict.fromkeys((aten.grid_sampler, aten.grid_sampler_2d, aten.grid_sampler_3d),
                        grid_sampler_as_functional))(fuse_grid_sample)
rule(("call_function", F.affine_grid),
     aten={aten.affine_grid_generator: F.affine_grid})(fuse_affine_grid)
