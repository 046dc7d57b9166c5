"""Keep a subset of a fused module's models, in place, with their optimizers and schedulers.

::

    fused = hftc.fuse([m0, m1, m2, m3])
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-3, 3e-3, 1e-2, 3e-2])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    ... train ...
    hftc.keep_models(fused, [0, 2])       # opt and sched are found and cut with it
    ... train on: models 0 and 2 of before are models 0 and 1 now ...

Every stacked tensor ``[N, ...]`` becomes its rows ``keep``: the parameters (the same
``nn.Parameter`` objects, so the optimizers' ``param_groups`` and the user's references
stay valid; their ``.grad`` too), the buffers, the optimizers' state (moments, momentum
buffers, per-model step counts), their param groups (one per model) and the schedulers'
per-model lists (``base_lrs``, ``lr_lambdas`` ...).  Nothing is recomputed, so the kept
models continue bit for bit as if the others had never been there.  It is what a sweep
does when it prunes trials (``hftc.sweep.TrialArray`` calls it).
"""

from __future__ import annotations

import gc
import operator
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import (
    FusionArgumentError,
    FusionIndexError,
    FusionTypeError,
    UsageWarning,
    user_line,
    user_stacklevel,
)
from ..lowering.runtime.modules import FUSED_MODULES
from ..module.fused import FusedModule
from ..optim.lr_scheduler import SCHEDULERS_ON_FUSED, ReduceLROnPlateau, keep_plateau_models
from ..optim.optimizer import LIVE_OPTIMIZERS, STEPPED_STOCK_OPTIMIZERS, FusedOptimizer

__all__ = ["keep_models", "replace_models"]

#: torch scheduler attributes that hold one value per param group (= per model here).
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "base_momentums",
              "max_momentums", "min_lrs")
#: list attributes that are not per group (whatever their length).
_NOT_PER_GROUP = ("_schedulers", "_milestones", "_schedule_phases")


def _check_keep(fused: FusedModule, keep: Any, who: str = "keep_models: keep") -> list[int]:
    """``keep`` as positions in ``range(N)``, or an error naming ``who`` (the function and
    its argument: replace_models checks the positions of its models with it too)."""
    n = fused.num_models
    if isinstance(keep, torch.Tensor):
        keep = keep.tolist()
    if isinstance(keep, (str, bytes)) or not isinstance(keep, Iterable):
        raise FusionTypeError(f"{who} must be a list of model indices (ints in "
                              f"range({n})), got {keep!r}")
    keep = list(keep)
    if any(type(k).__name__ in ("bool", "bool_") for k in keep):
        # (operator.index reads True as 1: [True, False] kept models [1, 0], swapped)
        raise FusionTypeError(
            f"{who} holds flags {keep!r}{user_line()}, not model indices: give the indices "
            f"of the models to keep, [i for i, kept in enumerate(flags) if kept] (for "
            f"{keep!r}: {[i for i, kept in enumerate(keep) if kept]})")
    indices = []
    for k in keep:
        try:
            i = operator.index(k)
        except TypeError:
            raise FusionTypeError(f"{who} holds {k!r} ({type(k).__name__}); "
                                  f"give model indices, ints in range({n})") from None
        if not -n <= i < n:
            raise FusionIndexError(f"{who} holds model index {i}, out of range for {n} "
                                   f"models: give ints in range({n})")
        indices.append(i % n)
    if not indices:
        raise FusionArgumentError(f"{who} is empty; a fused module keeps at least one model "
                                  f"(to drop them all, drop the fused module)")
    twice = sorted({i for i in indices if indices.count(i) > 1})
    if twice:
        raise FusionArgumentError(f"{who} names model(s) {twice} more than once; "
                                  f"each model can be kept once")
    return indices


def _check_optimizer(k: int, opt: Any, fused: FusedModule) -> None:
    if not isinstance(opt, FusedOptimizer):
        raise FusionTypeError(
            f"keep_models: optimizers[{k}] is a {type(opt).__name__}, not an hftc.optim "
            f"optimizer over the fused module's parameters (hftc.optim.SGD, Adam, ...); "
            f"build it as hftc.optim.{type(opt).__name__}(fused.parameters(), ...)")
    own = {id(p) for p in fused.parameters()}
    foreign = [i for i, p in enumerate(opt.param_groups[0]["params"]) if id(p) not in own]
    if foreign or opt.num_models != fused.num_models:
        why = (f"its parameter(s) {foreign} are not the fused module's" if foreign else
               f"it has {opt.num_models} models, the fused module {fused.num_models}")
        raise FusionArgumentError(
            f"keep_models: optimizers[{k}] ({type(opt).__name__}) is not built on this fused "
            f"module ({why}); pass only the optimizers of fused.parameters()")


def _scheduler_parts(sched: Any) -> list[Any]:
    """The scheduler and those it drives (SequentialLR, ChainedScheduler)."""
    return [sched, *(p for child in getattr(sched, "_schedulers", ()) or ()
                     for p in _scheduler_parts(child))]


def _check_scheduler(label: str, sched: Any, optimizers: Sequence[Any], n: int) -> None:
    name = type(sched).__name__
    if not any(getattr(sched, "optimizer", None) is opt for opt in optimizers):
        raise FusionArgumentError(
            f"keep_models: {label} ({name}) is not built on one of the optimizers "
            f"given; pass its optimizer in optimizers=[...] too")
    if isinstance(sched, ReduceLROnPlateau):
        return
    for part in _scheduler_parts(sched):
        for attr, value in vars(part).items():
            if attr in _PER_GROUP or attr in _NOT_PER_GROUP:
                continue
            if isinstance(value, (list, tuple)) and len(value) == n and n > 1:
                raise FusionArgumentError(
                    f"keep_models: {label} ({type(part).__name__}) has an attribute "
                    f"{attr!r} of {n} values, one per model perhaps, which keep_models does "
                    f"not know how to cut; build the scheduler again on the optimizer after "
                    f"keep_models (or use a torch.optim.lr_scheduler class)")


def _refuse_stock_optimizers(fused: FusedModule, own: set[int]) -> None:
    """A stock ``torch.optim`` optimizer that stepped on the fused parameters holds one
    state for all N models (its moments ``[N, ...]``), which nothing here can cut."""
    for opt in list(STEPPED_STOCK_OPTIMIZERS):
        if any(id(p) in own for g in opt.param_groups for p in g["params"]):
            name = type(opt).__name__
            raise FusionTypeError(
                f"keep_models: a stock torch.optim.{name} steps the fused module's "
                f"parameters; its state holds all {fused.num_models} models and cannot be "
                f"cut with them. Build it as hftc.optim.{name}(fused.parameters(), ...) "
                f"(one param group per model, found and cut with the module), or delete "
                f"it before keep_models")


def _optimizers_on(fused: FusedModule, own: set[int]) -> list[FusedOptimizer]:
    """The live ``hftc.optim`` optimizers built on ``fused`` (one of N models; a stale
    one, left out of an earlier cut, refuses its next step on its own)."""
    return [opt for opt in list(LIVE_OPTIMIZERS)
            if opt.num_models == fused.num_models
            and any(id(p) in own for p in opt.param_groups[0]["params"])]


def keep_models(
    fused: FusedModule,
    keep: Sequence[int],
    *,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
    schedulers: Sequence[Any] = (),
) -> list[int]:
    """Keep only the models ``keep`` of ``fused``, in place, with their optimizer state.

    Args:
        fused: a fused module (``hftc.fuse``).
        keep: the indices of the models to keep (distinct, any order: model ``j`` is the
            old model ``keep[j]`` afterwards).
        optimizers: the ``hftc.optim`` optimizers to cut; by default every live one built
            on ``fused.parameters()`` (each registers itself when built).  Their state,
            param groups (one per model) and per-parameter hyper-parameters are cut to
            ``keep``.  One left out of an explicit list still holds ``N`` models' state
            and refuses its next step: build it again, or pass it here.
        schedulers: schedulers to cut besides those found: every live
            ``torch.optim.lr_scheduler`` scheduler (also ``SequentialLR``,
            ``ChainedScheduler``) and ``hftc.optim.ReduceLROnPlateau`` built on the
            optimizers cut is found and cut (their per-model values), as one left with
            ``N`` models' lists would give model ``j`` old model ``j``'s schedule.

    Returns the indices kept (normalized: ``-1`` is ``N - 1``); ``fused.model_ids``
    becomes ``[fused.model_ids[i] for i in keep]``, the original index of each model.
    The kept models continue exactly as they would have: the same parameters, buffers,
    gradients, optimizer state and schedule position; the compiled programs are dropped
    and the next call compiles for the smaller N, keeping the first-call checks they
    passed (the kept models ran them on the checks' word: not checked again).
    ``hftc.compile_step`` and ``hftc.amp.GradScaler`` objects made for N models are not
    cut: make them again.

    Raises ``FusionIndexError`` / ``FusionArgumentError`` / ``FusionTypeError`` for a bad
    ``keep``, an optimizer not on ``fused``, a scheduler not on those optimizers, a stock
    ``torch.optim`` optimizer that has stepped on ``fused``'s parameters; nothing is
    changed then.
    """
    if not isinstance(fused, FusedModule):
        raise FusionTypeError(f"keep_models takes a fused module (hftc.fuse(models)), got a "
                              f"{type(fused).__name__}")
    indices = _check_keep(fused, keep)
    own = {id(p) for p in fused.parameters()}
    _refuse_stock_optimizers(fused, own)
    optimizers = _optimizers_on(fused, own) if optimizers is None else list(optimizers)
    for k, opt in enumerate(optimizers):
        _check_optimizer(k, opt, fused)
    n = fused.num_models
    schedulers = list(schedulers)
    for k, sched in enumerate(schedulers):
        _check_scheduler(f"schedulers[{k}]", sched, optimizers, n)
    found = [s for s in list(SCHEDULERS_ON_FUSED)
             if any(getattr(s, "optimizer", None) is opt for opt in optimizers)]
    for sched in found:
        k = next(k for k, opt in enumerate(optimizers) if sched.optimizer is opt)
        _check_scheduler(f"a scheduler of optimizers[{k}]", sched, optimizers, n)
    for opt in {id(o): o for o in optimizers}.values():
        opt._keep_models(indices)
    parts: dict[int, Any] = {}  # each scheduler once (SequentialLR's own are found too)
    for sched in [*schedulers, *found]:
        if isinstance(sched, ReduceLROnPlateau):
            parts[id(sched)] = sched
        else:
            parts.update((id(p), p) for p in _scheduler_parts(sched))
    for part in parts.values():
        if isinstance(part, ReduceLROnPlateau):
            keep_plateau_models(part, indices)
            continue
        for attr in _PER_GROUP:
            value = getattr(part, attr, None)
            if isinstance(value, (list, tuple)) and len(value) == n:
                setattr(part, attr, type(value)(value[i] for i in indices))
    copies = fused._live_copies(list(FUSED_MODULES))
    if copies:  # (one the user dropped may wait for the cycle collector: not live)
        del copies
        gc.collect()
        copies = fused._live_copies(list(FUSED_MODULES))
    fused._keep_models(indices)
    for twin, line in copies:
        _warn_of_stale_copy(fused, twin, line)
    return indices


def _warn_of_stale_copy(fused: FusedModule, twin: FusedModule, line: str) -> None:
    """A UsageWarning for a ``copy.deepcopy(fused)`` that still holds the models ``fused``
    held: an EMA updated from ``fused`` (``p_ema.mul_(d).add_(p, alpha=1 - d)`` over
    ``zip(ema.parameters(), fused.parameters())``) would broadcast the one model left
    over every model's average, silently, or fail on a shape; a teacher's ``out[j]``
    would be another model's."""
    held = twin.model_ids
    kept = [held.index(i) for i in fused.model_ids]
    warnings.warn(
        f"hftc.keep_models: a copy of this fused module (copy.deepcopy{line}: an EMA, a "
        f"teacher, a target network) still holds models {held}, and the fused module now "
        f"holds {fused.model_ids}: position j of the two is no longer one model, and an "
        f"update of the copy from the fused module (p_ema.mul_(d).add_(p, alpha=1 - d)) "
        f"would mix models (broadcast a [1, ...] tensor over all {len(held)}, or fail on "
        f"a shape). Save what the copy holds of the models that left "
        f"(copy.model_state_dict(j)), then cut it as the fused module was: "
        f"hftc.keep_models(copy, {kept}); in a loop (after hftc.EarlyStopping.step): if "
        f"copy.model_ids != fused.model_ids: hftc.keep_models(copy, "
        f"[copy.model_ids.index(i) for i in fused.model_ids])",
        UsageWarning, stacklevel=user_stacklevel())


def replace_models(
    fused: FusedModule,
    models: dict[int, torch.nn.Module],
    *,
    hyperparameters: dict[int, dict[Any, Any]] | None = None,
) -> None:
    """Put new models in places of ``fused``, in place, each from its own step 0::

        hftc.replace_models(fused, {2: Net()}, hyperparameters={2: {"lr": 0.03}})
        # model 2 is the new Net now, with fresh optimizer state and lr 0.03; the other
        # models continue exactly where they were

    Args:
        fused: a fused module (``hftc.fuse``).
        models: position -> the new model, of the structure of the others (a new
            architecture needs a new array).
        hyperparameters: position -> the new model's optimizer hyper-parameters
            (``{"lr": 0.03, "weight_decay": 0.0}``), written into its param group of every
            ``hftc.optim`` optimizer built on ``fused``; or position -> ``{optimizer:
            {...}}`` for each optimizer its own.  Values not given stay the place's
            previous model's.

    The other models, their optimizer state and gradients are taken out
    (:meth:`FusedModule.unfuse`, :func:`hftc.optim.unfuse_optimizers`) and fused again
    with the new ones (the fuse options of before), and the result is written into the
    same ``fused``, parameter and optimizer objects, so the loop's references stay valid
    and the other models continue bit for bit.  Each new model gets a new id in
    ``fused.model_ids`` (one no model of ``fused`` had before); the others keep theirs.
    A new model starts with no optimizer state (a stock optimizer's first step), its
    gradients zero.  Schedulers on the
    optimizers are refused: torch's keep one position for all param groups, which a
    model starting at its own step 0 does not share; build them per array without
    replacement.  Compiled programs are dropped, as by :func:`keep_models`.

    Raises ``FusionIndexError`` / ``FusionArgumentError`` / ``FusionTypeError`` (a bad
    position, a scheduler, a stock optimizer on ``fused``, another structure); nothing is
    changed then.
    """
    from ..optim.convert import fuse_optimizers, unfuse_optimizers

    if not isinstance(fused, FusedModule):
        raise FusionTypeError(f"replace_models takes a fused module (hftc.fuse(models)), got "
                              f"a {type(fused).__name__}")
    given = list(models)
    positions = _check_keep(fused, given, "replace_models: the positions of models")
    hyper = {i: dict((hyperparameters or {}).get(k, {})) for i, k in zip(positions, given)}
    models = {i: models[k] for i, k in zip(positions, given)}
    optimizers = check_replaceable(fused)
    old_models = fused.unfuse()
    stocks = {id(opt): unfuse_optimizers(fused, opt, old_models) for opt in optimizers}
    new_models = list(old_models)
    for i, model in models.items():
        new_models[i] = model
    try:
        refused = FusedModule(new_models, **fused.fuse_options)
    except Exception as exc:
        raise FusionArgumentError(
            f"replace_models: the new model(s) at position(s) {sorted(models)} do not fuse "
            f"with the others ({exc})") from exc
    _check_same_tensors(fused, refused)
    for opt in optimizers:
        for i in models:
            stocks[id(opt)][i] = _fresh_stock_optimizer(
                stocks[id(opt)][i], old_models[i], new_models[i],
                _hyper_for(hyper[i], opt))
    ids = fused.model_ids
    fresh = iter(fused._new_model_ids(len(models)))
    fused._become(refused)
    fused._set_model_ids([next(fresh) if i in models else ids[i] for i in range(len(ids))])
    for opt in optimizers:
        made = fuse_optimizers(fused, stocks[id(opt)])
        LIVE_OPTIMIZERS.discard(made)  # ``opt`` is the one the loop holds
        opt.__dict__.clear()
        opt.__dict__.update(made.__dict__)


def check_replaceable(fused: FusedModule) -> list[FusedOptimizer]:
    """The ``hftc.optim`` optimizers on ``fused``, or the error :func:`replace_models`
    would raise for a stock optimizer or a scheduler on them."""
    own = {id(p) for p in fused.parameters()}
    _refuse_stock_optimizers(fused, own)
    optimizers = _optimizers_on(fused, own)
    on_them = [s for s in list(SCHEDULERS_ON_FUSED)
               if any(getattr(s, "optimizer", None) is opt for opt in optimizers)]
    if on_them:
        raise FusionArgumentError(
            f"replace_models: a {type(on_them[0]).__name__} scheduler is built on an optimizer "
            f"of this fused module; its schedule position is one for all models, and a new "
            f"model must start at its own step 0. Schedule the learning rate yourself per "
            f"model (opt.param_groups[i]['lr']), or do not replace models")
    return optimizers


def _hyper_for(values: dict[Any, Any], opt: FusedOptimizer) -> dict[str, Any]:
    if values and all(isinstance(k, torch.optim.Optimizer) for k in values):
        return dict(values.get(opt, {}))
    return values


def _check_same_tensors(fused: FusedModule, refused: FusedModule) -> None:
    # (the tensors: an extra state is a list of the models' own, not a fused tensor)
    shapes = {n: t.shape for n, t in fused.state_dict().items() if isinstance(t, torch.Tensor)}
    new = {n: t.shape for n, t in refused.state_dict().items() if isinstance(t, torch.Tensor)}
    if shapes != new:
        name = next(n for n in [*shapes, *new] if shapes.get(n) != new.get(n))
        raise FusionArgumentError(
            f"replace_models: the new models change the fused tensor `{name}` "
            f"({tuple(shapes.get(name, ()))} -> {tuple(new.get(name, ()))}); a new model "
            f"takes a place only with the widths and structure of the array")


def _fresh_stock_optimizer(stock: torch.optim.Optimizer, old: torch.nn.Module,
                           new: torch.nn.Module, values: dict[str, Any]
                           ) -> torch.optim.Optimizer:
    """A stateless stock optimizer of ``stock``'s class and groups over ``new``'s
    parameters (matched to ``old``'s by name), ``values`` written into every group."""
    names = {id(p): n for n, p in old.named_parameters()}
    groups = []
    for group in stock.param_groups:
        settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        settings.update(values)
        groups.append({**settings, "params": [new.get_parameter(names[id(p)])
                                              for p in group["params"]]})
    return type(stock)(groups)
