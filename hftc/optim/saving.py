"""A fused optimizer's state over time: ``state_dict`` / ``load_state_dict`` with N and the
per-parameter hyper-parameters, pickling, cutting to some models, and a stock
optimizer's state imported into one model's slice::

    state[P][key]  [N, ...]  ->  state[P][key][keep]     (keep_models)
    stock.state[p_i][key]    ->  state[P][key][i]        (fuse_optimizers)

The mixin :class:`OptimizerState` of :class:`~hftc.optim.optimizer.FusedOptimizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..errors import FusionArgumentError
from .coefficients import copy_model_state

__all__ = ["OptimizerState"]


class OptimizerState(Optimizer):
    """Saving, loading, pickling and cutting a fused optimizer's state."""

    _flags: ClassVar[dict[str, Any]]
    _per_model_scalar_state: ClassVar[tuple[str, ...]]
    num_models: int

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_group_of"] = self.__dict__.get("_group_of")
        state["_group_overrides"] = self.__dict__.get("_group_overrides")
        state["_group_bases"] = self.__dict__.get("_group_bases")
        return state

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict``, and under ``"hftc"`` N and the per-parameter
        hyper-parameters of param-group dicts (which torch's groups, one per model, do
        not hold), so that ``load_state_dict`` restores them as torch restores a group's."""
        saved = super().state_dict()
        saved["hftc"] = {
            "num_models": self.num_models,
            "group_of": list(self._group_of),
            "group_overrides": [{k: list(v) for k, v in extra.items()}
                                for extra in self._group_overrides],
            "group_bases": {k: list(v)
                            for k, v in (self.__dict__.get("_group_bases") or {}).items()},
        }
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, refusing a state dict that is not a fused
        optimizer's over the same N models and parameters (a stock optimizer's loaded
        into N = 1 failed on the next step, inside the update)."""
        extra = state_dict.get("hftc")
        groups = state_dict.get("param_groups", [])
        n, cls = self.num_models, type(self).__name__
        fix = ("N stock optimizers' state goes into a fused one through "
               "hftc.optim.fuse_optimizers(fused, stock_optimizers), which converts it")
        saved_n = extra["num_models"] if extra is not None else len(groups)
        if saved_n != n or len(groups) != n:
            raise FusionArgumentError(
                f"{cls}.load_state_dict: the state dict has {len(groups)} param group(s); "
                f"this fused optimizer has one per model, {n}: it is a stock optimizer's or "
                f"a fused one's over another number of models; {fix}")
        params = self.param_groups[0]["params"]
        for index, p in zip(groups[0]["params"], params):
            for key, value in state_dict.get("state", {}).get(index, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == p.numel() \
                        and value.shape not in (p.shape, (n,)):  # (n,): per-model step counts
                    raise FusionArgumentError(
                        f"{cls}.load_state_dict: state {key!r} of parameter {index} has shape "
                        f"{list(value.shape)}, its stacked parameter {list(p.shape)}: not a "
                        f"fused optimizer's state; {fix}")
        for group in groups:  # what the constructor refuses (differentiable=True, ...)
            self._check_flags({k: group[k] for k in self._flags if k in group},
                              "load_state_dict: ")
        if extra is not None and len(extra["group_of"]) != len(params):
            raise FusionArgumentError(
                f"{cls}.load_state_dict: the state dict is for {len(extra['group_of'])} "
                f"parameters, this optimizer has {len(params)}")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "hftc"})
        self.__dict__.pop("_momentum_ready", None)  # state the update knew is replaced
        # torch moves a fused or capturable group's step counts to the parameter's device
        # as float32, where those updates read them, and NAdam's mu_product to the
        # parameter's device and dtype; hftc keeps the others on the CPU as saved.
        for index, p in zip(groups[0]["params"], params):
            for key in self._per_model_scalar_state:
                if key == "step" and (self._capturable() or self._flag("fused")):
                    continue  # where _new_steps puts them, as torch does
                saved = state_dict.get("state", {}).get(index, {}).get(key)
                loaded = self.state[p].get(key) if p in self.state else None
                if isinstance(saved, Tensor) and isinstance(loaded, Tensor) \
                        and (loaded.device != saved.device or loaded.dtype != saved.dtype):
                    self.state[p][key] = saved.to("cpu").clone()
        if extra is not None:  # as torch restores each group's hyper-parameters
            self._group_of = list(extra["group_of"])
            self._group_overrides = [
                {k: list(v) for k, v in overrides.items()}
                for overrides in extra["group_overrides"]]
        if extra is not None and "group_bases" in extra:
            self._group_bases = {k: list(v) for k, v in extra["group_bases"].items()}
        else:  # a state dict of hftc before the check: its values as saved
            self._note_group_bases()

    def _keep_models(self, keep: Sequence[int]) -> None:
        """Keep only models ``keep`` (checked, distinct indices), in that order, in place::

            param_groups  [g_0, ..., g_N-1]  ->  [g_keep[0], ...]  (the same dicts; the
                          stacked parameters stay in the first group, the same objects)
            state[p][key] [N, ...]           ->  state[p][key][keep]   (moments, steps ...)

        with the per-parameter hyper-parameters of param-group dicts sliced the same way.
        What :func:`hftc.keep_models` calls, together with the fused module's."""
        groups = self.param_groups
        n = len(groups)
        first = groups[0]
        kept = [groups[i] for i in keep]
        moved = {key: first[key] for key in ("params", "param_names") if key in first}
        for k, group in enumerate(kept):
            for key, value in moved.items():
                group[key] = value if k == 0 else []
        self.param_groups = kept
        for p in moved["params"]:
            state = self.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
                    index = torch.tensor(list(keep), dtype=torch.long, device=value.device)
                    state[key] = value.index_select(0, index)
        self._group_overrides = [{key: [values[i] for i in keep] for key, values in extra.items()}
                                 for extra in self._group_overrides]
        self._group_bases = {key: [values[i] for i in keep]
                             for key, values in (self.__dict__.get("_group_bases") or {}).items()}
        for cache in ("_momentum_ready", "_coefficient_cache", "_captured_switches",
                      "_scratch_views", "_group_in_update"):
            self.__dict__.pop(cache, None)  # made for the N models

    def _import_model_state(self, p: Tensor, model: int, stock_state: dict[str, Any]) -> None:
        """Copy a stock optimizer's ``state[p_i]`` into slice ``model`` of ``state[p]``."""
        state = self.state[p]
        for key, value in stock_state.items():
            if value is None:
                continue
            if key not in state:
                raise FusionArgumentError(
                    f"{type(self).__name__}: the stock optimizer of model {model} has state "
                    f"{key!r}, which {type(self).__name__} does not keep"
                )
            if key == "step":
                state["step"][model] = float(value)
            else:
                copy_model_state(state[key][model], value, getattr(p, "_hftc_width_blocks", 1))
