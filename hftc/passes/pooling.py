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

import re

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import ir
from ..frontends.export import Emitter
from ..ir import bind_arguments
from ..lowering.runtime import random as rt_random
from ..lowering.runtime import spatial as rt_spatial
from .registry import EXACT, PER_CHANNEL, FusionGroup, GraphBuilder, NotFusable, rule

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
_PAD_MODULES = [cls for cls in _SPATIAL_MODULES if cls.__name__[:-2].endswith("Pad")]
_CHANNEL_DROPOUTS = {nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d,
                     nn.Dropout3d: F.dropout3d}

def _snake_case(name: str) -> str:
    """``AdaptiveMaxPool2d`` -> ``adaptive_max_pool2d``, the functional a module calls."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


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

#: Each functional and the modules that call it (fuse_pad serves the padding modules).
_MODULES_OF: dict = {fn: [] for fn in _SPATIAL_FUNCTIONS}
for _cls in _SPATIAL_MODULES:
    if _cls in _PAD_MODULES:
        continue
    _MODULES_OF[{
        nn.Upsample: F.interpolate, nn.UpsamplingNearest2d: F.interpolate,
        nn.UpsamplingBilinear2d: F.interpolate, nn.FeatureAlphaDropout: F.feature_alpha_dropout,
        nn.LPPool1d: F.lp_pool1d, nn.LPPool2d: F.lp_pool2d, nn.LPPool3d: F.lp_pool3d,
    }.get(_cls) or getattr(F, _snake_case(_cls.__name__))].append(_cls)


def _input_and_rest(group: FusionGroup) -> tuple[fx.Node, tuple, dict]:
    """The op's (fused) input, given by position or as ``input=``, and its other arguments."""
    if group.args:
        return group.args[0], group.args[1:], dict(group.kwargs)
    kwargs = dict(group.kwargs)
    return kwargs.pop("input"), (), kwargs


def _spatial(known: int | None, group: FusionGroup) -> int:
    # Ops that take any rank see a per-model [B, C, *S] input.
    if known is not None:
        return known
    return group.arg_example(0 if group.node.args else "input").dim() - 2


def fuse_channelwise(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``nn.MaxPool2d(...)(x)`` or ``F.max_pool2d(x, ...)`` and kin: the module itself (its
    hyper-parameters and mode exactly the original's) or the functional on the models'
    channels side by side (:func:`~hftc.lowering.runtime.spatial.channelwise`); channel dropout with
    per-model rates as :func:`~hftc.lowering.runtime.random.per_model_dropout`."""
    x, args, kwargs = _input_and_rest(group)
    module = group.module
    if module is None:
        spatial = _spatial(_SPATIAL_FUNCTIONS[group.node.target], group)
        if group.node.target is F.pad:
            spatial = len(group.arg(1, "pad")) // 2
    else:
        spatial = _spatial(_SPATIAL_MODULES[_base(type(module))], group)
    if group.per_model:
        p = group.per_model_values("p")
        if p is None or not (isinstance(module, tuple(_CHANNEL_DROPOUTS))
                             or group.node.target in _CHANNEL_DROPOUTS.values()):
            raise NotFusable("per-model hyper-parameters of this op")
        training = (builder.training_flag(group) if module is not None
                    else group.arguments(builder, group.node.target)["training"])
        return builder.call(rt_random.per_model_dropout, builder.broadcast(x), tuple(p),
                            training, feature_dims=spatial)
    if module is not None:
        return builder.call(rt_spatial.channelwise, builder.attr(group.node.target, batched=False),
                            builder.broadcast(x), *args, spatial=spatial, **kwargs)
    return builder.call(ir.bind(rt_spatial.channelwise, group.node.target), builder.broadcast(x),
                        *args, spatial=spatial, **kwargs)


def _base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c in _SPATIAL_MODULES)


#: Ops that mix the channels of one sample (or work on sample at a time, as im2col
#: does): the models go into the batch.
_SAMPLEWISE = [("call_module", nn.LocalResponseNorm), ("call_module", nn.ChannelShuffle),
               ("call_function", F.local_response_norm), ("call_function", F.channel_shuffle),
               ("call_module", nn.Unfold), ("call_module", nn.Fold),
               ("call_function", F.unfold), ("call_function", F.fold)]


def fuse_samplewise(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    if group.per_model:
        raise NotFusable("per-model hyper-parameters of this op")
    x = builder.broadcast(group.arg(0, "input"))  # given by position or as input=
    rest = {k: v for k, v in group.kwargs.items() if k != "input"}
    if group.node.op == "call_module":
        kernel, fn = rt_spatial.samplewise, builder.attr(group.node.target, batched=False)
        args: tuple = (fn, x)
    else:
        kernel = ir.bind(rt_spatial.samplewise, group.node.target)
        args = (x,)
    return builder.call(kernel, *args, *group.args[1:], **rest)


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
    mode = "module" if group.module is not None else group.arg(2, "mode", "constant")
    if mode == "constant":
        from .elementwise import fuse_pointwise

        return fuse_pointwise(group, builder)
    return fuse_channelwise(group, builder)


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

#: What these compute over a padded dim (``@rule(padding=...)``): pooling is per channel,
#: exact while its spatial dims are whole; channel dropout is elementwise.
_PADDING = {
    **dict.fromkeys((F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d,
                     F.avg_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d,
                     F.adaptive_max_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                     F.adaptive_avg_pool3d), PER_CHANNEL),
    **dict.fromkeys(_RANDOM_FUNCTIONS, EXACT),
}

for _fn, _modules in _MODULES_OF.items():
    rule(*(("call_module", cls) for cls in _modules), ("call_function", _fn),
         name=f"fuse_channelwise[{_fn.__name__}]", random=_fn in _RANDOM_FUNCTIONS,
         per_model=("p",) if _fn in _RANDOM_FUNCTIONS else (), aten=_EXPORTED_AS.get(_fn),
         padding=_PADDING.get(_fn))(fuse_channelwise)
for _key in _SAMPLEWISE:
    rule(_key, name=f"fuse_samplewise[{_key[1].__name__}]")(fuse_samplewise)
_SPATIAL_FUNCTIONS[F.pad] = None  # (fuse_pad's non-constant modes fold channels)
rule(*(("call_module", cls) for cls in _PAD_MODULES), ("call_function", F.pad),
     aten={aten.pad: F.pad, aten.constant_pad_nd: constant_pad_as_functional})(fuse_pad)
rule(("call_function", F.grid_sample),
     aten=dict.fromkeys((aten.grid_sampler, aten.grid_sampler_2d, aten.grid_sampler_3d),
                        grid_sampler_as_functional))(fuse_grid_sample)
rule(("call_function", F.affine_grid),
     aten={aten.affine_grid_generator: F.affine_grid})(fuse_affine_grid)
