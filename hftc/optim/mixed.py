"""Models of one fused array trained with different optimizer classes::

    opts = [torch.optim.SGD(m0.parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(m1.parameters(), lr=1e-3),
            torch.optim.SGD(m2.parameters(), lr=0.05)]
    opt = hftc.optim.fuse_optimizers(hftc.fuse([m0, m1, m2]), opts)   # a MixedOptimizer

One fused optimizer per class (a *part*) updates that class's rows of every stacked
parameter::

    stacked P [N, ...]     rows of SGD: [0, 2]     rows of Adam: [1]
    part SGD:   P_sgd  = P[[0, 2]]   (a gathered copy; a view where the rows are contiguous)
                hftc.optim.SGD over P_sgd, its state [2, ...]
                P[[0, 2]] = P_sgd    (written back; a view is updated in place)
    part Adam:  P_adam = P[1:2]      (a view)  ...

Each part is an ordinary fused optimizer over its models, so each model gets its own
class's update exactly as the fused class gives it (stock's, bit for bit).  The
composite keeps the layout of every fused optimizer: ``param_groups[i]`` is model i's
hyper-parameter dict (its own class's keys), ``param_groups[0]["params"]`` the stacked
parameters, so stock schedulers, ``zero_grad``, ``hftc.amp.GradScaler`` and
``hftc.keep_models`` work unchanged; the parts' groups take the composite's values at
every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..errors import FusionArgumentError
from .optimizer import LIVE_OPTIMIZERS, FusedOptimizer

__all__ = ["MixedOptimizer"]

#: Group keys that are not hyper-parameters: the composite's and a part's differ.
_PARAM_KEYS = ("params", "param_names")


class Part:
    """One class's fused optimizer over its models' rows (``rows``, ascending) of the
    stacked parameters; its parameter k is the rows of stacked parameter ``order[k]``."""

    def __init__(self, optimizer: FusedOptimizer, rows: Sequence[int], order: Sequence[int]):
        self.optimizer = optimizer
        self.order = list(order)
        self.set_rows(rows)

    def set_rows(self, rows: Sequence[int]) -> None:
        self.rows = list(rows)
        first = self.rows[0]
        # Contiguous rows are a view of the stacked tensor (updated in place, no copies).
        self.span = (first, len(self.rows)) \
            if self.rows == list(range(first, first + len(self.rows))) else None
        self._index: dict[torch.device, Tensor] = {}

    def index(self, device: torch.device) -> Tensor:
        index = self._index.get(device)
        if index is None:
            index = self._index[device] = torch.tensor(self.rows, dtype=torch.long,
                                                       device=device)
        return index

    @property
    def proxies(self) -> list[Tensor]:
        return self.optimizer.param_groups[0]["params"]

    def take_groups(self, groups: list[dict[str, Any]]) -> None:
        """Copy the composite's current hyper-parameters (a scheduler's ``lr`` ...) of
        each of this part's models into the part's own group."""
        for j, i in enumerate(self.rows):
            mine = self.optimizer.param_groups[j]
            for key, value in groups[i].items():
                if key not in _PARAM_KEYS:
                    mine[key] = value

    def gather(self, stacked: list[Tensor]) -> list[Tensor]:
        """Point each proxy at this part's rows of its stacked parameter and gradient;
        returns the proxies that have a gradient (the ones the step updates)."""
        stepped = []
        for proxy, k in zip(self.proxies, self.order):
            p = stacked[k]
            if p.grad is None:
                proxy.grad = None
                continue
            if self.span is not None:
                start, length = self.span
                proxy.data = p.detach().narrow(0, start, length)
                proxy.grad = p.grad.narrow(0, start, length)
            else:
                index = self.index(p.device)
                proxy.data = p.detach().index_select(0, index)
                proxy.grad = p.grad.index_select(0, index)
            stepped.append(proxy)
        return stepped

    def scatter(self, stacked: list[Tensor]) -> None:
        """Write the gathered rows back (a view wrote them already) and drop the grads."""
        for proxy, k in zip(self.proxies, self.order):
            if proxy.grad is None:
                continue
            if self.span is None:
                p = stacked[k]
                p.detach().index_copy_(0, self.index(p.device), proxy.detach())
            proxy.grad = None


def _shared_momentum(parts: Sequence[Part]) -> dict[str, Any]:
    """The momentum key (``momentum`` or ``betas``) that every part's class has, as a
    default: torch's OneCycleLR and CyclicLR cycle the one their optimizer's defaults
    name, in every group, so SGD with RMSprop (or Adam with NAdam) cycle as their stock
    optimizers do; with no shared key they refuse (``registering_init`` says why)."""
    return {key: parts[0].optimizer.defaults[key] for key in ("momentum", "betas")
            if all(key in part.optimizer.defaults for part in parts)}


class MixedOptimizer(FusedOptimizer):
    """One fused optimizer for models trained with different optimizer classes (see the
    module docstring); ``hftc.optim.fuse_optimizers`` builds it from N stock optimizers
    of mixed classes, ``unfuse_optimizers`` gives back each model's own class.

    ``state`` of the composite is empty: each model's state (momentum, Adam's moments,
    step counts) lives in its part, ``parts()[c].state``; ``state_dict()`` holds every
    part's under ``["hftc"]["mixed"]``.  Not capturable (the parts are stepped one after
    the other, with host-side gathers).  OneCycleLR / CyclicLR cycle momentum where every
    class names it alike (SGD and RMSprop ``momentum``, the Adam family ``betas``).
    """

    def __init__(self, params: Sequence[Tensor], parts: Sequence[Part]):
        params = list(params)
        n = sum(len(part.rows) for part in parts)
        owner = {i: part for part in parts for i in part.rows}
        if sorted(owner) != list(range(n)) or len(owner) != n:
            raise FusionArgumentError(f"MixedOptimizer: the parts' rows {[p.rows for p in parts]}"
                                      f" are not each of models 0..{n - 1} once")
        groups = []
        for i in range(n):
            part = owner[i]
            group = {key: value for key, value in
                     part.optimizer.param_groups[part.rows.index(i)].items()
                     if key not in _PARAM_KEYS}
            groups.append({"params": params if i == 0 else [], **group})
        self._parts = list(parts)
        self._group_of = [0] * len(params)
        self._group_overrides = [{}]
        self._groups_frozen = False
        Optimizer.__init__(self, groups, {"differentiable": False, **_shared_momentum(parts)})
        self._groups_frozen = True
        LIVE_OPTIMIZERS.add(self)  # found by hftc.keep_models / replace_models

    def parts(self) -> list[FusedOptimizer]:
        """The fused optimizer of each class, in the order of ``part_rows()``."""
        return [part.optimizer for part in self._parts]

    def part_rows(self) -> list[list[int]]:
        """Which models each part updates (model indices of the composite)."""
        return [list(part.rows) for part in self._parts]

    def part_of(self, model: int) -> tuple[FusedOptimizer, int]:
        """Model ``model``'s part and its row in that part."""
        for part in self._parts:
            if model in part.rows:
                return part.optimizer, part.rows.index(model)
        raise IndexError(f"model index {model} out of range for {self.num_models} models")

    def part_parameter_order(self, part: int) -> list[int]:
        """For each parameter of part ``part``, its index in ``param_groups[0]["params"]``."""
        return list(self._parts[part].order)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_parts"] = self._parts
        return state

    def _step_models(self, params: list[Tensor], skip: Sequence[int] = (),
                     skip_on_device: Tensor | None = None) -> None:
        """Each part's step on its rows, the models in ``skip`` left as they were."""
        skipped = set(skip)
        stacked = self.param_groups[0]["params"]
        for part in self._parts:
            part.take_groups(self.param_groups)
            if not part.gather(stacked):
                continue
            try:
                part.optimizer.step(skip_models=[i in skipped for i in part.rows])
            finally:
                part.scatter(stacked)

    def _keep_models(self, keep: Sequence[int]) -> None:
        """Keep models ``keep`` in place: each part keeps its models among them (a part
        left with none is dropped), and its rows become their new indices."""
        keep = list(keep)
        parts = []
        for part in self._parts:
            new_rows = [j for j, old in enumerate(keep) if old in part.rows]
            if not new_rows:
                continue
            local = [part.rows.index(keep[j]) for j in new_rows]
            part.optimizer._keep_models(local)
            index = torch.tensor(local, dtype=torch.long)
            for proxy in part.proxies:  # their values come from the stacked rows at each step
                proxy.grad = None
                proxy.data = proxy.data.index_select(0, index.to(proxy.device))
            part.set_rows(new_rows)
            parts.append(part)
        self._parts = parts
        super()._keep_models(keep)

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict`` of the composite's groups (one per model), and under
        ``["hftc"]["mixed"]`` each part's class, rows, parameter order and state dict
        (what ``load_model_slice`` reads one model's state from)."""
        for part in self._parts:
            part.take_groups(self.param_groups)
        saved = super().state_dict()
        saved["hftc"]["mixed"] = [
            {"class": type(part.optimizer).__name__, "rows": list(part.rows),
             "order": list(part.order), "state": part.optimizer.state_dict()}
            for part in self._parts]
        return saved

    def _layout(self) -> list[tuple[str, list[int], list[int]]]:
        return [(type(p.optimizer).__name__, list(p.rows), list(p.order)) for p in self._parts]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of a ``MixedOptimizer`` with the same classes on the
        same models; anything else is refused, naming what differs."""
        mixed = (state_dict.get("hftc") or {}).get("mixed")
        mine = self._layout()
        if mixed is None:
            raise FusionArgumentError(
                f"MixedOptimizer.load_state_dict: the state dict is not a MixedOptimizer's "
                f"(it has no per-class parts); this optimizer trains models with "
                f"{', '.join(f'{c} (models {rows})' for c, rows, _ in mine)}. Load a "
                f"state_dict() of a MixedOptimizer over the same models, or fuse stock "
                f"optimizers with hftc.optim.fuse_optimizers")
        theirs = [(m["class"], list(m["rows"]), list(m["order"])) for m in mixed]
        if theirs != mine:
            raise FusionArgumentError(
                f"MixedOptimizer.load_state_dict: the state dict trains "
                f"{[(c, rows) for c, rows, _ in theirs]} (class, models), this optimizer "
                f"{[(c, rows) for c, rows, _ in mine]}; each model must keep its class")
        groups = state_dict.get("param_groups", [])
        if len(groups) != self.num_models:
            raise FusionArgumentError(
                f"MixedOptimizer.load_state_dict: the state dict has {len(groups)} param "
                f"group(s), this optimizer one per model, {self.num_models}")
        Optimizer.load_state_dict(self, {"state": {}, "param_groups": groups})
        for part, saved in zip(self._parts, mixed):
            part.optimizer.load_state_dict(saved["state"])
