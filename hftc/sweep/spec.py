"""What a sweep is made of: :class:`SweepSpec`, and loading one from a user's file or module.

A spec file is plain Python that names the pieces (see ``docs/SWEEP.md``)::

    # spec.py
    def space(trial):                    # an Optuna search space
        return {"lr": trial.suggest_float("lr", 1e-3, 1.0, log=True)}

    def model(params):                   # one unmodified nn.Module per trial
        return MyCNN()

    def data():                          # ((x_train, y_train), (x_val, y_val)), tensors
        ...

    metric = "accuracy"                  # or "loss", or a function (output, target) -> float
    epochs = 10
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import numbers
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cli.load import import_user_module, run_user_code
from ..errors import SpecError, user_line
from ..lowering.runtime.losses import PER_MODEL_MARK
from ..module.group import MAX_PADDING

__all__ = ["SweepSpec", "SpecError", "load_spec", "default_optimizer", "hook_name",
           "defined_at", "plain_params"]

#: The arguments each hook is called with, in order (``metric`` when it is a function).
HOOK_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "space": ("trial",),
    "model": ("params",),
    "data": (),
    "optimizer": ("params", "module"),
    "loss": ("output", "target"),
    "metric": ("output", "target"),
    "train_step": ("model", "batch", "optimizers", "params"),
    "scheduler": ("optimizer", "params"),
    "on_epoch": ("logs",),
}


def hook_name(key: str, fn: Any) -> str:
    """``spec.<key>`` and where the function is defined: ``spec.train_step (spec.py:12)``."""
    target = inspect.unwrap(fn) if callable(fn) else fn
    partial = isinstance(target, functools.partial)
    while isinstance(target, functools.partial):  # partial(my_loss, smoothing=0.1)
        target = inspect.unwrap(target.func)
    of = (f"functools.partial of {getattr(target, '__module__', None) or '?'}."
          f"{getattr(target, '__qualname__', type(target).__name__)}" if partial else "")
    code = getattr(target, "__code__", None)
    if code is None:  # a callable object: its class's __call__
        code = getattr(vars(type(target)).get("__call__"), "__code__", None)
    # (a partial of a library's function, F.cross_entropy: its file is none of the user's)
    library = of and any(d in Path(code.co_filename).parts
                         for d in ("site-packages", "dist-packages")) if code else False
    if code is None or library:
        return f"spec.{key}" + (f" ({of})" if of else "")
    where = f"{code.co_filename}:{code.co_firstlineno}"
    return f"spec.{key} ({of}, {where})" if of else f"spec.{key} ({where})"


def defined_at(key: str, fn: Any) -> str:
    """``spec.data is defined at spec.py:12`` (or ``spec.data`` where the place is unknown)."""
    name = hook_name(key, fn)
    if " (" not in name:
        return name
    head, _, inner = name.partition(" (")
    of, _, where = inner[:-1].rpartition(", ")  # (a partial's: "functools.partial of f, ")
    if ":" not in where:  # a partial whose function has no code: no place
        return name
    return f"{head} ({of}) is defined at {where}" if of else f"{head} is defined at {where}"


def _check_hook(key: str, fn: Any) -> None:
    """A hook is a function that takes the arguments the sweep passes it, by position."""
    if not callable(fn):
        raise SpecError(f"spec.{key} must be a function {key}({', '.join(HOOK_ARGUMENTS[key])})"
                        f", got a {type(fn).__name__}: {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a readable signature (torch's C functions): trust it
    expected = HOOK_ARGUMENTS[key]
    try:
        signature.bind(*expected)
    except TypeError as exc:
        raise SpecError(
            f"{hook_name(key, fn)} has the signature {key}{signature}, but the sweep calls "
            f"it as {key}({', '.join(expected)}) ({exc}); give it exactly those "
            f"{len(expected)} positional argument(s)") from None


def plain_params(params: dict[str, Any]) -> dict[str, Any] | None:
    """What space() returned, as JSON values (best.json, the ``hftc_params`` attribute):
    NumPy numbers and one-element tensors as numbers (``np.power(2, trial.suggest_int(...))``
    is an ``np.int64``); None where a value has no JSON form (a class)."""
    def number(value: Any) -> Any:
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            return value.item()
        raise TypeError(type(value).__name__)

    try:
        return json.loads(json.dumps(params, default=number))
    except (TypeError, ValueError):
        return None


def default_optimizer(params: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` with ``lr`` / ``momentum`` / ``weight_decay`` / ``nesterov`` from
    ``params`` when the space names them (defaults 0.01, 0, 0, False)."""
    return torch.optim.SGD(
        model.parameters(),
        lr=params.get("lr", 0.01),
        momentum=params.get("momentum", 0.0),
        weight_decay=params.get("weight_decay", 0.0),
        nesterov=params.get("nesterov", False),
    )


@dataclass
class SweepSpec:
    """Everything a fused sweep needs; the same for every trial except ``params``.

    Required:
        space: ``space(trial) -> dict`` suggests one trial's hyper-parameters with
            ``trial.suggest_*`` (Optuna's define-by-run API). Return the dict that
            ``model`` and ``optimizer`` receive (derived values allowed), or ``None``
            to use ``trial.params``.
        model: ``model(params) -> nn.Module``, called under ``torch.manual_seed(seed)``.
        data: ``data() -> ((x_train, y_train), (x_val, y_val))``: tensors (``x`` may
            be a tuple of tensors for a multi-input model), or ``(train_dataset,
            val_dataset)``, map-style Datasets of ``(x, y)`` read once into memory;
            called once per worker.

    Optional:
        optimizer: ``optimizer(params, model) -> torch.optim.Optimizer``: a *stock*
            optimizer on the model's parameters (SGD, Adam, AdamW, RMSprop, Adagrad);
            hftc fuses the N of an array with ``hftc.optim.fuse_optimizers``. Default:
            :func:`default_optimizer`.
            The optimizer may have param groups (nanoGPT's weight decay off for biases
            and norms; one lr for all its groups), and ``optimizer`` may return a list of
            optimizers over parts of the model (a GAN's generator and discriminator):
            each position is fused on its own.
        loss: training loss ``loss(output, target)`` (default ``F.cross_entropy``).
        train_step: ``train_step(model, batch, optimizers, params)``, your training step
            instead of the default (zero_grad, ``per_model(loss)(...).sum().backward()``,
            step): ``model`` is the fused array (outputs ``[N, B, ...]``; alone, N = 1),
            ``batch`` is ``(x, y)`` as ``data`` gives it, ``optimizers`` the fused
            optimizers (a list, in the order ``optimizer`` returned them), ``params`` the
            N trials' params. Return the per-model training losses (N numbers) or None.
        scheduler: ``scheduler(optimizer, params) -> LRScheduler | None``, built on each
            of the trial's stock optimizers; stepped after every epoch (a
            ``ReduceLROnPlateau`` with the trial's metric).
        on_epoch: ``on_epoch(logs)`` after every epoch: one dict per trial that trained
            it (``trial``, ``epoch``, ``params``, the metric, ``train_loss``, ``lr``).
        metric: ``"accuracy"``, ``"loss"`` (``loss`` on the validation set) or a
            function ``metric(output, target) -> float`` of one model's validation
            output; measured after every epoch and reported to Optuna.
        direction: ``"maximize"`` or ``"minimize"`` (default: maximize accuracy,
            minimize anything else).
        epochs: epochs per trial (the pruners' maximum resource). batch_size: training
            batch. eval_batch_size: validation batch.
        n_trials / per_array: defaults for the sweep's size and N per fused array.
        seed: base seed (trial seeds are ``seed + trial number`` unless the space
            suggests ``"seed"``; data order, sampler). dtype: the models' and data's
            floating dtype. device: where training runs.
        sampler / pruner: Optuna objects, or names (``"tpe"``, ``"random"``;
            ``"median"``, ``"sha"``, ``"hyperband"``, ``"none"``); a function
            ``sampler(seed)`` that returns one (an Optuna class, ``TPESampler`` without
            parentheses, is made with its defaults). Every draw of the sampler is seeded
            from ``seed`` and the trial number (``hftc.sweep.sampling``), not from
            the sampler's own seed.
        pad_widths / max_padding: with ``pad_widths = True``, trials whose models differ
            only in layer widths (a ``suggest_int("hidden", ...)`` or a categorical of
            widths) share one array, padded with zeros to its widest model
            (``hftc.fuse_groups(..., pad_widths=True, max_padding=...)``), while the
            padded arithmetic is at most ``max_padding`` times the models' own (default
            1.25); farther widths go to other arrays. Each trial still trains exactly as
            alone, and its weights and optimizer state come back at its own width.
    """

    space: Callable[[Any], dict[str, Any] | None]
    model: Callable[[dict[str, Any]], nn.Module]
    data: Callable[[], Any]
    optimizer: Callable[[dict[str, Any], nn.Module], Any] = default_optimizer
    loss: Callable[..., torch.Tensor] = F.cross_entropy
    train_step: Callable[..., Any] | None = None
    scheduler: Callable[..., Any] | None = None
    on_epoch: Callable[[list[dict[str, Any]]], Any] | None = None
    metric: str | Callable[[torch.Tensor, torch.Tensor], float] = "accuracy"
    direction: str | None = None
    epochs: int = 10
    batch_size: int = 64
    eval_batch_size: int = 1024
    n_trials: int = 32
    per_array: int = 16
    seed: int = 0
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    sampler: Any = "tpe"
    pruner: Any = "median"
    pad_widths: bool = False
    max_padding: float = MAX_PADDING  # hftc.fuse_groups' default (1.25)
    name: str = "sweep"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("space", "model", "data", "optimizer", "loss"):
            _check_hook(key, getattr(self, key))
        for key in ("train_step", "scheduler", "on_epoch"):
            if getattr(self, key) is not None:
                _check_hook(key, getattr(self, key))
        if isinstance(self.metric, str) and self.metric not in ("accuracy", "loss"):
            raise SpecError(
                f"spec.metric is {self.metric!r}; use 'accuracy', 'loss' or a function "
                f"metric(output, target) -> float"
            )
        if not isinstance(self.metric, str) and not callable(self.metric):
            raise SpecError(f"spec.metric must be a name or a function, got {self.metric!r}")
        if callable(self.metric):
            _check_hook("metric", self.metric)
        if self.direction is None:
            self.direction = "maximize" if self.metric == "accuracy" else "minimize"
        if isinstance(self.direction, (list, tuple)):
            raise SpecError(_multi_objective(f"spec.direction is {self.direction!r}"))
        if self.direction not in ("maximize", "minimize"):
            raise SpecError(f"spec.direction must be 'maximize' or 'minimize', got "
                            f"{self.direction!r}")
        if PER_MODEL_MARK in getattr(self.loss, "__dict__", {}):
            raise SpecError(
                f"spec.loss is hftc.per_model({getattr(self.loss, '__name__', 'loss')}), the "
                f"N models' losses: the sweep takes each model's loss itself "
                f"(hftc.per_model(spec.loss)), and trains a trial alone with it too. Give one "
                f"model's loss: loss = F.cross_entropy (with keywords: "
                f"functools.partial(F.cross_entropy, label_smoothing=0.1))")
        for key in ("epochs", "batch_size", "eval_batch_size", "n_trials", "per_array"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"spec.{key} must be a positive int, got {value!r}")
        # Optuna's samplers (the stock comparison's, --serial's) take 0 .. 2**32 - 1 only:
        # a seed out of it failed deep inside numpy, after the sweep had started
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool) \
                or not 0 <= self.seed < 2**32:
            raise SpecError(f"spec.seed (or --seed) must be a whole number from 0 to "
                            f"2**32 - 1, as Optuna's samplers take, got {self.seed!r}")
        if not isinstance(self.pad_widths, bool):
            raise SpecError(f"spec.pad_widths must be True or False, got {self.pad_widths!r}")
        if isinstance(self.max_padding, bool) or not isinstance(self.max_padding, (int, float)) \
                or not self.max_padding >= 1:
            raise SpecError(f"spec.max_padding must be a number >= 1 (the padded arithmetic "
                            f"over the models' own that one array may do), got "
                            f"{self.max_padding!r}")
        if isinstance(self.dtype, str):
            self.dtype = getattr(torch, self.dtype)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise SpecError(f"spec.dtype must be a floating torch.dtype, got {self.dtype!r}")

    @property
    def metric_name(self) -> str:
        return self.metric if isinstance(self.metric, str) else getattr(
            self.metric, "__name__", "metric")

    def replace(self, **changes: Any) -> SweepSpec:
        """A copy with some fields changed (``None`` values are ignored)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({k: v for k, v in changes.items() if v is not None})
        if "metric" in changes and "direction" not in changes:
            values["direction"] = None
        return SweepSpec(**values)


_FIELDS = None


def _refusing_unknown_fields(init: Callable[..., None]) -> Callable[..., None]:
    """The dataclass's ``__init__``, where a keyword that is no field
    (``SweepSpec(epoch=3)``, ``storage=...``) is a SpecError naming the field meant (or
    what the sweep has instead of Optuna's argument), not Python's bare "unexpected
    keyword argument", as the same name in a spec file is (:func:`_check_misspelled`)."""
    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        known = {f.name for f in fields(SweepSpec)}
        for name in kwargs:
            if name in known:
                continue
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
            instead = (_OPTUNA_ARGUMENTS[name][1] if name in _OPTUNA_ARGUMENTS else
                       f"did you mean {close[0]}=?" if close else
                       "the spec fields are listed in docs/SWEEP.md")
            raise SpecError(f"SweepSpec got {name}={kwargs[name]!r}{user_line()}, which is "
                            f"no field of a sweep spec: {instead}")
        init(self, *args, **kwargs)
    return checked


SweepSpec.__init__ = _refusing_unknown_fields(SweepSpec.__init__)


def _spec_fields() -> list[str]:
    global _FIELDS
    if _FIELDS is None:
        _FIELDS = [f.name for f in fields(SweepSpec) if f.name != "extra"]
    return _FIELDS


def load_spec(target: str | Path | Any) -> SweepSpec:
    """A :class:`SweepSpec` from a spec file (``path/to/spec.py``), a module path
    (``mypkg.sweeps.digits``), a module object, or a ``SweepSpec`` (returned as is).

    The module names the pieces as module-level attributes (``space``, ``model``,
    ``data``, and optionally every other :class:`SweepSpec` field), or defines
    ``spec`` / ``SPEC``, a ready ``SweepSpec``.
    """
    if isinstance(target, SweepSpec):
        return target
    if isinstance(target, (str, Path)):
        module = _import(str(target))
    else:
        module = target
    for name in ("spec", "SPEC"):
        ready = getattr(module, name, None)
        if isinstance(ready, SweepSpec):
            return ready
    where = getattr(module, "__file__", None) or getattr(module, "__name__", repr(module))
    missing = [k for k in ("space", "model", "data") if not hasattr(module, k)]
    if missing:
        raise SpecError(
            f"the sweep spec {where} does not define {', '.join(missing)}; a spec defines "
            f"space(trial), model(params) and data() (see docs/SWEEP.md)"
        )
    values = {k: getattr(module, k) for k in _spec_fields() if hasattr(module, k)}
    _check_misspelled(module, where)
    if "name" not in values:
        values["name"] = Path(str(where)).stem if str(where).endswith(".py") else str(
            getattr(module, "__name__", "sweep")).rpartition(".")[2]
    return SweepSpec(**values)


def _optuna_bases(name: str) -> tuple[type, ...]:
    """Optuna's base class ``samplers.BaseSampler`` (or ``pruners.BasePruner``), or none
    where optuna is not installed (the spec cannot use its objects then)."""
    try:
        import optuna
    except ImportError:
        return ()
    package, _, cls = name.partition(".")
    return (getattr(getattr(optuna, package), cls),)


def _misspelling(module: Any, name: str, value: Any) -> str | None:
    """The spec field ``name`` was likely meant as (``optimiser`` -> ``optimizer``, ``epoch``
    -> ``epochs``), or None: a field it is close to, that the spec does not define, and
    whose kind ``value`` has (a function taking the hook's arguments; a number, string,
    dtype or bool where the field is one)."""
    if name.startswith("_") or name in ("spec", "SPEC", "extra") or name in _spec_fields():
        return None
    close = [f for f in difflib.get_close_matches(name, _spec_fields(), n=3, cutoff=0.8)
             if f != name and not hasattr(module, f)]
    for wanted in close:
        if wanted == "metric" and isinstance(value, str):
            return wanted  # (metrics = "loss": the metric may be named, not only a function)
        if wanted in HOOK_ARGUMENTS:
            if not isinstance(value, types.FunctionType) or \
                    getattr(value, "__module__", None) != module.__name__:
                continue  # a function of the spec's own, not one it imported
            try:
                inspect.signature(value).bind(*HOOK_ARGUMENTS[wanted])
            except (TypeError, ValueError):
                continue
            return wanted
        default = next(f.default for f in fields(SweepSpec) if f.name == wanted)
        # The kinds a field's value may have where its default's type does not say them
        # all (direction's default is None; a sampler or pruner is a name or an object)
        kinds = {"sampler": (str, *_optuna_bases("samplers.BaseSampler")),
                 "pruner": (str, *_optuna_bases("pruners.BasePruner")),
                 "dtype": (torch.dtype, str), "max_padding": (int, float),
                 "direction": (str,), "device": (str, torch.device)}.get(
                     wanted, (type(default),))
        if isinstance(value, kinds) and isinstance(value, bool) == isinstance(default, bool):
            return wanted
    return None


def _multi_objective(what: str) -> str:
    return (f"{what}: a sweep spec has one objective (its metric, which the pruner "
            f"compares; Optuna's multi-objective studies cannot prune). Give direction = "
            f"'maximize' or 'minimize'; for several objectives, keep your loop and run "
            f"hftc.sweep.optimize(optuna.create_study(directions=[...]), objective), whose "
            f"objective returns each trial's values (docs/SWEEP.md)")


#: study.optimize's and create_study's arguments, which an Optuna user may write in a spec
#: as fields: the kinds of value they take, and what the sweep has instead.
_OPTUNA_ARGUMENTS: dict[str, tuple[tuple[type, ...], str]] = {
    "storage": ((str,), "give it on the command line, --storage URL, or as "
                        "hftc.sweep.run(spec, storage=URL)"),
    "study_name": ((str,), "name the study with the spec's name = ... (or --study NAME)"),
    "timeout": ((int, float), "the sweep has no time limit: its size is n_trials (stop it "
                              "with Ctrl-C and continue it with --resume); a time limit "
                              "needs your own loop, hftc.sweep.optimize(..., timeout=...)"),
    "n_jobs": ((int,), "the trials of an array train at once: per_array = N (or more "
                       "workers, --workers)"),
    "callbacks": ((list, tuple), "use on_epoch(logs) (after every epoch), or your own loop "
                                 "with hftc.sweep.optimize(..., callbacks=[...])"),
}


def _check_optuna_arguments(module: Any, where: str) -> None:
    """``storage = "postgresql://..."`` or ``timeout = 3600`` in a spec (study.optimize's
    and create_study's names) would be read by nothing: every machine would run its own
    SQLite study, the sweep would not stop at the hour. Said, with what to write."""
    for name, (kinds, instead) in _OPTUNA_ARGUMENTS.items():
        value = vars(module).get(name)
        if isinstance(value, kinds) and not isinstance(value, bool):
            raise SpecError(f"the sweep spec {where} defines {name} = {value!r}, which is "
                            f"optuna's argument and no field of a sweep spec: the sweep "
                            f"would run without it; {instead} (or start its name with '_' if "
                            f"it is a value of your own)")


def _check_misspelled(module: Any, where: str) -> None:
    """A module-level name that is a spec field misspelled is an error, not a spec that
    quietly runs without it (``def optimiser(params, module)`` would train with SGD)."""
    if isinstance(vars(module).get("directions"), (list, tuple)):  # create_study's, for
        # several objectives (a string there is a misspelled direction: said below)
        raise SpecError(_multi_objective(
            f"the sweep spec {where} defines directions = {vars(module)['directions']!r}, "
            f"which the sweep does not read"))
    _check_optuna_arguments(module, where)
    for name, value in vars(module).items():
        wanted = _misspelling(module, name, value)
        if wanted is None:
            continue
        what = (hook_name(name, value).replace("spec.", "", 1) if callable(value)
                else f"{name} = {value!r}")
        arguments = (f"{wanted}({', '.join(HOOK_ARGUMENTS[wanted])})"
                     if wanted in HOOK_ARGUMENTS and callable(value) else wanted)
        raise SpecError(
            f"the sweep spec {where} defines {what}, which the sweep does not read: did you "
            f"mean {arguments}? Rename it to {wanted!r} (the spec fields are listed in "
            f"docs/SWEEP.md), or start its name with '_' if it is a helper of your own")


def _import(target: str):
    if target.endswith(".py") or "/" in target or Path(target).is_file():
        path = Path(target)
        if not path.is_file():
            raise SpecError(f"no such sweep spec file: {path}")
        name = f"_hftc_spec_{path.stem}"
        loaded = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loaded)
        sys.modules[name] = module  # so pickling / dataclasses inside the spec work
        # The spec may import its neighbours, also later (inside model()), as a script could.
        _add_to_path(path.resolve().parent)
        run_user_code(lambda: loaded.loader.exec_module(module), f"the sweep spec {path}",
                      SpecError)
        return module
    _add_to_path(Path.cwd())
    return import_user_module(target, f"the sweep spec module {target!r}",
                              f"cannot import the sweep spec module {target!r}", SpecError)


def _add_to_path(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
