"""A training loop's per-model bookkeeping, in the models' ids (``fused.model_ids``).

::

    before (one model)                         after (N models fused)
    correct += (out.argmax(1) == y).sum()      correct += hftc.per_model_accuracy(
                                                   out, y, reduction="sum")       # [N]
    if val_loss < best_loss:                   best = hftc.BestCheckpoint(
        best_loss, bad = val_loss, 0               fused, path="best_{model_id}.pt")
        torch.save(model.state_dict(), path)   stopper = hftc.EarlyStopping(fused, patience=3)
    else:                                      ...
        bad += 1                               best.update(val_losses)            # [N]
        if bad >= patience:                    if stopper.step(val_losses):       # [N]
            break                                  break   # every model has stopped

Each value is model ``fused.model_ids[j]``'s at position ``j``: the records hold through
:func:`hftc.keep_models` (which :class:`EarlyStopping` calls to drop the models that
stopped) and :func:`hftc.replace_models`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import FusionArgumentError, FusionTypeError, user_line
from ..module.fused import FusedModule
from .shrink import keep_models

__all__ = ["BestCheckpoint", "EarlyStopping", "per_model_accuracy"]


@torch.no_grad()
def per_model_accuracy(output: Tensor, target: Tensor, *, reduction: str = "mean") -> Tensor:
    """Each model's accuracy on a fused output, ``[N]``, without the ``argmax`` juggling::

        out = fused(x)                                  # [N, B, C] logits
        hftc.per_model_accuracy(out, y)          # [N]: (out[i].argmax(1) == y).float().mean()
        hftc.per_model_accuracy(out, y, reduction="sum")   # [N]: the counts right

    Args:
        output: ``[N, B, C, ...]`` scores, the classes at dim 2 (after the models and the
            batch), as ``F.cross_entropy`` takes one model's ``[B, C, ...]``.
        target: class indices, one model's ``[B, ...]`` (shared by all models) or ``[N,
            B, ...]`` (each model its own).
        reduction: ``"mean"`` (the fraction right, float), ``"sum"`` (the count, int64) or
            ``"none"`` (``[N, B, ...]`` bools).
    """
    if not isinstance(output, Tensor) or output.dim() < 3:
        shape = list(output.shape) if isinstance(output, Tensor) else type(output).__name__
        raise FusionArgumentError(
            f"per_model_accuracy takes a fused output [N, B, C, ...] (the classes at dim 2), "
            f"got {shape}")
    one = output.shape[1:2] + output.shape[3:]  # one model's target
    if target.shape not in (one, output.shape[:1] + one):
        raise FusionArgumentError(
            f"per_model_accuracy: the target's shape {list(target.shape)} is neither one "
            f"model's {list(one)} (shared by all {output.shape[0]} models) nor "
            f"{[output.shape[0], *one]} (each model its own), for an output "
            f"{list(output.shape)}")
    right = output.argmax(2) == target.to(output.device)
    if reduction == "none":
        return right
    if reduction not in ("mean", "sum"):
        raise FusionArgumentError(
            f"per_model_accuracy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    counts = right.flatten(1).sum(1)
    return counts if reduction == "sum" else counts / right[0].numel()


class _PerModelBest:
    """The best value of each model id so far (``mode="min"``: lower is better)."""

    def __init__(self, fused: FusedModule, mode: str, min_delta: float) -> None:
        if not isinstance(fused, FusedModule):
            raise FusionTypeError(f"{type(self).__name__} takes a fused module "
                                  f"(hftc.fuse(models)), got a {type(fused).__name__}")
        if mode not in ("min", "max"):
            raise FusionArgumentError(f"{type(self).__name__}: mode must be 'min' or 'max', "
                                      f"got {mode!r}")
        self.fused, self.mode, self.min_delta = fused, mode, float(min_delta)
        #: model id -> its best value so far
        self.best: dict[int, float] = {}

    def _values(self, values: Any) -> list[tuple[int, int, float]]:
        """``(position, model id, value)`` of each model of ``values`` ``[N]``."""
        ids = self.fused.model_ids
        if isinstance(values, Tensor):
            values = values.detach().reshape(-1).tolist()
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as exc:  # (one number: the models' mean or sum)
            raise FusionArgumentError(
                f"{type(self).__name__}: got {type(values).__name__} {values!r:.60}"
                f"{user_line()}, not one number per model ({len(ids)} models, ids {ids}): "
                f"pass the per-model values [N] themselves (hftc.per_model(...)(out, y), "
                f"not their .mean(), .sum() or .item())") from exc
        if len(values) != len(ids):
            raise FusionArgumentError(
                f"{type(self).__name__}: {len(values)} values for {len(ids)} models (ids "
                f"{ids}): give one value per model, in the fused module's order (a "
                f"per-model loss [N], hftc.per_model(...)(out, y))")
        return list(zip(range(len(ids)), ids, values))

    def _improved(self, model_id: int, value: float) -> bool:
        """Record ``value`` if it beats the model's best by more than ``min_delta``."""
        best = self.best.get(model_id)
        if math.isnan(value):
            better = False
        elif best is None:
            better = True
        else:
            better = (value < best - self.min_delta if self.mode == "min"
                      else value > best + self.min_delta)
        if better:
            self.best[model_id] = value
        return better


class BestCheckpoint(_PerModelBest):
    """Each model's best weights so far, by its id (``fused.model_ids``)::

        best = hftc.BestCheckpoint(fused, path="best_{model_id}.pt")   # or path=None
        for epoch in ...:
            ...
            best.update(val_losses)        # [N]: saves the models whose loss is the best yet
        best.best                          # {model id: its best value}
        best.state_dict(3)                 # model 3's best weights (its own keys)
        best.model(3)                      # model 3 as a module of its class, best weights

    Args:
        fused: the fused module.
        mode: ``"min"`` (a loss: lower is better) or ``"max"`` (an accuracy).
        min_delta: an improvement must beat the best by more than this.
        path: a file name with ``{model_id}``: each improvement is written there with
            ``torch.save(fused.model_state_dict(j))``, as ``torch.save(model.state_dict(),
            ...)`` for one model; ``None`` keeps the state dicts in memory (copies).
    """

    def __init__(self, fused: FusedModule, *, mode: str = "min", min_delta: float = 0.0,
                 path: str | None = None) -> None:
        super().__init__(fused, mode, min_delta)
        if path is not None and "{model_id}" not in str(path):
            raise FusionArgumentError(
                f"BestCheckpoint: path {path!r} has no {{model_id}}: every model would write "
                f"the same file; give e.g. path='best_{{model_id}}.pt'")
        self.path = None if path is None else str(path)
        self._saved: dict[int, dict[str, Tensor]] = {}
        self._templates: dict[int, nn.Module] = {}

    def update(self, values: Sequence[float] | Tensor) -> list[int]:
        """Save the models whose value (``values[j]``, model ``fused.model_ids[j]``'s) is
        their best yet; return their ids."""
        improved = []
        for position, model_id, value in self._values(values):
            if not self._improved(model_id, value):
                continue
            state = self.fused.model_state_dict(position)
            if model_id not in self._templates:  # what model() loads the weights into
                self._templates[model_id] = self.fused.unfuse_model(position)
            if self.path is None:
                self._saved[model_id] = state
            else:
                torch.save(state, self.path.format(model_id=model_id))
            improved.append(model_id)
        return improved

    def state_dict(self, model_id: int) -> dict[str, Tensor]:
        """Model ``model_id``'s best weights (its own keys, as ``model.state_dict()``)."""
        if model_id not in self.best:
            raise FusionArgumentError(
                f"BestCheckpoint: model id {model_id} has no checkpoint (ids saved: "
                f"{sorted(self.best)})")
        if self.path is None:
            return self._saved[model_id]
        return torch.load(self.path.format(model_id=model_id), weights_only=True)

    def model(self, model_id: int) -> nn.Module:
        """Model ``model_id`` as a module of its own class, holding its best weights."""
        state = self.state_dict(model_id)
        model = copy.deepcopy(self._templates[model_id])
        model.load_state_dict(state)
        return model


class EarlyStopping(_PerModelBest):
    """Per-model early stopping, by id: a model whose value has not improved for
    ``patience`` calls in a row stops, and is dropped from the fused module (with
    :func:`hftc.keep_models`, which cuts its optimizers and schedulers too)::

        stopper = hftc.EarlyStopping(fused, patience=3)
        for epoch in ...:
            ...
            if stopper.step(val_losses):   # [N], one per model
                break                      # every model has stopped
        stopper.stopped                    # {model id: the call (0, 1, ...) it stopped at}
        stopper.state_dict()               # to resume: stopper.load_state_dict(saved)

    One model run alone with ``if val_loss < best: best, bad = val_loss, 0 else: bad +=
    1; if bad >= patience: break`` stops at the same epoch: the fused module trains on
    with the others, each exactly as before.  As after any :func:`hftc.keep_models`, an
    ``hftc.compile_step`` or ``hftc.amp.GradScaler`` made for the N models is made again.

    Args:
        fused: the fused module.
        patience: calls without improvement before a model stops.
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).
        min_delta: an improvement must beat the best by more than this.
        cut: drop the stopped models from ``fused`` (``hftc.keep_models``); ``False``
            leaves them in (training on, their values no longer read).
    """

    def __init__(self, fused: FusedModule, *, patience: int, mode: str = "min",
                 min_delta: float = 0.0, cut: bool = True) -> None:
        super().__init__(fused, mode, min_delta)
        if not isinstance(patience, int) or patience < 1:
            raise FusionArgumentError(f"EarlyStopping: patience must be an int >= 1, got "
                                      f"{patience!r}")
        self.patience, self.cut = patience, cut
        #: model id -> the calls since its last improvement
        self.waited: dict[int, int] = {}
        #: model id -> the call (counting from 0) at which it stopped
        self.stopped: dict[int, int] = {}
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        """What a resumed loop needs to stop each model where an uninterrupted one would
        (as a scheduler's): ``torch.save({"stopper": stopper.state_dict(), ...})``; its
        models by id, so it holds after :func:`hftc.keep_models`."""
        return {"best": dict(self.best), "waited": dict(self.waited),
                "stopped": dict(self.stopped), "calls": self.calls,
                "patience": self.patience, "mode": self.mode, "min_delta": self.min_delta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` (made with the same patience, mode, min_delta)."""
        mine = (self.patience, self.mode, self.min_delta)
        theirs = (state.get("patience"), state.get("mode"), state.get("min_delta"))
        if mine != theirs:
            raise FusionArgumentError(
                f"EarlyStopping.load_state_dict: the state was saved with (patience, mode, "
                f"min_delta) {theirs}, this one has {mine}: make it with the saved ones, "
                f"or start its bookkeeping afresh")
        self.best = {int(k): float(v) for k, v in state["best"].items()}
        self.waited = {int(k): int(v) for k, v in state["waited"].items()}
        self.stopped = {int(k): int(v) for k, v in state["stopped"].items()}
        self.calls = int(state["calls"])

    @property
    def done(self) -> bool:
        """Every model of the fused module has stopped."""
        return all(i in self.stopped for i in self.fused.model_ids)

    def step(self, values: Sequence[float] | Tensor) -> bool:
        """Record each model's value (``values[j]`` is model ``fused.model_ids[j]``'s);
        stop (and drop) the models out of patience.  True once every model has stopped:
        then nothing is dropped (a fused module keeps one model), and the loop ends."""
        stopping = []
        for _, model_id, value in self._values(values):
            if model_id in self.stopped:
                continue  # (cut=False: a stopped model still in the fused module)
            waited = 0 if self._improved(model_id, value) else self.waited.get(model_id, 0) + 1
            self.waited[model_id] = waited
            if waited >= self.patience:
                self.stopped[model_id] = self.calls
                stopping.append(model_id)
        self.calls += 1
        if self.done:
            return True
        if stopping and self.cut:
            keep_models(self.fused, [j for j, i in enumerate(self.fused.model_ids)
                                     if i not in self.stopped])
        return False
