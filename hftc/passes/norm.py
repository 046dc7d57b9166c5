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

from ..errors import MismatchError
from ..frontends.export import same_names
from ..lowering.runtime import norms as rt_norms
from ..lowering.runtime import per_model as rt_per_model
from . import padded
from .registry import (
    FusionGroup,
    GraphBuilder,
    NotFusable,
    Reduces,
    Widens,
    rule,
    runs_one_by_one,
)

aten = torch.ops.aten


def _optional(builder: GraphBuilder, value):
    return None if value is None else builder.broadcast(value)


def _arguments(group: FusionGroup, builder: GraphBuilder, functional) -> dict:
    """The norm's arguments by ``functional``'s names, for the module or the function
    (:meth:`FusionGroup.arguments`); a module's ``training`` is the fused module's flag."""
    training = builder.training_flag(group) if group.module is not None else None
    return group.arguments(builder, functional, training=training, use_input_stats=training)


def _per_model_kernel(group: FusionGroup, eps: float, shared_kernel, per_model_kernel) -> tuple:
    """The kernel and ``eps`` of a norm: the models' ``eps`` values where they differ."""
    values = group.per_model_values("eps")
    if values is not None:
        return per_model_kernel, tuple(values)
    return shared_kernel, eps


def _modules(*classes: type) -> list:
    return [("call_module", cls) for cls in classes]


def widened_batch_norm(norm: nn.Module, others, widths, where) -> nn.Module:
    """A batch norm at the widest channels (pad_widths=True): its statistics are per channel,
    a padded channel's all zeros."""
    return padded.widened(norm, widths, num_features=max(m.num_features for m in others))


def masked_layer_norm(norm: nn.Module, others, widths, where) -> nn.Module:
    """A layer or RMS norm over the widest normalized shape, its statistics over each
    model's real units (:class:`~hftc.passes.padded.MaskedLayerNorm`, ``MaskedRMSNorm``)."""
    shapes = [tuple(m.normalized_shape) for m in others]
    if len({len(s) for s in shapes}) > 1:
        raise MismatchError(f"pad_widths=True: {where} normalizes over another number "
                            f"of dims than other models' ({shapes})")
    widest = tuple(max(d) for d in zip(*shapes))
    cls = padded.MaskedLayerNorm if isinstance(norm, nn.LayerNorm) else padded.MaskedRMSNorm
    return cls(norm, widths, widest)


def masked_group_norm(norm: nn.GroupNorm, others, widths, where) -> nn.Module:
    """A group norm at the widest channels and groups, each group's statistics over its
    real channels (:class:`~hftc.passes.padded.MaskedGroupNorm`)."""
    return padded.MaskedGroupNorm(norm, widths, max(m.num_channels for m in others),
                                  max(m.num_groups for m in others))


#: pad_widths=True: batch norms at the widest channels (a norm may have no parameter: its
#: width is then in its attributes).
_WIDENED_BATCH_NORM = Widens(widened_batch_norm, attributes=True)


@rule(*_modules(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), ("call_function", F.batch_norm),
      per_model=("momentum", "eps"), aten={aten.batch_norm: same_names(F.batch_norm)},
      widens=_WIDENED_BATCH_NORM)
def fuse_batch_norm(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    a = _arguments(group, builder, F.batch_norm)
    running_mean = a["running_mean"]
    if running_mean is not None and not builder.is_batched(running_mean):
        raise NotFusable("running statistics shared by all models would mix the models")
    tracked = builder.module_attr(group, "num_batches_tracked") if group.module else None
    inputs = (builder.broadcast(a["input"]), running_mean, a["running_var"],
              _optional(builder, a["weight"]), _optional(builder, a["bias"]), tracked,
              a["training"])
    momenta, epses = group.per_model_values("momentum"), group.per_model_values("eps")
    if momenta or epses:  # (modules, or torch.export's graph of them, whose values differ)
        n = builder.num_models
        return builder.call(
            rt_norms.per_model_batch_norm, *inputs, momentum=tuple(momenta or [a["momentum"]] * n),
            eps=tuple(epses or [a["eps"]] * n), track_running_stats=running_mean is not None)
    return builder.call(rt_norms.batch_norm, *inputs, momentum=a["momentum"], eps=a["eps"],
                        track_running_stats=running_mean is not None)


_INSTANCE_NORMS = {nn.InstanceNorm1d: 1, nn.InstanceNorm2d: 2, nn.InstanceNorm3d: 3}


# channels_last=False (group and instance norms): torch's CPU backward of these norms is
# wrong or crashes on channels-last tensors (hftc.lowering.layout.safe says which).
@rule(*_modules(*_INSTANCE_NORMS), ("call_function", F.instance_norm),
      per_model=("momentum", "eps"), aten={aten.instance_norm: same_names(F.instance_norm)},
      channels_last=False)
def fuse_instance_norm(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    if group.per_model:
        raise NotFusable("instance norms whose momentum or eps differ per model")
    a = _arguments(group, builder, F.instance_norm)
    running_mean = a["running_mean"]
    if running_mean is not None and not builder.is_batched(running_mean):
        raise NotFusable("running statistics shared by all models would mix the models")
    if group.module is not None:  # InstanceNorm2d also takes an unbatched [C, H, W]
        spatial = next(n for cls, n in _INSTANCE_NORMS.items() if isinstance(group.module, cls))
    else:
        spatial = group.arg_example(0).dim() - 2
    return builder.call(
        rt_norms.instance_norm, builder.broadcast(a["input"]), running_mean, a["running_var"],
        _optional(builder, a["weight"]), _optional(builder, a["bias"]), a["use_input_stats"],
        momentum=a["momentum"], eps=a["eps"], track_running_stats=running_mean is not None,
        spatial=spatial,
    )


#: The other batch and instance norms (SyncBatchNorm, the lazy ones) run one by one (the
#: fallback), which sets each model's own ``momentum`` and ``eps``.  (A base-class entry is their
#: rule only where they keep its ``forward``, and then it loops too: ``runs_one_by_one``.)
rule(("call_module", nn.modules.batchnorm._BatchNorm), name="one_by_one[batch norm]",
     per_model=("momentum", "eps"), widens=_WIDENED_BATCH_NORM)(runs_one_by_one)
rule(("call_module", nn.modules.instancenorm._InstanceNorm), name="one_by_one[instance norm]",
     per_model=("momentum", "eps"), channels_last=False)(runs_one_by_one)


@rule(("call_module", nn.GroupNorm), ("call_function", F.group_norm), per_model=("eps",),
      aten={aten.group_norm: same_names(F.group_norm)}, channels_last=False,
      widens=Widens(masked_group_norm, attributes=True))
def fuse_group_norm(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    a = _arguments(group, builder, F.group_norm)
    kernel, eps = _per_model_kernel(group, a["eps"], rt_norms.group_norm, rt_per_model.group_norm)
    return builder.call(
        kernel, builder.broadcast(a["input"]), a["num_groups"], _optional(builder, a["weight"]),
        _optional(builder, a["bias"]), eps,
    )


def layer_norm_over_real_units(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``F.layer_norm``'s arguments for ``padding_graph.reduce`` (pad_widths=True): the
    normalized dims (the last ones) over each model's real units (a module's: refused)."""
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return {"dim": tuple(range(-k, 0)), "weight": weight, "bias": bias, "eps": eps}


@rule(("call_module", nn.LayerNorm), ("call_function", F.layer_norm), per_model=("eps",),
      aten={aten.layer_norm: same_names(F.layer_norm)},
      padding=Reduces("layer_norm", layer_norm_over_real_units),
      widens=Widens(masked_layer_norm, attributes=True))
def fuse_layer_norm(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    a = _arguments(group, builder, F.layer_norm)
    x = a["input"]
    kernel, eps = _per_model_kernel(group, a["eps"], rt_norms.layer_norm, rt_per_model.layer_norm)
    return builder.call(
        kernel, x, a["normalized_shape"], _optional(builder, a["weight"]),
        _optional(builder, a["bias"]), eps, x_batched=builder.is_batched(x),
    )


@rule(("call_module", nn.RMSNorm), ("call_function", F.rms_norm), per_model=("eps",),
      aten={aten.rms_norm: F.rms_norm}, widens=Widens(masked_layer_norm, attributes=True))
def fuse_rms_norm(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    a = _arguments(group, builder, F.rms_norm)
    x = a["input"]
    kernel, eps = _per_model_kernel(group, a["eps"], rt_norms.rms_norm, rt_per_model.rms_norm)
    return builder.call(
        kernel, x, a["normalized_shape"], _optional(builder, a["weight"]), eps,
        x_batched=builder.is_batched(x),
    )
