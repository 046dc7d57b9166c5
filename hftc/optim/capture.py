"""Capturable steps: a fused optimizer's step replayed by a CUDA graph, its values
refreshed in place before each replay::

    capture:  opt.step()                          (coefficient tensors made once)
    replay:   opt.refresh_hyperparameters(); graph.replay()   (new lr, same tensors)

The mixin :class:`CapturableStep` of :class:`~hftc.optim.optimizer.FusedOptimizer`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch.optim import Optimizer

from ..errors import FusionArgumentError
from .coefficients import takes_stock_update

__all__ = ["CapturableStep"]


class CapturableStep(Optimizer):
    """Whether the step is graph-safe, and the in-place refresh of its values."""

    _hyperparameters: ClassVar[dict[str, str]]
    _flags: ClassVar[dict[str, Any]]
    _stock: ClassVar[type[Optimizer] | None]

    @property
    def is_capturable(self) -> bool:
        """Whether :meth:`step` can be captured in a CUDA graph (``hftc.compile_step``
        captures it then): see :meth:`refresh_hyperparameters`.  Not where a parameter
        takes each model's stock update (:meth:`_update_by_stock`, half and complex
        dtypes: its values are host numbers), so ``compile_step`` runs the step after
        the graph."""
        return self._capturable() and not (self._stock is not None and any(
            takes_stock_update(p) for p in self.param_groups[0]["params"]))

    def _capturable(self) -> bool:
        """Whether the step is graph-safe: coefficient tensors made once and refreshed in
        place, every per-model value a tensor, step counts on the parameters' device, no
        host sync.  ``capturable=True`` where the stock class takes that flag; subclasses
        whose stock class has none (SGD) decide otherwise."""
        return "capturable" in self._flags and self._flag("capturable")

    def _coefficient_rows(self, hp: dict[str, list[Any]]) -> dict[str, list[float]]:
        """The per-model coefficient rows a capturable step reads (``_coefficients``)."""
        raise NotImplementedError

    def _switches(self, hp: dict[str, list[Any]]) -> dict[str, list[bool]]:
        """What picks the ops of a capturable step rather than their values: every flag
        and which values are zero (a weight decay or momentum of 0 drops its ops).  A
        captured graph replays the ops of its capture, so these may not change."""
        out = {}
        for key, kind in self._hyperparameters.items():
            if kind == "flag":
                out[key] = list(hp[key])
            elif key in ("weight_decay", "momentum"):
                out[key] = [v != 0 for v in hp[key]]
        return out

    def refresh_hyperparameters(self) -> None:
        """Copy the current values of ``param_groups`` (which schedulers write) into the
        step's coefficient tensors in place, without reallocating them: a CUDA graph that
        captured ``step()`` then replays it with the new values.  Call it before each
        replay (``hftc.compile_step`` does).

        Raises ``FusionArgumentError`` if the optimizer is not capturable, or if a value
        changed that picks the step's ops (a flag such as ``nesterov`` or ``amsgrad``, a
        weight decay or momentum to or from 0): the captured graph cannot follow that;
        capture the step again."""
        cls = type(self).__name__
        if not self._capturable():
            raise FusionArgumentError(
                f"{cls}.refresh_hyperparameters: this optimizer's step is not capturable "
                f"(it reads its values on the host at every step); construct it with "
                f"capturable=True" + (" (SGD: with its parameters on a CUDA device)"
                                      if "capturable" not in self._flags else ""))
        hp = self.hyperparameters()
        self._check_group_bases(hp)
        captured = self.__dict__.get("_captured_switches", {})
        for k, overrides in enumerate(self._group_overrides):
            group_hp = {**hp, **overrides}
            before, now = captured.get(k), self._switches(group_hp)
            if before is not None and before != now:
                changed = sorted(key for key in now if now[key] != before[key])
                values = ", ".join(f"{key}: {before[key]} -> {now[key]}" for key in changed)
                raise FusionArgumentError(
                    f"{cls}.refresh_hyperparameters: {', '.join(changed)} changed since the "
                    f"step was captured ({values}); "
                    f"they pick the step's ops, which a captured graph replays unchanged. "
                    f"Run optimizer.step() eagerly and capture it again")
            self._group_in_update = k
            self._coefficients(self._coefficient_rows(group_hp))
