"""Losses computed inside forward (a model's own ``labels=`` loss): one loss per model.

::

    before (per model i):  loss_i = F.cross_entropy(logits_i [B, C], labels [B])
    after:                 losses = per_model_loss(F.cross_entropy, logits [N, B, C], labels)
                                    -> [N], model i's mean over its own batch

:func:`~hftc.runtime.losses.per_model_loss` is what ``hftc.per_model`` computes (the
N batches flattened into one, reduced per model; vmap for the rest).  A per-model
class ``weight`` (a loss module's buffer, or a stacked tensor) runs as a loop.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import ir
from ..frontends.export import Emitter, aten_name
from ..runtime import losses as rt_losses
from .registry import FusionGroup, GraphBuilder, NotFusable, rule

#: Loss modules -> their functional and the attributes passed on as keywords.
_MODULES = {
    nn.CrossEntropyLoss: (F.cross_entropy, ("ignore_index", "label_smoothing")),
    nn.NLLLoss: (F.nll_loss, ("ignore_index",)),
    nn.MSELoss: (F.mse_loss, ()),
    nn.L1Loss: (F.l1_loss, ()),
    nn.SmoothL1Loss: (F.smooth_l1_loss, ("beta",)),
    nn.HuberLoss: (F.huber_loss, ("delta",)),
    nn.BCELoss: (F.binary_cross_entropy, ()),
    nn.BCEWithLogitsLoss: (F.binary_cross_entropy_with_logits, ()),
    nn.SoftMarginLoss: (F.soft_margin_loss, ()),
}
_FUNCTIONS = {fn for fn, _ in _MODULES.values()}


def _emit(group: FusionGroup, builder: GraphBuilder, fn, output, target, kwargs: dict):
    if any(builder.is_batched(v) for v in kwargs.values()):
        raise NotFusable("a per-model class weight")
    kwargs = {k: v for k, v in kwargs.items()
              if not (k in ("size_average", "reduce") and v is None)}
    return builder.call(ir.bind(rt_losses.per_model_loss, fn), builder.broadcast(output),
                        target, target_batched=builder.is_batched(target), **kwargs)


def fuse_loss_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``F.cross_entropy(logits, labels, ...)`` and kin, by position or keyword."""
    fn = group.node.target
    bound = inspect.signature(fn).bind(*group.args, **group.kwargs).arguments
    output, target = bound.pop("input"), bound.pop("target")
    return _emit(group, builder, fn, output, target, bound)


def fuse_loss_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``nn.CrossEntropyLoss(...)(logits, labels)`` and kin, without a weight buffer."""
    module = group.module
    fn, names = next(v for k, v in _MODULES.items() if isinstance(module, k))
    if getattr(module, "weight", None) is not None or \
            getattr(module, "pos_weight", None) is not None:
        raise NotFusable("a loss module with a class weight (a stacked buffer)")
    kwargs = {name: getattr(module, name) for name in names}
    return _emit(group, builder, fn, group.args[0], group.args[1],
                 {"reduction": module.reduction, **kwargs})


aten = torch.ops.aten

#: ATen's loss functions -> the functional, and their arguments after (self, target) by
#: name; ``reduction`` is ATen's enum (0 none, 1 mean, 2 sum).
_EXPORTED_AS = {
    aten.cross_entropy_loss: (F.cross_entropy, ("weight", "reduction", "ignore_index",
                                                "label_smoothing")),
    aten.nll_loss_nd: (F.nll_loss, ("weight", "reduction", "ignore_index")),
    aten.nll_loss: (F.nll_loss, ("weight", "reduction", "ignore_index")),
    aten.mse_loss: (F.mse_loss, ("reduction",)),
    aten.l1_loss: (F.l1_loss, ("reduction",)),
    aten.smooth_l1_loss: (F.smooth_l1_loss, ("reduction", "beta")),
    aten.huber_loss: (F.huber_loss, ("reduction", "delta")),
    aten.binary_cross_entropy: (F.binary_cross_entropy, ("weight", "reduction")),
    aten.binary_cross_entropy_with_logits: (F.binary_cross_entropy_with_logits,
                                            ("weight", "pos_weight", "reduction")),
    aten.soft_margin_loss: (F.soft_margin_loss, ("reduction",)),
}


def loss_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.nll_loss_nd(x, t, None, 1, -100)`` -> ``F.nll_loss(x, t, weight=None,
    reduction="mean", ignore_index=-100)``."""
    fn, names = _EXPORTED_AS[getattr(aten, aten_name(e))]
    output, target, *rest = args
    named = {**dict(zip(names, rest)), **kwargs}
    if "reduction" in named:
        named["reduction"] = ("none", "mean", "sum")[named["reduction"]]
    return e.call(fn, output, target, **named)


for _fn in _FUNCTIONS:
    rule(("call_function", _fn), name=f"fuse_loss[{_fn.__name__}]",
         aten={op: loss_as_functional for op, (fn, _) in _EXPORTED_AS.items() if fn is _fn})(
        fuse_loss_function)
for _cls in _MODULES:
    rule(("call_module", _cls), name=f"fuse_loss[{_cls.__name__}]")(fuse_loss_module)
