"""Mixed precision for fused models: a gradient scaler with one loss scale per model.

``torch.amp.GradScaler`` keeps one scale for everything it scales: on a fused
module an overflow in one model would skip the step, and halve the scale, for
all N (HFTA's weak point). ``hftc.amp.GradScaler`` keeps a scale per model and
skips only the models whose gradients are not finite::

    scaler = hftc.amp.GradScaler()
    with torch.autocast("cuda", dtype=torch.float16):
        losses = hftc.per_model(F.cross_entropy)(fused(x), y)      # [N]
    scaler.scale(losses).sum().backward()     # model i's loss times scale[i]
    scaler.unscale_(opt)                      # optional: e.g. to clip per model
    scaler.step(opt)                          # skips only models with inf/NaN grads
    scaler.update()                           # each model's scale grows / backs off alone

A skipped model keeps its parameters, optimizer state and step counter exactly
(``FusedOptimizer.step(skip_models=...)``). Growth and back-off follow
``torch.amp.GradScaler`` (``init_scale``, ``growth_factor``, ``backoff_factor``,
``growth_interval``), per model: model i's scale sequence is the one torch's
scaler would follow training model i alone. Device-agnostic (CPU included).

With a capturable optimizer (``optimizer.is_capturable``: ``hftc.optim.Adam(...,
capturable=True)``, ``hftc.optim.SGD`` on CUDA) ``unscale_``, ``step`` and ``update``
never read a value on the host: the per-model found-inf flags and scales stay device
tensors, and ``step`` hands the flags to ``optimizer.step(skip_models=found_inf)``,
which puts the skipped models back with ``torch.where``.  ``hftc.compile_step`` then
captures the scaled step in one CUDA graph.  Otherwise ``step`` reads the flags once
(it skips the update entirely when every model overflowed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError, FusionTypeError
from ..optim.optimizer import FusedOptimizer

__all__ = ["GradScaler"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


class GradScaler:
    """Per-model dynamic loss scaling for a fused optimizer (see the module docstring).

    Args:
        num_models: N; if ``None``, taken from the first ``scale()`` call.  A device
            (``"cuda"``, ``torch.device``) in its place, ``torch.amp.GradScaler``'s first
            argument, is accepted as ``device``.
        init_scale, growth_factor, backoff_factor, growth_interval: as in
            ``torch.amp.GradScaler``, applied to each model's scale separately.
        enabled: if ``False``, ``scale`` returns its input and ``step`` just steps.
        device: accepted for ``torch.amp.GradScaler``'s signature; the scales live on the
            device of the losses ``scale()`` is given.
    """

    def __init__(self, num_models: int | str | torch.device | None = None,
                 init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, *, device: str | torch.device | None = None):
        if isinstance(num_models, (str, torch.device)):  # GradScaler("cuda"), torch's habit
            device, num_models = num_models, None
        if device is not None:
            torch.device(device)  # a bad device name fails here, as in torch
        if num_models is not None and (isinstance(num_models, bool)
                                       or not isinstance(num_models, int) or num_models < 1):
            raise TypeError(f"GradScaler: num_models must be a positive int (or a device, as "
                            f"torch.amp.GradScaler takes), got {num_models!r}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self._enabled = enabled
        self._num_models = num_models
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._scale: Tensor | None = None            # [N] float32
        self._growth_tracker: Tensor | None = None   # [N] int32
        self._per_optimizer: dict[int, dict[str, Any]] = {}

    # ------------------------------------------------------------ scaling

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def num_models(self) -> int | None:
        return self._num_models

    def _lazy_init(self, n: int, device: torch.device) -> None:
        if self._num_models is None:
            self._num_models = n
        elif n != self._num_models:
            # (a FusionArgumentError is a ValueError, as this was)
            raise FusionArgumentError(
                f"GradScaler: got {n} per-model losses but the scaler has {self._num_models} "
                f"models (each its own scale). Where hftc.keep_models or hftc.EarlyStopping "
                f"cut the fused module, make the scaler again for the models kept "
                f"(scaler = hftc.amp.GradScaler(...)); else give it one loss per model of "
                f"this fused module"
            )
        if self._scale is None:
            self._scale = torch.full((n,), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.zeros(n, dtype=torch.int32, device=device)
        elif self._scale.device != device:  # e.g. loaded on the CPU, training on a GPU
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)

    def scale(self, outputs: Tensor | Sequence[Tensor]) -> Tensor | list[Tensor]:
        """Multiply model i's loss by model i's scale.

        ``outputs`` is a tensor whose leading dim is N (usually the ``[N]`` per-model
        losses; then ``scale(losses).sum().backward()``), or a sequence of N tensors.
        A single summed loss cannot be scaled per model and is rejected.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            if outputs.dim() == 0:
                from ..errors import user_line

                raise FusionArgumentError(
                    f"GradScaler.scale{user_line()} needs the per-model losses (a [N] "
                    f"tensor, e.g. from hftc.per_model), not their sum: each model is "
                    f"scaled by its own factor. Take scaler.scale(losses).sum().backward()")
            self._lazy_init(outputs.shape[0], outputs.device)
            return outputs * self._scale.view(-1, *([1] * (outputs.dim() - 1)))
        outputs = list(outputs)
        self._lazy_init(len(outputs), outputs[0].device)
        return [o * self._scale[i] for i, o in enumerate(outputs)]

    # -------------------------------------------------------- optimizer side

    def _check_optimizer(self, optimizer) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise FusionTypeError(
                f"hftc.amp.GradScaler works with hftc.optim optimizers (it skips single "
                f"models); got {type(optimizer).__name__}. Use torch.amp.GradScaler for "
                f"stock optimizers"
            )
        if self._scale is None:
            raise RuntimeError("GradScaler: call scale() on the losses before unscale_/step")
        if optimizer.num_models != self._num_models:
            raise ValueError(
                f"GradScaler has {self._num_models} models, the optimizer {optimizer.num_models}"
            )

    def _record(self, optimizer) -> dict[str, Any]:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found_inf": None})

    @torch.no_grad()
    def unscale_(self, optimizer: FusedOptimizer) -> None:
        """Divide each model's gradients by its scale and note which models have inf/NaN.

        Call it before clipping (``hftc.utils.clip_grad_norm_``) so that the clip
        sees true gradients; ``step`` calls it if you did not.
        """
        if not self._enabled:
            return
        self._check_optimizer(optimizer)
        record = self._record(optimizer)
        if record["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update().")
        if record["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # As torch: the reciprocal in double, then float32.
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.zeros(self._num_models, dtype=torch.bool, device=self._scale.device)
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise NotImplementedError("hftc.amp.GradScaler: sparse gradients")
                n = g.shape[0]
                # Checked before unscaling, as torch does.
                finite = torch.isfinite(g).reshape(n, -1).all(dim=1)
                found_inf |= ~finite.to(found_inf.device)
                inv = inv_scale.to(device=g.device, dtype=g.dtype)
                g.mul_(inv.view(-1, *([1] * (g.dim() - 1))))
        record["found_inf"] = found_inf
        record["stage"] = _UNSCALED

    def step(self, optimizer: FusedOptimizer, *args: Any, **kwargs: Any):
        """Unscale (if needed) and step every model whose gradients are finite.

        Models with inf/NaN gradients are skipped: their parameters, optimizer state
        and step counters stay as they were. Returns ``optimizer.step``'s return
        value, or ``None`` if every model was skipped.  On a capturable optimizer the
        flags stay on the device (no host sync; see the module docstring).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or args:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_optimizer(optimizer)
        record = self._record(optimizer)
        if record["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if record["stage"] == _READY:
            self.unscale_(optimizer)
        found_inf = record["found_inf"]
        result = None
        if getattr(optimizer, "is_capturable", False):  # no host read: flags on the device
            result = optimizer.step(skip_models=found_inf, **kwargs)
        elif not bool(found_inf.all()):
            skip = found_inf if bool(found_inf.any()) else None
            result = optimizer.step(skip_models=skip, **kwargs)
        record["stage"] = _STEPPED
        return result

    @torch.no_grad()
    def update(self, new_scale: float | Sequence[float] | Tensor | None = None) -> None:
        """Grow or back off each model's scale on its own.

        Per model, as ``torch.amp.GradScaler.update``: after an overflow the scale is
        multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in a
        row by ``growth_factor`` (if the result is finite). ``new_scale`` (one value or
        N) sets the scales instead.
        """
        if not self._enabled or self._scale is None:
            return
        if new_scale is not None:
            value = torch.as_tensor(new_scale, dtype=torch.float32).reshape(-1)
            if value.numel() not in (1, self._num_models):
                raise ValueError(f"new_scale has {value.numel()} values, expected 1 or "
                                 f"{self._num_models}")
            self._scale.copy_(value.to(self._scale.device).expand(self._num_models))
        else:
            found = [r["found_inf"] for r in self._per_optimizer.values()
                     if r["found_inf"] is not None]
            if not found:
                raise RuntimeError("No inf checks were recorded prior to update(): call "
                                   "step(optimizer) first.")
            found_inf = torch.stack([f.to(self._scale.device) for f in found]).any(dim=0)
            tracker = self._growth_tracker + 1
            grow = ~found_inf & (tracker == self._growth_interval)
            grown = self._scale * self._growth_factor
            scale = torch.where(found_inf, self._scale * self._backoff_factor,
                                torch.where(grow & torch.isfinite(grown), grown, self._scale))
            self._scale.copy_(scale)
            self._growth_tracker.copy_(torch.where(found_inf | grow, 0, tracker))
        self._per_optimizer.clear()

    # ---------------------------------------------------------- inspection

    def get_scale(self) -> Tensor:
        """The N current scales (a copy); ``init_scale`` each before the first ``scale()``."""
        if self._scale is None:
            n = self._num_models or 1
            return torch.full((n,), self._init_scale, dtype=torch.float32)
        return self._scale.clone()

    def get_growth_tracker(self) -> Tensor | None:
        return None if self._growth_tracker is None else self._growth_tracker.clone()

    def state_dict(self) -> dict[str, Any]:
        """Scales, growth trackers and settings, loadable with ``torch.load(weights_only=True)``."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale().cpu(),
            "growth_tracker": (self._growth_tracker.cpu().clone()
                               if self._growth_tracker is not None else None),
            "num_models": self._num_models,
            "init_scale": self._init_scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was "
                               "saved from a disabled instance of GradScaler.")
        self._num_models = state_dict["num_models"]
        self._init_scale = state_dict["init_scale"]
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        device = self._scale.device if self._scale is not None else torch.device("cpu")
        tracker = state_dict["growth_tracker"]
        if tracker is None:
            self._scale = self._growth_tracker = None
        elif self._scale is not None and self._scale.shape == state_dict["scale"].shape:
            # In place: a captured step (hftc.compile_step) reads these very tensors.
            self._scale.copy_(state_dict["scale"])
            self._growth_tracker.copy_(tracker)
        else:
            self._scale = state_dict["scale"].to(device=device, dtype=torch.float32).clone()
            self._growth_tracker = tracker.to(device=device, dtype=torch.int32).clone()
        self._per_optimizer.clear()
