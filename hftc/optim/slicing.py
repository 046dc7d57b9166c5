"""The inverse of ``hftc.optim.fuse_optimizers``: one model's slice of a fused optimizer.

A sweep re-forms its fused arrays when trials are pruned or finish: the
survivors' weights come back with ``fused.unfuse()``, and their optimizer state
must come back too, or momentum / Adam moments restart from zero and a survivor
no longer trains as if alone. ``hftc.optim`` converts N stock optimizers into one
fused optimizer (``fuse_optimizers``) but not back; this module does the way
back, into stock ``torch.optim`` optimizers, so the round trip

    fused optimizer --load_model_slice--> N stock optimizers --fuse_optimizers--> fused

is exact and also leaves optimizers a user can keep training with alone.

It works from a fused optimizer's ``state_dict()`` (the live one or one read
from a checkpoint), so resuming from disk and re-fusing in memory share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import FusionArgumentError

__all__ = ["fused_param_names", "load_model_slice"]


def fused_param_names(fused: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The fused module's parameter name of each parameter the fused optimizer holds, in
    the order of its ``state_dict()["param_groups"][0]["params"]``."""
    names = {id(p): name for name, p in fused.named_parameters()}
    try:
        return [names[id(p)] for p in optimizer.param_groups[0]["params"]]
    except KeyError as exc:
        raise FusionArgumentError(
            "the fused optimizer holds a parameter that is not one of the fused "
            "module's; build it on fused.parameters()") from exc


def stock_keeps(key: str, state: dict[str, Any], index: int, group: dict[str, Any]) -> bool:
    """Does stock torch keep ``key`` for model ``index`` (``group``: its values)?  (The
    fused optimizer keeps every buffer any model needs; stock creates one only for the
    models that use it.)"""
    if key.startswith("has_"):
        return False  # bookkeeping of the fused class (e.g. SGD's has_momentum_buffer)
    flag = state.get(f"has_{key}")
    if isinstance(flag, Tensor) and flag.dim() == 1:
        return bool(flag[index] != 0)  # SGD: a buffer exists once the model stepped with it
    if key == "momentum_buffer" and "momentum" in group:
        return group["momentum"] > 0  # RMSprop: only with momentum
    if key == "max_exp_avg_sq":
        return bool(group.get("amsgrad", False))
    if key == "grad_avg":
        return bool(group.get("centered", False))
    return True


def load_model_slice(
    fused_state: dict[str, Any],
    param_names: Sequence[str],
    index: int,
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
) -> torch.optim.Optimizer:
    """Load model ``index``'s hyper-parameters and state from a fused optimizer into ``optimizer``.

    Args:
        fused_state: ``fused_opt.state_dict()`` of an ``hftc.optim`` optimizer.
        param_names: :func:`fused_param_names` of that optimizer.
        index: which model of the fused array.
        optimizer: a stock optimizer of the matching class with one param group over
            ``model``'s parameters (e.g. ``torch.optim.Adam(model.parameters())``), or,
            for a fused optimizer built with param-group dicts, one group per fused
            group over the same parameters, in its order.
        model: model ``index`` as a plain module (``fused.unfuse()[index]``), whose
            parameter names are the fused ones.

    Returns ``optimizer``, which then continues model ``index`` exactly where the fused
    optimizer would have: ``fuse_optimizers`` of such optimizers rebuilds the fused
    state bit for bit.
    """
    groups = fused_state["param_groups"]
    n = len(groups)
    if not 0 <= index < n:
        raise IndexError(f"model index {index} out of range for a fused optimizer of {n} models")
    mixed = (fused_state.get("hftc") or {}).get("mixed")
    if mixed is not None:  # a MixedOptimizer's: the model's state is in its class's part
        return _load_mixed_model_slice(mixed, param_names, index, optimizer, model)
    # Param-group dicts (nanoGPT's decay / no-decay groups): stock group k takes model
    # ``index``'s values, then fused group k's own overrides (its ``weight_decay`` ...).
    overrides = (fused_state.get("hftc") or {}).get("group_overrides") or [{}]
    if len(optimizer.param_groups) not in (1, len(overrides)):
        raise FusionArgumentError(
            f"the stock optimizer has {len(optimizer.param_groups)} param groups "
            f"and the fused one {len(overrides)}; give it one group per param "
            f"group of the fused optimizer, in its order")
    group = groups[index]
    for k, stock_group in enumerate(optimizer.param_groups):
        for key in stock_group:
            if key not in ("params", "param_names") and key in group:
                stock_group[key] = group[key]
        for key in group:  # what schedulers add (initial_lr, ...) travels too
            if key not in stock_group and key not in ("params", "param_names"):
                stock_group[key] = group[key]
        if len(optimizer.param_groups) > 1:
            stock_group.update({key: values[index] for key, values in overrides[k].items()})

    by_name = dict(model.named_parameters())
    order = groups[0]["params"]
    if len(order) != len(param_names):
        raise FusionArgumentError(
            f"param_names has {len(param_names)} names for {len(order)} fused "
            f"parameters")
    stock_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for pid, name in zip(order, param_names):
        p = by_name.get(name)
        if p is None or id(p) not in stock_params:
            raise FusionArgumentError(
                f"parameter {name!r} of the fused optimizer is not among the stock "
                f"optimizer's parameters of the model")
        state = fused_state["state"].get(pid)
        if not state:
            optimizer.state.pop(p, None)  # not stepped yet, as stock would be
            continue
        sliced: dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != n:
                sliced[key] = value
            elif stock_keeps(key, state, index, group):
                own = value[index]
                if own.dim() == p.dim() and own.shape != p.shape:  # padded (pad_widths=True)
                    from ..module.padding import own_part, width_blocks

                    own = own_part(own, p.shape, width_blocks(model).get(name, 1))
                sliced[key] = own.clone()
        if isinstance(sliced.get("step"), Tensor) and (group.get("fused")
                                                        or group.get("capturable")):
            # Where torch keeps a fused (or capturable) optimizer's step: on the
            # parameter's device, as float32 (its load_state_dict moves it there too).
            sliced["step"] = sliced["step"].to(device=p.device, dtype=torch.float32)
        optimizer.state[p] = sliced
    return optimizer


def _load_mixed_model_slice(mixed: list[dict[str, Any]], param_names: Sequence[str],
                            index: int, optimizer: torch.optim.Optimizer,
                            model: nn.Module) -> torch.optim.Optimizer:
    """:func:`load_model_slice` of a ``MixedOptimizer``'s state dict: model ``index``'s
    row of the part (one fused optimizer per class) that trains it."""
    from ..errors import FusionTypeError

    part = next(part for part in mixed if index in part["rows"])
    if type(optimizer).__name__ != part["class"]:
        raise FusionTypeError(
            f"load_model_slice: model {index} was trained with {part['class']}, and the "
            f"optimizer given for it is a {type(optimizer).__name__}; give a "
            f"torch.optim.{part['class']} over model {index}'s parameters")
    return load_model_slice(part["state"], [param_names[k] for k in part["order"]],
                            part["rows"].index(index), optimizer, model)
