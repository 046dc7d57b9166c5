"""Normalizations: N norms are one norm over N*C channels, each model its own statistics.

::

    batch norm:     [N, B, C, *S] -> [B, N*C, *S] -> F.batch_norm(running stats [N*C] views)
    group norm:     [B, N*C, *S]  -> F.group_norm(num_groups = N*G)
    instance norm:  [B, N*C, *S]  -> F.instance_norm
    layer/rms norm: normalize the last dims (no parameters needed), then each model's affine

Nothing is reduced across models: batch statistics of model n come from its
own channels only, and its running stats are its own slice of the stacked buffer.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..frontends.export import Emitter, fill_defaults
from ..runtime import norms as rt_norms
from ..runtime import per_model as rt_per_model
from .registry import FusionGroup, GraphBuilder, NotFusable, per_model_loop, rule

aten = torch.ops.aten


def batch_norm_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    x, w, b, rm, rv, training, momentum, eps = args[:8]
    return e.call(F.batch_norm, x, rm, rv, w, b, training, momentum, eps)


def instance_norm_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    x, w, b, rm, rv, use_input_stats, momentum, eps = args[:8]
    return e.call(F.instance_norm, x, rm, rv, w, b, use_input_stats, momentum, eps)


def layer_norm_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    x, shape, w, b, eps = fill_defaults(args, (None, None, None, None, 1e-5))[:5]
    return e.call(F.layer_norm, x, shape, w, b, eps)


def group_norm_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    x, groups, w, b, eps = fill_defaults(args, (None, None, None, None, 1e-5))[:5]
    return e.call(F.group_norm, x, groups, w, b, eps)


def _optional(builder: GraphBuilder, value):
    return None if value is None else builder.broadcast(value)


@rule(("call_module", nn.BatchNorm1d), ("call_module", nn.BatchNorm2d),
      ("call_module", nn.BatchNorm3d), per_model=("momentum", "eps"))
def fuse_batch_norm_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    bn = group.module
    attr = lambda name: builder.module_attr(group, name)  # noqa: E731
    if group.per_model:  # momentum or eps differ between the models
        n = builder.num_models
        return builder.call(
            rt_norms.per_model_batch_norm, builder.broadcast(group.args[0]), attr("running_mean"),
            attr("running_var"), attr("weight"), attr("bias"), attr("num_batches_tracked"),
            builder.training_flag(group),
            momentum=tuple(group.per_model.get("momentum", [bn.momentum] * n)),
            eps=tuple(group.per_model.get("eps", [bn.eps] * n)),
            track_running_stats=bn.track_running_stats,
        )
    return builder.call(
        rt_norms.batch_norm, builder.broadcast(group.args[0]), attr("running_mean"),
        attr("running_var"), attr("weight"), attr("bias"), attr("num_batches_tracked"),
        builder.training_flag(group), momentum=bn.momentum, eps=bn.eps,
        track_running_stats=bn.track_running_stats,
    )


@rule(("call_function", F.batch_norm), per_model={"momentum": 6, "eps": 7},
      per_model_defaults=(None, None, False, 0.1, 1e-5),  # weight .. eps
      aten={aten.batch_norm: batch_norm_as_functional})
def fuse_batch_norm_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    running_mean = group.arg(1, "running_mean")
    if running_mean is not None and not builder.is_batched(running_mean):
        raise NotFusable("running statistics shared by all models would mix the models")
    momenta, epses = group.per_model_arg(6, "momentum"), group.per_model_arg(7, "eps")
    if momenta or epses:  # (torch.export's graph of BatchNorm modules whose values differ)
        n = builder.num_models
        return builder.call(
            rt_norms.per_model_batch_norm, builder.broadcast(group.arg(0, "input")), running_mean,
            group.arg(2, "running_var"), _optional(builder, group.arg(3, "weight")),
            _optional(builder, group.arg(4, "bias")), None, group.arg(5, "training", False),
            momentum=tuple(momenta or [group.arg(6, "momentum", 0.1)] * n),
            eps=tuple(epses or [group.arg(7, "eps", 1e-5)] * n),
            track_running_stats=running_mean is not None,
        )
    return builder.call(
        rt_norms.batch_norm, builder.broadcast(group.arg(0, "input")), running_mean,
        group.arg(2, "running_var"), _optional(builder, group.arg(3, "weight")),
        _optional(builder, group.arg(4, "bias")), None, group.arg(5, "training", False),
        momentum=group.arg(6, "momentum", 0.1), eps=group.arg(7, "eps", 1e-5),
        track_running_stats=running_mean is not None,
    )


@rule(("call_module", nn.InstanceNorm1d), ("call_module", nn.InstanceNorm2d),
      ("call_module", nn.InstanceNorm3d), per_model=("momentum", "eps"))
def fuse_instance_norm_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    norm = group.module
    if group.per_model:
        raise NotFusable("instance norms whose momentum or eps differ per model")
    attr = lambda name: builder.module_attr(group, name)  # noqa: E731
    spatial = {nn.InstanceNorm1d: 1, nn.InstanceNorm2d: 2, nn.InstanceNorm3d: 3}[
        next(c for c in type(norm).__mro__ if c in (nn.InstanceNorm1d, nn.InstanceNorm2d,
                                                   nn.InstanceNorm3d))]
    return builder.call(
        rt_norms.instance_norm, builder.broadcast(group.args[0]), attr("running_mean"),
        attr("running_var"), attr("weight"), attr("bias"), builder.training_flag(group),
        momentum=norm.momentum, eps=norm.eps, track_running_stats=norm.track_running_stats,
        spatial=spatial,
    )


#: The other batch and instance norms (SyncBatchNorm, the lazy ones) run as the per-model
#: loop, which sets each model's own ``momentum`` and ``eps``.  (A base-class entry is their
#: rule only where they keep its ``forward``, and then it loops too: ``per_model_loop``.)
rule(("call_module", nn.modules.batchnorm._BatchNorm), name="per_model_loop[batch norm]",
     per_model=("momentum", "eps"))(per_model_loop)
rule(("call_module", nn.modules.instancenorm._InstanceNorm), name="per_model_loop[instance norm]",
     per_model=("momentum", "eps"))(per_model_loop)


@rule(("call_function", F.instance_norm), aten={aten.instance_norm: instance_norm_as_functional})
def fuse_instance_norm_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    running_mean = group.arg(1, "running_mean")
    if running_mean is not None and not builder.is_batched(running_mean):
        raise NotFusable("running statistics shared by all models would mix the models")
    x = group.arg_example(0)
    return builder.call(
        rt_norms.instance_norm, builder.broadcast(group.arg(0, "input")), running_mean,
        group.arg(2, "running_var"), _optional(builder, group.arg(3, "weight")),
        _optional(builder, group.arg(4, "bias")), group.arg(5, "use_input_stats", True),
        momentum=group.arg(6, "momentum", 0.1), eps=group.arg(7, "eps", 1e-5),
        track_running_stats=False, spatial=x.dim() - 2,
    )


@rule(("call_module", nn.GroupNorm), per_model=("eps",))
def fuse_group_norm_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    norm = group.module
    if "eps" in group.per_model:
        return builder.call(
            rt_per_model.group_norm, builder.broadcast(group.args[0]), norm.num_groups,
            builder.module_attr(group, "weight"), builder.module_attr(group, "bias"),
            tuple(group.per_model["eps"]),
        )
    return builder.call(
        rt_norms.group_norm, builder.broadcast(group.args[0]), norm.num_groups,
        builder.module_attr(group, "weight"), builder.module_attr(group, "bias"), norm.eps,
    )


@rule(("call_function", F.group_norm), per_model={"eps": 4},
      aten={aten.group_norm: group_norm_as_functional})
def fuse_group_norm_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    kernel, eps = _eps(group, 4, rt_norms.group_norm, rt_per_model.group_norm)
    return builder.call(
        kernel, builder.broadcast(group.arg(0, "input")), group.arg(1, "num_groups"),
        _optional(builder, group.arg(2, "weight")), _optional(builder, group.arg(3, "bias")),
        eps,
    )


def _eps(group: FusionGroup, position: int, shared_kernel, per_model_kernel) -> tuple:
    """The kernel and ``eps`` of a functional norm: the models' ``eps`` values where they
    differ (what the export front-end gives for norm modules with per-model ``eps``)."""
    values = group.per_model_arg(position, "eps")
    if values is not None:
        return per_model_kernel, tuple(values)
    return shared_kernel, group.arg(position, "eps", 1e-5)


@rule(("call_module", nn.LayerNorm), per_model=("eps",))
def fuse_layer_norm_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    norm = group.module
    x = group.args[0]
    kernel, eps = rt_norms.layer_norm, norm.eps
    if "eps" in group.per_model:
        kernel, eps = rt_per_model.layer_norm, tuple(group.per_model["eps"])
    return builder.call(
        kernel, x, tuple(norm.normalized_shape), builder.module_attr(group, "weight"),
        builder.module_attr(group, "bias"), eps, x_batched=builder.is_batched(x),
    )


@rule(("call_function", F.layer_norm), per_model={"eps": 4},
      aten={aten.layer_norm: layer_norm_as_functional})
def fuse_layer_norm_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x = group.arg(0, "input")
    kernel, eps = _eps(group, 4, rt_norms.layer_norm, rt_per_model.layer_norm)
    return builder.call(
        kernel, x, group.arg(1, "normalized_shape"),
        _optional(builder, group.arg(2, "weight")), _optional(builder, group.arg(3, "bias")),
        eps, x_batched=builder.is_batched(x),
    )


@rule(("call_module", nn.RMSNorm), per_model=("eps",))
def fuse_rms_norm_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    norm = group.module
    x = group.args[0]
    kernel, eps = rt_norms.rms_norm, norm.eps
    if "eps" in group.per_model:
        kernel, eps = rt_per_model.rms_norm, tuple(group.per_model["eps"])
    return builder.call(
        kernel, x, tuple(norm.normalized_shape), builder.module_attr(group, "weight"), eps,
        x_batched=builder.is_batched(x),
    )


@rule(("call_function", F.rms_norm), per_model={"eps": 3}, aten={aten.rms_norm: F.rms_norm})
def fuse_rms_norm_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    x = group.arg(0, "input")
    kernel, eps = _eps(group, 3, rt_norms.rms_norm, rt_per_model.rms_norm)
    if kernel is rt_norms.rms_norm:
        eps = group.arg(3, "eps")  # None: torch's default for the dtype
    return builder.call(
        kernel, x, group.arg(1, "normalized_shape"),
        _optional(builder, group.arg(2, "weight")), eps, x_batched=builder.is_batched(x),
    )
