"""What the user holds of a fused module, remembered for :mod:`hftc.training.mistakes`:
its outputs (marked with N) and the copies ``unfuse()`` gave (weakly).

::

    out = fused(x)              out._hftc_num_models == N   (a stock loss on it is checked)
    m = fused.unfuse_model(2)   noted: a fused optimizer's step warns if m got gradients
                                and nothing stepped it

A mark is a plain attribute of the output tensor object: an op on it makes a new tensor
without one, and nothing is marked where torch.compile traces (a compiled region sees
no attribute).
"""

from __future__ import annotations

import contextlib
import operator
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..errors import FusionArgumentError, UsageWarning, user_stacklevel
from ..lowering.runtime.modules import StackedModule

#: The attribute of a fused module's output tensors: the N models it stacks.
OUTPUT_MARK = "_hftc_num_models"


def mark_outputs(out: Any, num_models: int) -> Any:
    """``out`` (a tensor, or a tuple, list or dict of them) with each ``[N, ...]`` tensor
    marked as a fused output of ``num_models`` models; returned as it is."""
    if torch.compiler.is_compiling():
        return out
    values = (out.values() if isinstance(out, dict)
              else out if isinstance(out, (tuple, list)) else (out,))
    for t in values:
        if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == num_models:
            with contextlib.suppress(AttributeError, RuntimeError):  # (a functorch wrapper)
                setattr(t, OUTPUT_MARK, num_models)
                if t.grad_fn is not None:  # (found behind a loss the user made of it)
                    t.grad_fn.metadata[OUTPUT_MARK] = num_models
    return out


def fused_output_models(t: Any) -> int | None:
    """N where ``t`` is a marked fused output, else None (a Proxy or any other object)."""
    if not isinstance(t, Tensor):
        return None
    return getattr(t, OUTPUT_MARK, None)


class UnfusedCopy:
    """One model ``unfuse()`` gave: weak references to it and its fused module, the
    model's id, the user's line that asked for it and its parameters' versions then
    (an optimizer of its own that stepped it changed them)."""

    __slots__ = ("fused", "model", "model_id", "line", "versions")

    def __init__(self, fused: nn.Module, model: nn.Module, model_id: int, line: str) -> None:
        self.fused, self.model = weakref.ref(fused), weakref.ref(model)
        self.model_id, self.line = model_id, line
        self.versions = [p._version for p in model.parameters()]

    def trained_alone(self) -> bool:
        """Gradients reached the copy, and nothing stepped it: trained as if the fused
        module would follow (a copy stepped by an optimizer of its own is meant so)."""
        model = self.model()
        params = list(model.parameters()) if model is not None else []
        return any(p.grad is not None for p in params) \
            and [p._version for p in params] == self.versions


#: The live copies unfuse() gave, the latest :data:`KEPT_COPIES` (dead ones are dropped).
UNFUSED_COPIES: list[UnfusedCopy] = []
KEPT_COPIES = 32


def note_copy(fused: nn.Module, model: nn.Module, model_id: int) -> None:
    """Remember that ``unfuse()`` gave ``model`` (model ``model_id`` of ``fused``) to the
    user's code (hftc's own calls, replace_models' and the fused methods', are not)."""
    caller = sys._getframe(1)
    while caller is not None and caller.f_globals.get("__name__") in (__name__,
                                                                      "hftc.module.unfuse"):
        caller = caller.f_back
    if caller is None or (caller.f_globals.get("__name__") or "").startswith("hftc."):
        return
    UNFUSED_COPIES[:] = [c for c in UNFUSED_COPIES if c.model() is not None][1 - KEPT_COPIES:]
    frame = sys._getframe(user_stacklevel() - 1)
    line = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    UNFUSED_COPIES.append(UnfusedCopy(fused, model, model_id, line))


# --------------------------------------------------------------------------- the models' modes

#: id(fused module) -> (weak references to the models hftc.fuse was given, their modes
#: then); an entry leaves with its module. (By id: a WeakKeyDictionary's lookup makes a
#: weak reference, at every forward.)
_SOURCES: dict[int, tuple[list[weakref.ref], list[bool]]] = {}
#: id(a model given to hftc.fuse) -> (the fused module, weakly; its position; its first
#: parameter's version then): what :func:`stale_source` reads.
_ORIGINALS: dict[int, tuple[weakref.ref, int, int]] = {}


def note_sources(fused: nn.Module, models: Sequence[nn.Module]) -> None:
    """Remember (weakly) the models ``fused`` was made from and their train / eval modes."""
    with contextlib.suppress(TypeError):  # (a model that refuses weak references)
        _SOURCES[id(fused)] = ([weakref.ref(m) for m in models], [m.training for m in models])
        weakref.finalize(fused, _SOURCES.pop, id(fused), None)
        _SOURCE_ATTRIBUTES[id(fused)] = _note_attributes(models)
        weakref.finalize(fused, _SOURCE_ATTRIBUTES.pop, id(fused), None)
        for i, m in enumerate(models):
            first = next(m.parameters(), None)
            if first is not None:
                _ORIGINALS[id(m)] = (weakref.ref(fused), i, first._version)
                weakref.finalize(m, _ORIGINALS.pop, id(m), None)


def stale_source(model: nn.Module) -> tuple[nn.Module, int, str] | None:
    """``(fused module, position, parameter name)`` where ``model`` was given to
    hftc.fuse, was not trained since (its first parameter's version is the one of then)
    and that parameter differs from the fused module's copy of it (which trained): its
    weights are the ones of the fusing, not the training's. Else None."""
    noted = _ORIGINALS.get(id(model))
    first = next(model.parameters(), None)
    fused = noted[0]() if noted is not None else None
    if fused is None or first is None or first._version != noted[2]:
        return None
    position = noted[1]
    names = getattr(fused, "source_parameter_names", None) or []
    name = names[position].get(id(first)) if position < len(names) else None
    if name is None:
        return None
    copy = fused.get_parameter(name)
    if copy.shape[1:] != first.shape or position >= copy.shape[0] \
            or copy.device != first.device or copy.dtype != first.dtype:
        return None
    with torch.no_grad():
        differs = not torch.equal(copy[position], first)
    own_name = next((n for n, p in model.named_parameters() if p is first), name)
    return (fused, position, own_name) if differs else None


def check_source_modes(fused: nn.Module) -> None:
    """Before a forward of ``fused``: every model it was made from switched to the other
    mode since (``for m in models: m.eval()``) while ``fused`` stays in this one is the
    user's ``eval()`` meant for the fused module, which copied the models and keeps its
    own mode (dropout would stay on in a validation). A UsageWarning, once per module.
    One weak reference read where model 0 kept its mode (the common case)."""
    if torch.compiler.is_compiling():
        return
    sources = _SOURCES.get(id(fused))
    if sources is None:
        return
    refs, modes = sources
    first = refs[0]()
    if first is None or first.training == modes[0] or first.training == fused.training:
        return
    models = [r() for r in refs]
    if any(m is None or m.training == fused.training for m in models):
        return
    _SOURCES.pop(id(fused), None)
    now, kept = ("eval", "train") if fused.training else ("train", "eval")
    warnings.warn(
        f"the {len(models)} models given to hftc.fuse were switched to {now} mode since, "
        f"but the fused module runs in {kept} mode: it copied them and keeps its own mode "
        f"(a model's {now}() does not reach it). Call fused.{now}() instead.",
        UsageWarning, stacklevel=user_stacklevel())


# --------------------------------------------------------------------------- the models' attributes

#: id(fused module) -> the plain attributes of the models hftc.fuse was given, as they
#: were then: for each model, its own classes' modules (where a value the user changes
#: lives: ``self.temperature``), and torch.nn's modules of all models in one list.
_SOURCE_ATTRIBUTES: dict[int, tuple[list[list[_Noted]], list[_Noted]]] = {}
#: Of torch.nn's modules, how many are compared per check (in turn).
_TORCH_MODULES_A_CALL = 4
#: One call in this many compares (a tiny model's forward pays about 0.5 us, not 2).
_CALLS_A_CHECK = 4


class _Noted(NamedTuple):
    model: int
    module: weakref.ref
    path: str
    keys: tuple[str, ...]
    get: Callable[[Any], Any]  # the values from a module's __dict__ (operator.itemgetter)
    values: Any  # what ``get`` gave then


def _note_attributes(models: Sequence[nn.Module]) -> tuple[list[list[_Noted]], list[_Noted]]:
    own: list[list[_Noted]] = [[] for _ in models]
    torch_modules: list[_Noted] = []
    for i, model in enumerate(models):
        for path, module in model.named_modules():
            state = vars(module)
            keys = tuple(k for k, v in state.items()
                         if not k.startswith("_") and k != "training" and _plain(v))
            if keys:
                get = operator.itemgetter(*keys)
                noted = _Noted(i, weakref.ref(module), path, keys, get, get(state))
                is_torch = type(module).__module__.startswith("torch.")
                (torch_modules if is_torch else own[i]).append(noted)
    return own, torch_modules


def check_source_attributes(fused: nn.Module) -> None:
    """Before a forward of ``fused``: a plain attribute of a model it was made from changed
    since (``for m in models: m.temperature = t``, a temperature the loop anneals) is the
    user's change meant for the fused module, which copied the models and runs each one's
    value as it was then.  A UsageWarning, once per module, naming the model and the
    attribute.  Every fourth call compares one model's own classes' modules (in turn: a
    change is seen within 4N calls) and a few of torch.nn's (``m.drop.p = 0.0``, later);
    attributes the models' forward itself changes (``self.calls += 1``) are not."""
    if torch.compiler.is_compiling():  # (first: what is read while traced becomes a guard)
        return
    state = fused.__dict__
    turn = state.get("_hftc_attribute_turn", 0) + 1
    state["_hftc_attribute_turn"] = turn
    noted = _SOURCE_ATTRIBUTES.get(id(fused)) if turn % _CALLS_A_CHECK == 0 else None
    if noted is None:
        return
    own, torch_modules = noted
    turn //= _CALLS_A_CHECK
    start = turn * _TORCH_MODULES_A_CALL % max(1, len(torch_modules))
    for entry in (*own[turn % len(own)],
                  *torch_modules[start:start + _TORCH_MODULES_A_CALL]):
        module = entry.module()
        try:
            if module is None or entry.get(module.__dict__) == entry.values:
                continue
        except KeyError:  # (an attribute deleted: as changed)
            pass
        if _warn_changed(fused, entry, module):
            return


def _warn_changed(fused: nn.Module, entry: _Noted, module: nn.Module) -> bool:
    """Warn of the first of ``entry``'s attributes that changed (not one forward changes
    itself, nor model of a place hftc.replace_models gave another model)."""
    ids = fused.__dict__.get("_model_ids") or range(fused.num_models)
    if entry.model not in ids:
        return False
    changed_by_forward = set((fused.__dict__.get("_python_state") or (0, ()))[1])
    values = entry.values if len(entry.keys) > 1 else (entry.values,)
    for key, value in zip(entry.keys, values):
        now = module.__dict__.get(key, _SOURCE_ATTRIBUTES)
        name = f"{entry.path}.{key}" if entry.path else key
        if now == value or name in changed_by_forward:
            continue
        _SOURCE_ATTRIBUTES.pop(id(fused), None)
        warnings.warn(
            f"model {entry.model} given to hftc.fuse has `{name}` = {now!r} now ({value!r} "
            f"when fused), but the fused module copied the models and runs each model's "
            f"`{name}` as it was then: a change to the models does not reach it. Keep a "
            f"value that changes between calls in a buffer (register_buffer), which the "
            f"fused module holds per model (fused.{name}.fill_(v)), or fuse the changed "
            f"models again.", UsageWarning, stacklevel=user_stacklevel())
        return True
    return False


# --------------------------------------------------------------------------- the models' weights

#: id(fused module) -> for each model hftc.fuse was given: (its parameters, weakly, with
#: their names, and their versions then); an entry leaves with its module.
_SOURCE_WEIGHTS: dict[int, list[tuple[list[tuple[str, weakref.ref]], list[int]]]] = {}


def note_source_weights(fused: nn.Module, models: Sequence[nn.Module]) -> None:
    """Note the versions of the parameters of the models ``fused`` is made from (an
    in-place write bumps one: ``w.zero_()``, ``nn.init``, ``load_state_dict``)."""
    noted = []
    for model in models:
        named = [(name, weakref.ref(p)) for name, p in model.named_parameters()]
        noted.append((named, [r()._version for _, r in named]))
    _SOURCE_WEIGHTS[id(fused)] = noted
    weakref.finalize(fused, _SOURCE_WEIGHTS.pop, id(fused), None)


def source_weights_written(fused: nn.Module) -> None:
    """The models ``fused`` was made from were written on purpose (the sweep gives each
    trial's own module its trained weights): their parameters' versions now are the ones
    :func:`check_source_weights` compares with."""
    for module in fused.modules():  # (fuse_groups: a fused module per group)
        for named, versions in _SOURCE_WEIGHTS.get(id(module), ()):
            versions[:] = [p._version if (p := ref()) is not None else v
                           for (_, ref), v in zip(named, versions)]


def check_source_weights(fused: nn.Module) -> None:
    """Before a forward of ``fused``: a parameter of a model it was made from written in
    place since (``models[1].load_state_dict(ckpt)``, ``nn.init.zeros_(models[0].fc.weight)``,
    a stock optimizer stepping ``models[i]``) is a change meant for the fused module, which
    copied the weights and runs the ones of the fusing.  A UsageWarning, once per module,
    naming the model and the parameter.  The first call reads every model's versions (the
    checkpoints loaded into the models between fusing and a first evaluation), then every
    fourth call one model's (in turn: a change is seen within 4N calls); models
    replace_models replaced are not."""
    if torch.compiler.is_compiling():
        return
    state = fused.__dict__
    turn = state.get("_hftc_weights_turn", 0) + 1
    state["_hftc_weights_turn"] = turn
    noted = _SOURCE_WEIGHTS.get(id(fused)) if turn % _CALLS_A_CHECK == 0 or turn == 1 else None
    if not noted:
        return
    ids = state.get("_model_ids") or range(len(noted))
    read = range(len(noted)) if turn == 1 else [turn // _CALLS_A_CHECK % len(noted)]
    changed, model = next(((name, model) for model in read if model in ids
                           for (name, ref), version in zip(*noted[model])
                           if (p := ref()) is not None and p._version != version),
                          (None, None))
    if changed is None:
        return
    _SOURCE_WEIGHTS.pop(id(fused), None)
    warnings.warn(
        f"model {model} given to hftc.fuse had its parameter `{changed}` written in place "
        f"since it was fused, but the fused module copied the weights and runs model "
        f"{model}'s `{changed}` as it was then: a change to the models does not reach it. "
        f"Change the fused module's copy (with torch.no_grad(): "
        f"fused.get_parameter({changed!r})[{list(ids).index(model)}].copy_(w); "
        f"fused.load_state_dict for all N), give it the changed model "
        f"(hftc.replace_models(fused, {{{list(ids).index(model)}: model}})), or change the "
        f"models before fusing", UsageWarning, stacklevel=user_stacklevel())


# --------------------------------------------------------------------------- class attributes

#: The key of a fused module's ``__dict__`` that holds what :func:`note_class_attributes` noted.
_CLASS_NOTED = "_hftc_class_attributes"


def note_class_attributes(fused: nn.Module, models: Sequence[nn.Module]) -> None:
    """Note the plain class attributes of the models' own classes (``class Net: GAIN =
    1.0``; not torch's) and the plain module globals their forward reads (``x /
    TEMPERATURE``) as they are when fused: :func:`check_class_attributes` compares them
    before each forward."""
    noted, seen = [], set()
    for model in models:
        for module in model.modules():
            for klass in type(module).__mro__:
                if klass in seen or klass.__module__.startswith(("torch.", "hftc.", "builtins")):
                    continue
                seen.add(klass)
                noted += [(f"the class attribute {klass.__name__}.{key}",
                           f"{klass.__name__}.{key}", vars(klass), key, value)
                          for key, value in vars(klass).items()
                          if not key.startswith("_") and _plain(value)]
                noted += _globals_read(klass)
    fused.__dict__[_CLASS_NOTED] = (noted, tuple(value for *_, value in noted))


def _globals_read(klass: type) -> list[tuple[str, str, Any, str, Any]]:
    """The plain module globals that ``klass``'s forward and its other methods read (not
    ``__init__`` and the ones that initialise: a global read once, when built)."""
    found = []
    for name, function in vars(klass).items():
        code = getattr(function, "__code__", None)
        if code is None or name.startswith("__") or "init" in name or "reset" in name:
            continue
        scope = function.__globals__
        codes, names = [code], set()
        while codes:
            c = codes.pop()
            names.update(c.co_names)
            codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        found += [(f"the global {scope.get('__name__', '?')}.{key}", key, scope, key, scope[key])
                  for key in sorted(names) if key in scope and _plain(scope[key])
                  and not key.startswith("__")]
    return found


def check_class_attributes(fused: nn.Module) -> None:
    """Before a forward of ``fused``: a class attribute of the models' classes or a module
    global their forward reads, changed since fusing (``Net.GAIN = 2.0``, ``TEMPERATURE =
    2.0``), warns, once (a UsageWarning: a change forward does not read, an instance
    counter, is no mistake).  The fused program holds the value it
    was traced with, while the models one by one and ``unfuse()`` (instances of the same
    class) read the new one: the answer would depend on how the models run.  One tuple
    compared."""
    if torch.compiler.is_compiling():  # (first: what is read while traced becomes a guard)
        return
    noted, values = fused.__dict__.get(_CLASS_NOTED, ((), ()))
    if not noted or tuple([scope.get(key, _CLASS_NOTED)
                           for _, _, scope, key, _ in noted]) == values:
        return
    for what, spelling, scope, key, value in noted:
        now = scope.get(key, _CLASS_NOTED)
        if now is value or (type(now) is type(value) and now == value):
            continue
        del fused.__dict__[_CLASS_NOTED]
        now_text = "deleted" if now is _CLASS_NOTED else f"set to {now!r}"
        warnings.warn(
            f"{what} was {now_text} "
            f"after fusing (it was {value!r}): the fused program was traced with "
            f"{value!r}, while the models one by one and unfuse() read the value now, so "
            f"the answer depends on how the models run. Where forward reads it, set it "
            f"back ({spelling} = {value!r}) or fuse the models again after changing it "
            f"(hftc.fuse(fused.unfuse())); a value that changes between calls belongs in a "
            f"buffer (register_buffer), which the fused module holds per model.",
            UsageWarning, stacklevel=user_stacklevel())
        return


# --------------------------------------------------------------------------- the tree's copies

#: The key of a fused module's ``__dict__`` that holds what :func:`note_copied_modules` noted.
_COPIED = "_hftc_copied_modules"


def note_copied_modules(fused: nn.Module) -> None:
    """Note the plain attributes of the fused tree's copies of model 0's tensor-less
    modules (``fused.drop``: an ``nn.Dropout``, ``fused.act``: an ``nn.LeakyReLU``) as they
    are when fused: :func:`check_copied_modules` compares them before each forward."""
    noted = []
    for path, module in fused.named_modules():
        if path and not isinstance(module, StackedModule):
            noted += [(path, module, key, value) for key, value in vars(module).items()
                      if not key.startswith("_") and key != "training" and _plain(value)]
    # (one tuple compared per call: equal element by element by identity, where unchanged)
    fused.__dict__[_COPIED] = (noted, tuple(value for *_, value in noted))


def _plain(value: Any) -> bool:
    """A value ``==`` compares as it is (a number, a string, a tuple of them)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, float, str, torch.dtype)


def check_copied_modules(fused: nn.Module) -> None:
    """Before a forward of ``fused``: a plain attribute of a copied tensor-less module
    changed since fusing (``for m in fused.modules(): m.p = 0.0`` to turn dropout off) is
    refused.  The fused program calls such a copy for every model where the models'
    modules are equal (a change reached all N there, and nothing else: the models one by
    one and ``unfuse()`` run each model's own), and reads each model's own value where
    they differ (the change reached none): either way not what was meant.  An identity
    test per attribute, where nothing changed."""
    if torch.compiler.is_compiling():  # (first: what is read while traced becomes a guard)
        return
    noted, values = fused.__dict__.get(_COPIED, ((), ()))
    if not noted or tuple(
            [module.__dict__.get(key, _COPIED) for _, module, key, _ in noted]) == values:
        return
    for path, module, key, value in noted:
        now = module.__dict__.get(key, _COPIED)
        if now is value or (type(now) is type(value) and now == value):
            continue
        fix = (" (fused.eval() turns dropout off for every model)"
               if isinstance(module, nn.modules.dropout._DropoutNd) else "")
        raise FusionArgumentError(
            f"fused.{path}.{key} was set to {now!r} after fusing (it was {value!r}): "
            f"fused.{path} is model 0's {type(module).__name__}, copied when fused; the "
            f"models one by one and unfuse() run each model's own `{key}` as it was then, "
            f"and the fused program reads this copy's only where the models' are equal, "
            f"so the change would not be each model's{fix}. Set it back "
            f"(fused.{path}.{key} = {value!r}), or set it on each model "
            f"(models = fused.unfuse()) and fuse them again")


#: What a pickle or a copy of a fused module leaves out (:func:`note_class_attributes`
#: holds the classes' and modules' own dicts): noted again when it is loaded.
NOT_PICKLED = (_CLASS_NOTED,)


__all__ = ["KEPT_COPIES", "NOT_PICKLED", "OUTPUT_MARK", "UNFUSED_COPIES", "UnfusedCopy",
           "check_class_attributes", "check_copied_modules", "check_source_attributes",
           "check_source_modes", "check_source_weights", "fused_output_models",
           "mark_outputs", "note_class_attributes", "note_copied_modules", "note_copy",
           "note_source_weights", "note_sources", "stale_source"]
