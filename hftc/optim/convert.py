"""``fuse_optimizers``: N stock torch optimizers -> one fused optimizer, state included;
``unfuse_optimizers``: the way back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import FusionArgumentError, FusionTypeError
from ..training import mistakes
from .adadelta import Adadelta
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .adamax import Adamax
from .mixed import MixedOptimizer, Part
from .nadam import NAdam
from .optimizer import FusedOptimizer
from .radam import RAdam
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["fuse_optimizers", "unfuse_optimizers", "fusable_classes"]

# Exact classes (each fused class names its stock one): AdamW subclasses Adam in torch,
# and must map to AdamW.
_FUSED_CLASS: dict[type, type[FusedOptimizer]] = {
    cls._stock: cls for cls in (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, NAdam,
                                RAdam)
}

#: Stock classes with no fused counterpart whose update is elementwise: on the stacked
#: parameters, with one value for all models, each model trains as alone.
_ELEMENTWISE_STOCK = (torch.optim.Rprop, torch.optim.ASGD)


def fusable_classes() -> tuple[type, ...]:
    """The stock ``torch.optim`` classes :func:`fuse_optimizers` continues (exactly these,
    not their subclasses): a sweep checks a spec's optimizers against them up front."""
    return tuple(_FUSED_CLASS)


# Group keys not copied into the fused optimizer's groups: the parameters, and the flags
# the fused constructor takes once for all models (``foreach``, one per model in torch's
# groups and changing no value, is copied per model).
_IGNORED_KEYS = {"params", "param_names", "fused", "capturable", "differentiable"}


def fuse_optimizers(fused: torch.nn.Module,
                    optimizers: Sequence[torch.optim.Optimizer]) -> FusedOptimizer:
    """One fused optimizer that continues N stock optimizers, each model as if alone.

    ``optimizers[i]`` is a stock ``torch.optim`` optimizer (SGD, Adam, AdamW, RMSprop,
    Adagrad, Adadelta, Adamax, NAdam or RAdam) with one param group over the parameters
    of the model that was ``models[i]`` in ``fused = hftc.fuse(models)``::

        opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, lrs)]
        fused = hftc.fuse(models)
        opt = hftc.optim.fuse_optimizers(fused, opts)   # hftc.optim.Adam, lr=lrs

    Model i's hyper-parameters become ``opt.param_groups[i]`` (other keys in its
    group, such as a scheduler's ``initial_lr`` or ``foreach``, are copied too), and
    its state (``step``, ``exp_avg``, ``momentum_buffer``, ...) becomes slice i of the
    stacked state, so optimizers that already stepped continue where they were.
    Parameters are matched through ``fused.source_parameter_names``.  ``fused``
    carries over (every optimizer's must be the same: it picks the update's kernels
    for all N models), and so does ``capturable`` where the fused class takes
    ``capturable=True`` (Adam, AdamW); ``differentiable=True``, and ``capturable=True``
    elsewhere, are refused with a ``FusionArgumentError``, as the fused constructor
    refuses them.

    Optimizers of different classes (SGD for some models, Adam for others) give a
    :class:`~hftc.optim.mixed.MixedOptimizer`: one fused optimizer per class over its
    models' rows, stepped together, with the same per-model ``param_groups`` (each
    model's holds its own class's keys, so per-model schedulers work); ``capturable``
    is refused there.  One class gives that class's fused optimizer, as always.

    Raises:
        TypeError: a class that is not supported (``FusionTypeError`` naming the
            model), or ``fused`` is not fused.
        ValueError: wrong number of optimizers, more than one param group, or a
            parameter that is not one of model i's; ``FusionArgumentError`` (a
            ``ValueError``) for flags hftc cannot honour, optimizers that differ in
            ``fused``, or a model's groups that differ in ``lr`` or in a key the class does
            not use (timm's ``lr_scale``): one dict per model holds one value of each.
    """
    n, sources = _fused_module(fused)
    optimizers = list(optimizers)
    classes = _fused_classes(optimizers, n)
    if len(set(classes)) > 1:
        out: FusedOptimizer = _fuse_mixed(fused, optimizers, classes, sources, n)
    else:
        fused_flag = _check_groups(optimizers, classes[0])
        names = _parameter_names(optimizers, sources, n)
        by_name = dict(fused.named_parameters())
        out = _construct(classes[0], optimizers, names, by_name, fused_flag, n)
        _import_state(out, optimizers, names, by_name)
    # (a scheduler left on a stock optimizer steps its rates, never the fused one's)
    mistakes.note_fused_optimizers(out, optimizers)
    return out


def _fuse_mixed(fused: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                classes: list[type[FusedOptimizer]], sources: Sequence[dict[int, str]],
                n: int) -> MixedOptimizer:
    """Optimizers of several classes -> one :class:`MixedOptimizer`: per class, its fused
    optimizer built (``_construct``, ``_import_state``) as for one class, over proxies
    of its models' rows of each stacked parameter."""
    for i, opt in enumerate(optimizers):
        if any(g.get("capturable") for g in opt.param_groups):
            raise FusionArgumentError(
                f"fuse_optimizers: optimizers[{i}] (model {i}, {type(opt).__name__}) has "
                f"capturable=True, and its models' optimizers are of different classes "
                f"({', '.join(sorted({c.__name__ for c in classes}))}): a mixed fused "
                f"optimizer steps each class in turn on the host, which a CUDA graph cannot "
                f"capture. Build them with capturable=False, or give each class its own "
                f"fused array")
    by_name = dict(fused.named_parameters())
    # Each class's optimizers share their param groups; across classes only the
    # parameters must be the same (SGD in one group, AdamW in decay / no-decay groups).
    by_class = {cls: [i for i, c in enumerate(classes) if c is cls]
                for cls in dict.fromkeys(classes)}  # in the order of first appearance
    names: dict[int, list[list[str]]] = {}
    fused_flags = {}
    for cls, rows in by_class.items():
        fused_flags[cls] = _check_groups([optimizers[i] for i in rows], cls, labels=rows)
        class_names = _parameter_names([optimizers[i] for i in rows],
                                       [sources[i] for i in rows], len(rows), labels=rows)
        names.update(zip(rows, class_names))
    flat = {i: [name for group in names[i] for name in group] for i in names}
    for i in range(1, n):
        if set(flat[i]) != set(flat[0]):
            raise FusionArgumentError(
                f"optimizers[0] ({type(optimizers[0]).__name__}) and optimizers[{i}] "
                f"({type(optimizers[i]).__name__}) optimize different parameters (only in 0: "
                f"{sorted(set(flat[0]) - set(flat[i]))}; only in {i}: "
                f"{sorted(set(flat[i]) - set(flat[0]))}); every model's optimizer must cover "
                f"the same parameters")
    stacked = [by_name[name] for name in flat[0]]
    position = {name: k for k, name in enumerate(flat[0])}
    parts = []
    for cls, rows in by_class.items():
        members = [optimizers[i] for i in rows]
        member_names = [names[i] for i in rows]
        index = torch.tensor(rows, dtype=torch.long)
        # The part's own tensors of its rows' shape; each step points them at the rows.
        proxies = {name: p.detach().index_select(0, index.to(p.device))
                   for name, p in by_name.items() if name in position}
        sub = _construct(cls, members, member_names, proxies, fused_flags[cls], len(rows))
        _import_state(sub, members, member_names, proxies)
        name_of = {id(p): name for name, p in proxies.items()}
        order = [position[name_of[id(p)]] for p in sub.param_groups[0]["params"]]
        parts.append(Part(sub, rows, order))
    return MixedOptimizer(stacked, parts)


def _fused_module(fused: torch.nn.Module) -> tuple[int, Sequence[dict[int, str]]]:
    """N and, per model, ``id(parameter) -> fused name``; or a TypeError for a module
    that is not fused."""
    n = getattr(fused, "num_models", None)
    sources = getattr(fused, "source_parameter_names", None)
    if n is None or sources is None:
        raise FusionTypeError(
            f"fuse_optimizers needs a fused module (hftc.fuse(models)) with num_models "
            f"and source_parameter_names; got {type(fused).__name__}"
        )
    return n, sources


def _fused_classes(optimizers: list[torch.optim.Optimizer],
                   n: int) -> list[type[FusedOptimizer]]:
    """Each model's fused class (``_FUSED_CLASS`` of its stock optimizer's exact class)."""
    if len(optimizers) != n:
        raise FusionArgumentError(
            f"fuse_optimizers got {len(optimizers)} optimizers for {n} fused models; "
            f"give one per model, in the order the models were fused"
        )
    classes = []
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise FusionTypeError(
                f"optimizers[{i}] is a {type(opt).__name__}, not a torch optimizer")
        cls = type(opt)
        if cls not in _FUSED_CLASS:
            supported = ", ".join(f"torch.optim.{c.__name__}" for c in _FUSED_CLASS)
            others = {type(o).__name__ for o in optimizers} - {cls.__name__}
            mixed = (f" (nor fuse it with the other models' {', '.join(sorted(others))}: "
                     f"train model {i} in an array of its own, or alone)" if others else "")
            elementwise = (
                f". {cls.__name__} updates each element on its own: with the same values "
                f"for all models, torch.optim.{cls.__name__}(fused.parameters(), ...) on the "
                f"stacked parameters trains each model as its own would (from a fresh "
                f"state)" if cls in _ELEMENTWISE_STOCK else "")
            raise FusionTypeError(
                f"fuse_optimizers does not support {cls.__name__}: optimizers[{i}] (model "
                f"{i}) is a {cls.__module__}.{cls.__qualname__}{mixed}; supported: "
                f"{supported}{elementwise}")
        classes.append(_FUSED_CLASS[cls])
    return classes


def _check_groups(optimizers: list[torch.optim.Optimizer],
                  fused_cls: type[FusedOptimizer], labels: Sequence[int] | None = None) -> bool:
    """Refuse param groups one fused optimizer cannot continue; returns the optimizers'
    one ``fused`` flag.  ``labels``: each optimizer's index in the user's list (the
    models of one class of a mixed list)."""
    scope = "" if labels is None else "of one class "
    labels = list(range(len(optimizers)) if labels is None else labels)
    for k, opt in enumerate(optimizers):
        i = labels[k]
        if len(opt.param_groups) != len(optimizers[0].param_groups):
            raise FusionArgumentError(
                f"optimizers[{labels[0]}] has {len(optimizers[0].param_groups)} param groups "
                f"and optimizers[{i}] {len(opt.param_groups)}; every model's optimizer "
                f"{scope}needs the same groups")
        # (by value: a tensor lr hashes by identity, and equal tensors in two groups agree)
        if len({float(g["lr"]) for g in opt.param_groups}) > 1:
            raise FusionArgumentError(
                f"optimizers[{i}]'s param groups have different learning rates "
                f"({[g['lr'] for g in opt.param_groups]}); param_groups[i] of the fused "
                f"optimizer is model i, whose lr holds for all its parameters: fuse such "
                f"groups into separate fused optimizers")
        _refuse_differing_extra_keys(opt, i, fused_cls)
        for key in ("differentiable", "capturable"):
            if any(g.get(key, False) for g in opt.param_groups):
                fused_cls._check_flags({key: True}, f"optimizers[{i}]: ")  # raises, saying why
    fused_flag = {bool(g.get("fused")) for opt in optimizers for g in opt.param_groups}
    if len(fused_flag) > 1:
        flags = [[g.get("fused") for g in opt.param_groups] for opt in optimizers]
        raise FusionArgumentError(
            f"fuse_optimizers: the optimizers' fused flags differ ({flags}); the fused "
            f"optimizer runs one implementation for all N models: build them all with "
            f"fused=True or all without")
    return fused_flag.pop()


def _refuse_differing_extra_keys(opt: torch.optim.Optimizer, i: int,
                                 fused_cls: type[FusedOptimizer]) -> None:
    """A key that is not one of the class's hyper-parameters (timm's ``lr_scale``, a
    group's ``name``) and differs between model i's groups: the fused optimizer's one dict
    for model i took group 0's value, and a scheduler reading it (timm's multiplies each
    group's lr by its ``lr_scale``) would have applied it to every parameter, silently."""
    groups = opt.param_groups
    for key in dict.fromkeys(k for g in groups for k in g):
        if key in _IGNORED_KEYS or key in fused_cls._hyperparameters or key in fused_cls._flags:
            continue
        values = [g.get(key, _MISSING) for g in groups]
        if all(_same_value(v, values[0]) for v in values[1:]) \
                or all(isinstance(v, str) for v in values):
            continue  # (a label such as a group's "name" changes no step: group 0's kept)
        shown = ", ".join("(none)" if v is _MISSING else repr(v) for v in values)
        raise FusionArgumentError(
            f"fuse_optimizers: optimizers[{i}]'s (model {i}'s) param groups differ in "
            f"{key!r} ({shown}), which {fused_cls.__name__} does not use itself; "
            f"param_groups[{i}] of the fused optimizer is one dict for all of model {i}'s "
            f"parameters, so it can hold one {key!r} (what reads it, such as a scheduler "
            f"scaling each group's lr by it, would apply group 0's to every parameter). "
            f"Give every group the same {key!r}, or give each group's parameters a fused "
            f"optimizer of their own (fuse_optimizers of one stock optimizer per group)")


_MISSING = object()


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # (an array's ambiguous truth value)
        return a is b


def _parameter_names(optimizers: list[torch.optim.Optimizer],
                     sources: Sequence[dict[int, str]], n: int,
                     labels: Sequence[int] | None = None) -> list[list[list[str]]]:
    """``names[i][k]``: model i's group k, as fused parameter names (the same for all i).
    ``labels``: each optimizer's index in the user's list (one class of a mixed list)."""
    labels = list(range(n) if labels is None else labels)
    others = dict(zip(labels, sources))
    names = [[_fused_names(labels[i], g, sources[i], others) for g in opt.param_groups]
             for i, opt in enumerate(optimizers)]
    for i in range(1, n):
        for k, (group0, group_i) in enumerate(zip(names[0], names[i])):
            if set(group_i) != set(group0):
                only_0 = sorted(set(group0) - set(group_i))
                only_i = sorted(set(group_i) - set(group0))
                where = f"param group {k} of " if len(names[0]) > 1 else ""
                first, other = labels[0], labels[i]
                raise FusionArgumentError(
                    f"{where}optimizers[{first}] and optimizers[{other}] optimize different "
                    f"parameters (only in {first}: {only_0}; only in {other}: {only_i}); every "
                    f"model's optimizer must cover the same parameters"
                )
    return names


def _construct(fused_cls: type[FusedOptimizer], optimizers: list[torch.optim.Optimizer],
               names: list[list[list[str]]], by_name: dict[str, torch.nn.Parameter],
               fused_flag: bool, n: int) -> FusedOptimizer:
    """The fused optimizer, with model i's hyper-parameters (and its group's other keys)
    in ``param_groups[i]``."""
    def values(k: int) -> dict[str, list[Any]]:
        """Group k's hyper-parameters, one value per model.  A key missing from some group
        (an optimizer pickled by an older torch) takes the default."""
        groups = [opt.param_groups[k] for opt in optimizers]
        hyper = {key: [g[key] for g in groups]
                 for key in fused_cls._hyperparameters if all(key in g for g in groups)}
        if fused_cls is AdamW:
            hyper.pop("decoupled_weight_decay", None)
        return hyper

    hyper = values(0)
    if len(names[0]) == 1:
        params: list[Any] = [by_name[name] for name in names[0][0]]
    else:  # group 0's values as the fused optimizer's; the other groups' where they differ
        params = [{"params": [by_name[name] for name in group],
                   **{key: v for key, v in values(k).items() if key != "lr" and v != hyper[key]}}
                  for k, group in enumerate(names[0])]
    flags = {"fused": fused_flag} if "fused" in fused_cls._flags else {}
    capturable = {bool(g.get("capturable")) for opt in optimizers for g in opt.param_groups}
    if len(capturable) > 1:
        raise FusionArgumentError(
            f"fuse_optimizers: the optimizers' capturable flags differ "
            f"({[[g.get('capturable') for g in opt.param_groups] for opt in optimizers]}); "
            f"the fused optimizer's step is capturable for all N models or for none: build "
            f"them all with capturable=True or all without")
    if capturable.pop():  # _check_groups refused the classes that cannot honour it
        flags["capturable"] = True
    out = fused_cls(params, num_models=n, **hyper, **flags)
    for i, opt in enumerate(optimizers):
        for key, value in opt.param_groups[0].items():
            if key not in _IGNORED_KEYS and key not in fused_cls._hyperparameters:
                out.param_groups[i][key] = value
    return out


def _import_state(out: FusedOptimizer, optimizers: list[torch.optim.Optimizer],
                  names: list[list[list[str]]], by_name: dict[str, torch.nn.Parameter]) -> None:
    """Each stock optimizer's state (``step``, ``exp_avg``, ...) as slice i of the fused
    optimizer's stacked state."""
    hp = out.hyperparameters()
    group_of = {id(p): k for p, k in zip(out.param_groups[0]["params"], out._group_of)}
    for i, opt in enumerate(optimizers):
        for stock_group, group_names in zip(opt.param_groups, names[i]):
            for p_stock, name in zip(stock_group["params"], group_names):
                stock_state = opt.state.get(p_stock)
                if not stock_state:
                    continue  # not stepped yet: slice i keeps the fresh state stock would make
                p = by_name[name]
                if not out.state[p]:
                    out._init_state(p, {**hp, **out._group_overrides[group_of[id(p)]]})
                out._import_model_state(p, i, stock_state)


def _fused_names(model: int, group: dict[str, Any], source: dict[int, str],
                 others: dict[int, dict[int, str]]) -> list[str]:
    """Model ``model``'s fused name of each parameter in ``group`` (``source``: its
    parameters' names; ``others``: every model's, to say whose a stray parameter is)."""
    names = []
    for k, p in enumerate(group["params"]):
        name = source.get(id(p))
        if name is None:
            owner = next((j for j, names_j in others.items() if id(p) in names_j), None)
            whose = (f": it is model {owner}'s {others[owner][id(p)]!r} (give the optimizers "
                     f"in the order of the models)" if owner is not None else "")
            raise FusionArgumentError(
                f"optimizers[{model}] holds a parameter (#{k}, shape {list(p.shape)}) that is "
                f"not a parameter of model {model}{whose}; build optimizer i on the "
                f"parameters of the module passed as models[i] to hftc.fuse"
            )
        names.append(name)
    return names



def unfuse_optimizers(fused: torch.nn.Module, optimizer: FusedOptimizer,
                      models: Sequence[torch.nn.Module] | None = None
                      ) -> list[torch.optim.Optimizer]:
    """The inverse of :func:`fuse_optimizers`: N stock optimizers, state included, each
    continuing its model exactly where the fused optimizer would have::

        models = fused.unfuse()
        optimizers = hftc.optim.unfuse_optimizers(fused, opt, models)
        # optimizers[i] is a torch.optim.<model i's class> over models[i].parameters()

    ``models`` default to ``fused.unfuse()``; each must have the fused module's parameter
    names.  The flags travel too (``fused=True`` gives stock optimizers built with
    ``fused=True``; ``foreach`` is copied per model).  An optimizer built with
    param-group dicts (nanoGPT's ``[{"params": matrices, "weight_decay": 0.1},
    {"params": biases, "weight_decay": 0.0}]``) gives stock optimizers with the same
    groups, each with model i's values.  A :class:`MixedOptimizer` gives each model
    its own class's optimizer.
    """
    from .slicing import fused_param_names, load_model_slice

    stock_of = {fused_cls: stock for stock, fused_cls in _FUSED_CLASS.items()}
    if type(optimizer) not in stock_of and not isinstance(optimizer, MixedOptimizer):
        raise FusionTypeError(
            f"unfuse_optimizers takes an hftc.optim optimizer "
            f"({', '.join(c.__name__ for c in _FUSED_CLASS.values())}, or the "
            f"MixedOptimizer of fuse_optimizers), got {type(optimizer).__name__}")
    models = list(fused.unfuse() if models is None else models)
    if len(models) != optimizer.num_models:
        raise FusionArgumentError(
            f"unfuse_optimizers: {len(models)} models for a fused optimizer "
            f"of {optimizer.num_models}")
    state, names = optimizer.state_dict(), fused_param_names(fused, optimizer)

    def stock_optimizer(model: torch.nn.Module, index: int) -> torch.optim.Optimizer:
        """An empty stock optimizer of model ``index``'s class over ``model``'s parameters,
        grouped as its fused optimizer groups them (one group, or its param-group dicts'
        groups); load_model_slice sets each group's values."""
        owner, order = optimizer, list(range(len(names)))
        if isinstance(optimizer, MixedOptimizer):
            owner, _ = optimizer.part_of(index)
            order = optimizer.part_parameter_order(optimizer.parts().index(owner))
        # fused=True: stock optimizers built fused (their kernels, AMP handling); the other
        # flags and hyper-parameters come with each model's group.
        flags = {"fused": True} if owner.param_groups[0].get("fused") else {}
        group_of = list(getattr(owner, "_group_of", None) or [0] * len(order))
        n_groups = len(getattr(owner, "_group_overrides", [{}]))
        # Only the parameters the fused optimizer holds (a head's optimizer, or one of a
        # backbone / head pair, must not step the rest of the model), in its order.
        by_name = dict(model.named_parameters())
        missing = sorted({names[k] for k in order} - set(by_name))
        if missing:
            raise FusionArgumentError(
                f"unfuse_optimizers: models[{index}] has no parameter {missing[0]!r}, which "
                f"the fused optimizer holds; give the models of fused.unfuse(), whose "
                f"parameter names are the fused module's")
        params: Any = [{"params": [by_name[names[k]] for k, g_k in zip(order, group_of)
                                   if g_k == g]} for g in range(n_groups)]
        return stock_of[type(owner)](params, **flags)

    return [load_model_slice(state, names, i, stock_optimizer(model, i), model)
            for i, model in enumerate(models)]
