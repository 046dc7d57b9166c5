"""Schedules that torch cannot run per model unchanged: ReduceLROnPlateau.

Every other ``torch.optim.lr_scheduler`` class already works per model on a
fused optimizer, since ``param_groups[i]`` is model i. ``ReduceLROnPlateau``
is different: its ``step(metric)`` takes one number for all groups. Here each
model gets its own torch ``ReduceLROnPlateau`` (so the plateau logic is
torch's own), watching only model i's group and stepped with model i's metric.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch_sched

from ..errors import FusionArgumentError, FusionError, FusionTypeError

__all__ = ["ReduceLROnPlateau"]


class _ModelGroups(Optimizer):
    """The slice of a fused optimizer that a per-model scheduler sees: group i only.

    ``param_groups`` is looked up on every access, so it stays right after the
    fused optimizer's ``load_state_dict`` replaces its group dicts.
    """

    def __init__(self, optimizer: Optimizer, model: int):  # no super(): it wants params
        self._optimizer = optimizer
        self._model = model
        self.defaults = optimizer.defaults
        self.state = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [self._optimizer.param_groups[self._model]]

    # torch's Optimizer pickles defaults, state and param_groups only: a pickled or
    # deepcopied scheduler lost its optimizer and model, and failed at its next step.
    def __getstate__(self) -> dict[str, Any]:
        return {"_optimizer": self._optimizer, "_model": self._model,
                "defaults": self.defaults, "state": self.state}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _per_model(name: str, value: Any, n: int) -> list[Any]:
    if isinstance(value, (str, int, float)) or value is None:
        return [value] * n
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return [value.item()] * n
    values = list(value)
    if len(values) != n:
        raise FusionArgumentError(f"{name} has {len(values)} values but there are {n} models")
    return values


class ReduceLROnPlateau:
    """Reduce each model's learning rate when its own metric stops improving.

    Takes ``torch.optim.lr_scheduler.ReduceLROnPlateau``'s arguments, each one
    shared value or one per model, and ``step(metrics)`` takes N metrics::

        sched = hftc.optim.ReduceLROnPlateau(opt, mode="min", patience=[2, 5, 5])
        for epoch in range(epochs):
            ...
            sched.step(val_losses)          # a [N] tensor or N numbers

    A model whose metric is NaN counts it as a bad epoch, as torch does; no
    model's metric affects another's learning rate.
    """

    def __init__(self, optimizer: Optimizer, mode="min", factor=0.1, patience=10,
                 threshold=1e-4, threshold_mode="rel", cooldown=0, min_lr=0.0, eps=1e-8):
        from .optimizer import FusedOptimizer  # (the optimizers import this package)

        if not isinstance(optimizer, Optimizer):
            raise FusionTypeError(f"{type(optimizer).__name__} is not an Optimizer")
        if not isinstance(optimizer, FusedOptimizer):
            # (its N models counted as its param groups: "patience has 3 values but
            # there are 1 models" for a stock Adam over fused.parameters())
            cls = type(optimizer)
            raise FusionTypeError(
                f"hftc.optim.ReduceLROnPlateau schedules each model of an hftc.optim "
                f"optimizer (param_groups[i] is model i); {cls.__module__}.{cls.__name__} "
                f"has {len(optimizer.param_groups)} param group(s), not one per model. "
                f"Build hftc.optim.{cls.__name__}(fused.parameters(), ...) (or fuse the "
                f"stock ones with hftc.optim.fuse_optimizers), or give this one "
                f"torch.optim.lr_scheduler.ReduceLROnPlateau and one metric")
        n = len(optimizer.param_groups)
        self.optimizer = optimizer
        args = {
            "mode": mode, "factor": factor, "patience": patience, "threshold": threshold,
            "threshold_mode": threshold_mode, "cooldown": cooldown, "min_lr": min_lr,
            "eps": eps,
        }
        per_model = {k: _per_model(k, v, n) for k, v in args.items()}
        self.schedulers = [
            _torch_sched.ReduceLROnPlateau(_ModelGroups(optimizer, i),
                                           **{k: v[i] for k, v in per_model.items()})
            for i in range(n)
        ]
        SCHEDULERS_ON_FUSED.add(self)  # found and cut by hftc.keep_models

    @property
    def num_models(self) -> int:
        return len(self.schedulers)

    def step(self, metrics: Sequence[float] | torch.Tensor) -> None:
        """Take one step for each model with its own metric (N values)."""
        if isinstance(metrics, torch.Tensor):
            values = metrics.detach().reshape(-1).tolist()
        else:
            values = [float(m) for m in metrics]
        if len(values) != self.num_models:
            raise FusionArgumentError(
                f"ReduceLROnPlateau.step got {len(values)} metrics but there are "
                f"{self.num_models} models (one metric per model)"
            )
        for sched, value in zip(self.schedulers, values):
            sched.step(value)

    def get_last_lr(self) -> list[float]:
        """Each model's learning rate after the last step."""
        return [s.get_last_lr()[0] for s in self.schedulers]

    def state_dict(self) -> dict[str, Any]:
        """The N torch schedulers' state dicts (no optimizer), for ``torch.save``."""
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict["schedulers"]
        if len(states) != self.num_models:
            raise FusionArgumentError(
                f"state dict has {len(states)} models' schedules, this one {self.num_models}"
            )
        for sched, state in zip(self.schedulers, states):
            sched.load_state_dict(state)


#: Every live scheduler built on an ``hftc.optim`` optimizer, weakly: torch's (registered
#: by :func:`registering_init`, which ``import hftc`` wraps around their ``__init__``) and
#: :class:`ReduceLROnPlateau`.  :func:`hftc.keep_models` cuts those of the optimizers it
#: cuts: one left with N models' lists would give model j old model j's schedule.
SCHEDULERS_ON_FUSED: weakref.WeakSet[Any] = weakref.WeakSet()


def registering_init(init: Any) -> Any:
    """A torch scheduler class's ``__init__``, which then registers the scheduler in
    :data:`SCHEDULERS_ON_FUSED` when its optimizer is fused (torch keeps no list of an
    optimizer's schedulers)."""
    if getattr(init, "_hftc_registers", False):
        return init

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        from .optimizer import FusedOptimizer  # (the optimizers import this package)

        _refuse_per_model_scalars(self, init, args, kwargs)
        try:
            init(self, *args, **kwargs)
        except ValueError as exc:
            optimizer = kwargs.get("optimizer", args[0] if args else None)
            _refuse_mixed_cycle_momentum(self, optimizer, exc)
            if not isinstance(optimizer, FusedOptimizer) or isinstance(exc, FusionError) \
                    or not ("param_groups" in str(exc) or "lr_lambdas" in str(exc)):
                raise
            # torch's "max_lr has 2 values, param_groups has 3": a fused optimizer's
            # param_groups[i] is model i, which its message does not say.
            n = len(optimizer.param_groups)
            raise FusionArgumentError(
                f"{type(self).__name__} on a fused optimizer of {n} models: "
                f"{str(exc).rstrip('.')}. "
                f"param_groups[i] of a fused optimizer is model i: give one value per "
                f"model ({n} values, in the models' order) or one value for all") from exc
        if isinstance(getattr(self, "optimizer", None), FusedOptimizer):
            SCHEDULERS_ON_FUSED.add(self)

    __init__._hftc_registers = True  # type: ignore[attr-defined]
    return __init__


def _refuse_mixed_cycle_momentum(scheduler: Any, optimizer: Any, exc: ValueError) -> None:
    """torch's "optimizer must support momentum or beta1" for a ``MixedOptimizer``: its
    classes name their momentum differently (SGD ``momentum``, Adam ``betas``), and
    OneCycleLR / CyclicLR cycle one key in every group, though each stock optimizer
    alone would take it."""
    from .mixed import MixedOptimizer  # (mixed imports the optimizers, which import this)

    if not isinstance(optimizer, MixedOptimizer) or "cycle_momentum" not in str(exc):
        return
    from ..errors import user_line

    classes = {}
    for part, rows in zip(optimizer.parts(), optimizer.part_rows()):
        classes.setdefault(type(part).__name__, []).extend(rows)
    which = "; ".join(f"{cls}: models {rows}" for cls, rows in classes.items())
    raise FusionArgumentError(
        f"{type(scheduler).__name__}(cycle_momentum=True){user_line()} on a MixedOptimizer "
        f"({which}): torch's {type(scheduler).__name__} cycles one key in every param "
        f"group, momentum or betas[0], and these classes do not share one (or have "
        f"neither: Adagrad, Adadelta). Pass cycle_momentum=False, or fuse each class's "
        f"models into a fused optimizer (and a scheduler) of their own") from exc


#: torch schedulers' arguments that take one value for every param group: given N values
#: on a fused optimizer, torch failed at a later ``step()`` (``group["lr"] * self.gamma``:
#: "can't multiply sequence by non-int") or, a tensor, multiplied every rate by N values.
SHARED_ARGUMENTS = ("gamma", "step_size", "T_max", "eta_min", "total_iters", "power",
                    "start_factor", "end_factor", "factor", "T_0", "T_mult", "pct_start",
                    "div_factor", "final_div_factor", "patience", "threshold", "cooldown",
                    "step_size_up", "step_size_down", "anneal_epochs")


def _refuse_per_model_scalars(scheduler: Any, init: Any, args: Any, kwargs: Any) -> None:
    """Before a torch scheduler's ``__init__`` on a fused optimizer: an argument of
    :data:`SHARED_ARGUMENTS` given one value per model (``StepLR(opt, 3, gamma=[0.5,
    0.7, 0.9])``, as ``hftc.optim`` takes its hyper-parameters) is refused, naming the
    user's line and the ``LambdaLR`` of one function per model that does it."""
    from .optimizer import FusedOptimizer  # (the optimizers import this package)

    try:
        bound = inspect.signature(init).bind(scheduler, *args, **kwargs).arguments
    except TypeError:
        return  # (torch's own call says what is wrong)
    if not isinstance(bound.get("optimizer"), FusedOptimizer):
        return
    _refuse_per_model_arrays(scheduler, bound, len(bound["optimizer"].param_groups))
    for name in SHARED_ARGUMENTS:
        value = bound.get(name)
        if isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor)
                                                and value.numel() > 1):
            from ..errors import user_line

            cls = type(scheduler).__name__
            example = ("[lambda epoch, g=g: g ** (epoch // step_size) for g in gammas]"
                       if cls == "StepLR" else "[lambda epoch, g=g: g ** epoch for g in "
                       "gammas]" if cls == "ExponentialLR" else "[f_0, ..., f_N-1]")
            plateau = (" (or hftc.optim.ReduceLROnPlateau, whose arguments are each one "
                       "value or one per model)" if cls == "ReduceLROnPlateau" else "")
            raise FusionArgumentError(
                f"{cls}({name}={value!r}){user_line()}: torch's {cls} takes one {name} "
                f"for all param groups, here all models. For one schedule per model give "
                f"LambdaLR one function per model: torch.optim.lr_scheduler.LambdaLR(opt, "
                f"{example}), model i's at [i]{plateau}")


#: torch schedulers' arguments that take one value per param group (a list, or one value
#: for all): a tensor or array of N values was given whole to every group, and failed at a
#: later step (``lr[0] must be a number, got a tensor of shape [3]``, or torch's ``fill_``).
PER_GROUP_ARGUMENTS = ("max_lr", "base_lr", "max_momentum", "base_momentum", "min_lr",
                       "swa_lr")


def _refuse_per_model_arrays(scheduler: Any, bound: dict[str, Any], n: int) -> None:
    """A :data:`PER_GROUP_ARGUMENTS` argument given as a tensor or array of several values
    (as ``hftc.optim`` takes its hyper-parameters): refused, asking for a list."""
    for name in PER_GROUP_ARGUMENTS:
        value = bound.get(name)
        size = getattr(value, "size", None)
        count = value.numel() if isinstance(value, torch.Tensor) else \
            size if isinstance(size, int) and hasattr(value, "shape") else 1
        if count > 1:
            from ..errors import user_line

            cls = type(scheduler).__name__
            raise FusionArgumentError(
                f"{cls}({name}={type(value).__name__} of {count} values){user_line()}: "
                f"torch's {cls} takes one {name} per param group as a list (or one number "
                f"for all), and gives a tensor or array whole to every group. On a fused "
                f"optimizer of {n} models pass {name}=[v_0, ..., v_{n - 1}] (model i's at "
                f"[i]), e.g. {name}={name}.tolist()")


def torch_scheduler_classes() -> list[type]:
    """torch's scheduler base class and its classes with an ``__init__`` of their own
    (SequentialLR, ChainedScheduler and ReduceLROnPlateau do not call the base's)."""
    base = _torch_sched.LRScheduler
    return [base, *(c for c in vars(_torch_sched).values() if isinstance(c, type)
                    and issubclass(c, base) and c is not base and "__init__" in vars(c))]


_torch_plateau_step = _torch_sched.ReduceLROnPlateau.step


@functools.wraps(_torch_plateau_step)
def _plateau_step_on_fused(self: Any, metrics: Any, epoch: Any = None) -> None:
    """``torch.optim.lr_scheduler.ReduceLROnPlateau.step`` as installed by ``import hftc``:
    on a fused optimizer, one metric reduces every model's rate together (what it asks);
    N metrics, one per model, failed inside torch (``float()`` of N values): refused here,
    pointing to :class:`ReduceLROnPlateau`, which watches each model's own."""
    from .optimizer import FusedOptimizer  # (the optimizers import this package)

    if isinstance(self.optimizer, FusedOptimizer) and not isinstance(metrics, (int, float)) \
            and torch.as_tensor(metrics).numel() > 1:
        raise FusionArgumentError(
            f"torch.optim.lr_scheduler.ReduceLROnPlateau.step got "
            f"{torch.as_tensor(metrics).numel()} metrics for a fused optimizer, and takes one "
            f"for all models; use hftc.optim.ReduceLROnPlateau(optimizer, ...), whose step "
            f"takes one metric per model and reduces each model's rate on its own plateau")
    return _torch_plateau_step(self, metrics, epoch)


def keep_plateau_models(scheduler: ReduceLROnPlateau, keep: list[int]) -> None:
    """Keep models ``keep`` of a per-model ``ReduceLROnPlateau`` (after its optimizer's
    groups were cut to them): model j's torch scheduler is old model ``keep[j]``'s."""
    scheduler.schedulers = [scheduler.schedulers[i] for i in keep]
    for j, sched in enumerate(scheduler.schedulers):
        sched.optimizer._model = j
