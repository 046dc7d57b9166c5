"""Losses computed inside forward (a model's own ``labels=`` loss): one loss per model.

::

    before (per model i):  loss_i = F.cross_entropy(logits_i [B, C], labels [B])
    after:                 losses = per_model_loss(F.cross_entropy, logits [N, B, C], labels)
                                    -> [N], model i's mean over its own batch

:func:`~hftc.lowering.runtime.losses.per_model_loss` is what ``hftc.per_model`` computes (the
N batches flattened into one, reduced per model; vmap for the rest).  A per-model
class ``weight`` (a loss module's buffer, or a stacked tensor) runs as a loop.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import ir
from ..frontends.export import Emitter
from ..lowering.runtime import losses as rt_losses
from .registry import FusionGroup, GraphBuilder, NotFusable, rule

aten = torch.ops.aten

#: Each loss: its functional, its module and the ATen ops torch.export records for it.
_LOSSES = {
    F.cross_entropy: (nn.CrossEntropyLoss, (aten.cross_entropy_loss,)),
    F.nll_loss: (nn.NLLLoss, (aten.nll_loss_nd, aten.nll_loss)),
    F.mse_loss: (nn.MSELoss, (aten.mse_loss,)),
    F.l1_loss: (nn.L1Loss, (aten.l1_loss,)),
    F.smooth_l1_loss: (nn.SmoothL1Loss, (aten.smooth_l1_loss,)),
    F.huber_loss: (nn.HuberLoss, (aten.huber_loss,)),
    F.binary_cross_entropy: (nn.BCELoss, (aten.binary_cross_entropy,)),
    F.binary_cross_entropy_with_logits: (nn.BCEWithLogitsLoss,
                                         (aten.binary_cross_entropy_with_logits,)),
    F.soft_margin_loss: (nn.SoftMarginLoss, (aten.soft_margin_loss,)),
}
_FUNCTIONAL_OF = {cls: fn for fn, (cls, _) in _LOSSES.items()}
_FUNCTIONAL_OF_ATEN = {op: fn for fn, (_, ops) in _LOSSES.items() for op in ops}


def fuse_loss(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``F.cross_entropy(logits, labels, ...)`` or ``nn.CrossEntropyLoss(...)(logits,
    labels)`` and kin, their arguments bound by the functional's names (a module's from
    its attributes); those left at None (``weight``, the legacy ``size_average``) dropped."""
    if group.module is None:
        fn = group.node.target
    else:
        fn = next(_FUNCTIONAL_OF[cls] for cls in type(group.module).__mro__
                  if cls in _FUNCTIONAL_OF)
    kwargs = {k: v for k, v in group.arguments(builder, fn).items() if v is not None}
    output, target = kwargs.pop("input"), kwargs.pop("target")
    if any(builder.is_batched(v) for v in kwargs.values()):
        raise NotFusable("a per-model class weight (a loss module's weight buffer, or a "
                         "stacked tensor)")
    return builder.call(ir.bind(rt_losses.per_model_loss, fn), builder.broadcast(output),
                        target, target_batched=builder.is_batched(target), **kwargs)


def loss_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.nll_loss_nd(x, t, None, 1, -100)`` -> ``F.nll_loss(x, t, weight=None,
    reduction="mean", ignore_index=-100)``: bound by name (the ATen schema's), ATen's
    ``reduction`` enum (0 none, 1 mean, 2 sum) as the functional's string."""
    named = ir.bind_arguments(e.source.target, args, kwargs)
    output, target = named.pop("input"), named.pop("target")
    named["reduction"] = ("none", "mean", "sum")[named["reduction"]]
    return e.call(_FUNCTIONAL_OF_ATEN[e.source.target.overloadpacket], output, target, **named)


for _fn, (_cls, _ops) in _LOSSES.items():
    rule(("call_module", _cls), ("call_function", _fn), name=f"fuse_loss[{_fn.__name__}]",
         aten=dict.fromkeys(_ops, loss_as_functional))(fuse_loss)
