"""Functions a model keeps in its attributes, and the copies hftc makes of the model.

minGPT's ``Block`` keeps its MLP as a closure over its own modules::

    m = self.mlp
    self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

``copy.deepcopy`` treats a function as a constant: a copy of the block keeps the
original's ``mlpf``, which still calls the *original's* layers.  hftc builds copies of
each model (:mod:`hftc.module.copies`: the first-call check's references, the models run one by
one, ``unfuse()``), so every such copy ran the original's MLP weights.  Two remedies:

* :func:`rebind_functions` (after ``copy.deepcopy(module, memo)``): every function the
  copy's modules hold is rebuilt, same code and globals, with its closure cells and
  defaults mapped through the deepcopy memo (the original's ``mlp`` -> the copy's)::

      original.mlpf: <lambda>   closure m -> original.mlp
      copy.mlpf:     <lambda>'  closure m -> copy.mlp

* :func:`check_function_references` (at fuse time): what a copy cannot be made to hold
  is refused: a function of model i that reaches another model's module or tensor
  (models made with ``copy.deepcopy`` of one another), or a module or tensor that is
  none of model i's own and not the object model 0 holds there.  A plain value (a
  dropout ``p`` in a closure) is each copy's own: the copy is of model i's function.

Both follow functions, bound methods, ``functools.partial``, lists, tuples and dicts,
and the plain objects a function holds (``ns = SimpleNamespace(fc=self.fc)`` in a
closure: the copy's function gets a shallow copy of ``ns`` holding the copy's ``fc``).
"""

from __future__ import annotations

import copy
import functools
import types
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import FusionArgumentError

#: A module's registries: only modules and tensors, which ``copy.deepcopy`` copies.
_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})
_MISSING = object()
#: What :meth:`_Rebinder.attribute` passes by as it is: values that hold nothing, and
#: these containers when empty (a module's hook dicts).
_PLAIN = frozenset({int, float, bool, str, bytes, type(None), torch.dtype, torch.device,
                    torch.Size})
_CONTAINERS = frozenset({list, dict, tuple, OrderedDict})


class _Rebinder:
    """Rebuilds functions so that what they hold maps through a deepcopy memo."""

    def __init__(self, memo: dict[int, Any]):
        self.memo = memo
        self.functions: dict[int, types.FunctionType] = {}
        self.cells: dict[int, types.CellType] = {}
        self.walked: set[int] = set()

    def attribute(self, value: Any) -> Any:
        """A value of the copy with the functions in it rebound; lists and dicts (the
        copy's own: deepcopy made them) are changed in place."""
        kind = type(value)
        if kind in _PLAIN or (kind in _CONTAINERS and not value):
            return value  # (most of a module's attributes: nothing in them to rebind)
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            return self.reference(value)
        if isinstance(value, (list, dict)) and id(value) not in self.walked:
            self.walked.add(id(value))
            for key, item in list(value.items() if isinstance(value, dict) else enumerate(value)):
                new = self.attribute(item)
                if new is not item:
                    value[key] = new
        elif isinstance(value, tuple):
            items = [self.attribute(item) for item in value]
            if any(new is not old for new, old in zip(items, value)):
                return _rebuilt_tuple(value, items)
        return value

    def reference(self, value: Any) -> Any:
        """What the copy holds where the original held ``value`` (never changes ``value``)."""
        copied = self.memo.get(id(value), _MISSING)
        if copied is not _MISSING:
            return copied
        if isinstance(value, types.FunctionType):
            return self.function(value)
        if isinstance(value, types.MethodType):
            func, owner = self.reference(value.__func__), self.reference(value.__self__)
            if func is value.__func__ and owner is value.__self__:
                return value
            return types.MethodType(func, owner)
        if type(value) is functools.partial:
            func = self.reference(value.func)
            args = [self.reference(a) for a in value.args]
            keywords = {k: self.reference(v) for k, v in value.keywords.items()}
            if func is value.func and all(a is b for a, b in zip(args, value.args)) and all(
                    keywords[k] is v for k, v in value.keywords.items()):
                return value
            return functools.partial(func, *args, **keywords)
        if isinstance(value, (list, tuple)):
            items = [self.reference(item) for item in value]
            if all(new is old for new, old in zip(items, value)):
                return value
            return type(value)(items) if isinstance(value, list) else \
                _rebuilt_tuple(value, items)
        if isinstance(value, dict) and type(value) is dict:
            items = {k: self.reference(v) for k, v in value.items()}
            return value if all(items[k] is v for k, v in value.items()) else items
        if _plain_object(value) and self.holds_copied(value, set()):
            return self.plain_object(value)
        return value

    def plain_object(self, value: Any) -> Any:
        """A shallow copy of an object a function holds (``ns = SimpleNamespace(fc=self.fc);
        self.f = lambda x: ns.fc(x)``), its attributes mapped: deepcopy left it shared with
        the original, whose modules the copy's function then called."""
        if id(value) in self.functions:
            return self.functions[id(value)]
        new = copy.copy(value)
        self.functions[id(value)] = new  # before the attributes: an object may reach itself
        for name, item in vars(value).items():
            new.__dict__[name] = self.reference(item)
        return new

    def holds_copied(self, value: Any, seen: set[int]) -> bool:
        """Whether ``value`` reaches, through what :meth:`reference` maps, an object the
        deepcopy copied."""
        if id(value) in self.memo:
            return True
        if id(value) in seen:
            return False
        seen.add(id(value))
        if isinstance(value, types.FunctionType):
            contents = []
            for cell in value.__closure__ or ():
                try:
                    contents.append(cell.cell_contents)
                except ValueError:
                    pass
            contents += [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values(),
                         *value.__dict__.values()]
        elif isinstance(value, types.MethodType):
            contents = [value.__func__, value.__self__]
        elif type(value) is functools.partial:
            contents = [value.func, *value.args, *value.keywords.values()]
        elif isinstance(value, (list, tuple)):
            contents = list(value)
        elif type(value) is dict:
            contents = list(value.values())
        elif _plain_object(value):
            contents = list(vars(value).values())
        else:
            return False
        return any(self.holds_copied(v, seen) for v in contents)

    def function(self, fn: types.FunctionType) -> types.FunctionType:
        """``fn`` with the same code and globals, its closure cells (one new cell per cell:
        functions that share a variable share it still) and defaults mapped."""
        if id(fn) in self.functions:
            return self.functions[id(fn)]
        if not self.holds_copied(fn, set()):
            # Nothing of the model's in it: kept as it is (F.relu in nn.TransformerEncoderLayer's
            # ``activation`` must stay F.relu, which tracing and the rules know by identity).
            self.functions[id(fn)] = fn
            return fn
        fresh = []
        closure = None
        if fn.__closure__:
            closure = []
            for cell in fn.__closure__:
                if id(cell) not in self.cells:
                    self.cells[id(cell)] = types.CellType()
                    fresh.append(cell)
                closure.append(self.cells[id(cell)])
            closure = tuple(closure)
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, None, closure)
        self.functions[id(fn)] = new  # before the cells: a function may reach itself
        new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        new.__dict__.update({k: self.reference(v) for k, v in fn.__dict__.items()})
        if fn.__defaults__:
            new.__defaults__ = tuple(self.reference(v) for v in fn.__defaults__)
        if fn.__kwdefaults__:
            new.__kwdefaults__ = {k: self.reference(v) for k, v in fn.__kwdefaults__.items()}
        for cell in fresh:
            try:
                contents = cell.cell_contents
            except ValueError:  # a variable not assigned yet
                continue
            self.cells[id(cell)].cell_contents = self.reference(contents)
        return new


def _plain_object(value: Any) -> bool:
    """An instance of a user's class (or a ``SimpleNamespace``) with attributes of its own:
    what a function's closure may hold modules in. Not modules, tensors, classes, Python
    modules or functions, which have their own handling (or none to do)."""
    return hasattr(value, "__dict__") and not isinstance(value, (
        nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
        functools.partial)) and isinstance(vars(value), dict)


def _rebuilt_tuple(original: tuple, items: list) -> tuple:
    return type(original)(*items) if hasattr(original, "_fields") else type(original)(items)


def rebind_functions(copied: nn.Module, memo: dict[int, Any]) -> None:
    """After ``copied = copy.deepcopy(module, memo)``: the functions the copy's modules
    hold (in attributes, lists, dicts, tuples, ``functools.partial`` and bound methods)
    rebuilt to hold the copy's modules and tensors where they held the original's
    (see the module docstring)."""
    rebinder = _Rebinder(memo)
    for sub in copied.modules():
        for name, value in list(vars(sub).items()):
            kind = type(value)
            if name in _REGISTRIES or kind in _PLAIN or (kind in _CONTAINERS and not value):
                continue  # (as attribute() passes them by, without the call)
            new = rebinder.attribute(value)
            if new is not value:
                sub.__dict__[name] = new


def _function_references(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(where, value)`` for each module, tensor and plain value (number, string, None)
    that a function held in ``model``'s module attributes reaches through its closure,
    defaults, bound ``self`` or ``functools.partial`` arguments;
    ``where`` is like ``transformer.h.0.mlpf (closure variable `m`)``."""
    seen: set[int] = set()

    def walk(value: Any, where: str, inside: bool) -> Iterator[tuple[str, Any]]:
        if isinstance(value, (nn.Module, torch.Tensor)):
            if inside:
                yield where, value
            return
        plain = inside and _plain_object(value)
        if plain or isinstance(value, (types.FunctionType, list, tuple, dict, functools.partial)):
            if id(value) in seen:
                return
            seen.add(id(value))
        if plain:  # (a namespace object in a closure: its modules and tensors, rebound too)
            for name, item in vars(value).items():
                if isinstance(item, (nn.Module, torch.Tensor, types.FunctionType)) or \
                        _plain_object(item):
                    yield from walk(item, f"{where}.{name}", True)
            return
        if isinstance(value, types.FunctionType):
            code = value.__code__
            for var, cell in zip(code.co_freevars, value.__closure__ or ()):
                try:
                    contents = cell.cell_contents
                except ValueError:
                    continue
                yield from walk(contents, f"{where} (closure variable `{var}`)", True)
            defaults = value.__defaults__ or ()
            names = code.co_varnames[code.co_argcount - len(defaults):code.co_argcount]
            for var, default in zip(names, defaults):
                yield from walk(default, f"{where} (default of `{var}`)", True)
            for var, default in (value.__kwdefaults__ or {}).items():
                yield from walk(default, f"{where} (default of `{var}`)", True)
        elif isinstance(value, types.MethodType):
            yield from walk(value.__self__, f"{where}.__self__", True)
            yield from walk(value.__func__, where, inside)
        elif isinstance(value, functools.partial):
            yield from walk(value.func, where, True)
            for k, arg in enumerate(value.args):
                yield from walk(arg, f"{where} (partial argument {k})", True)
            for k, arg in value.keywords.items():
                yield from walk(arg, f"{where} (partial argument `{k}`)", True)
        elif isinstance(value, (list, tuple)):
            for k, item in enumerate(value):
                yield from walk(item, f"{where}[{k}]", inside)
        elif isinstance(value, dict):
            for k, item in value.items():
                yield from walk(item, f"{where}[{k!r}]", inside)
        elif inside and isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
            yield where, value

    for path, sub in model.named_modules():
        for name, value in vars(sub).items():
            if name not in _REGISTRIES:
                yield from walk(value, f"{path}.{name}" if path else name, False)


def _owners(models: list[nn.Module]) -> tuple[dict[int, set[int]], dict[int, str]]:
    """Which models each module and tensor belongs to (its submodules, parameters,
    buffers and tensor attributes), and its first name (``model 0's `fc.weight```)."""
    owners: dict[int, set[int]] = {}
    names: dict[int, str] = {}

    def own(value: Any, index: int, name: str) -> None:
        owners.setdefault(id(value), set()).add(index)
        names.setdefault(id(value), f"model {index}'s `{name}`")

    for index, model in enumerate(models):
        for path, sub in model.named_modules(remove_duplicate=False):
            own(sub, index, path or "<root>")
            prefix = f"{path}." if path else ""
            for registry in (sub._parameters, sub._buffers):
                for name, t in registry.items():
                    if t is not None:
                        own(t, index, prefix + name)
            for name, value in vars(sub).items():
                if isinstance(value, torch.Tensor):
                    own(value, index, prefix + name)
    return owners, names


_WHY = ("hftc builds copies of each model (to check the fused program, to run the models "
        "one by one, for unfuse()), and a function a model keeps (minGPT's `self.mlpf = "
        "lambda x: m.c_proj(m.c_fc(x))`) is rebuilt in each copy to hold that copy's "
        "modules and tensors")


def check_function_references(models: list[nn.Module]) -> None:
    """Refuse the functions a copy of model 0 could not hold rightly for model i (see the
    module docstring): raises :class:`FusionArgumentError` (another model's module or
    tensor, or one of model i's own that is none of its registered state), naming the
    model, the attribute and closure variable, and what to change."""
    owners, names = _owners(models)
    at_model0: dict[str, Any] = {}
    for index, model in enumerate(models):
        for where, value in _function_references(model):
            if index == 0:
                at_model0.setdefault(where, value)
            if isinstance(value, (nn.Module, torch.Tensor)):
                what = "tensor" if isinstance(value, torch.Tensor) else \
                    f"module ({type(value).__name__})"
                holders = owners.get(id(value))
                if holders is not None and index not in holders:
                    raise FusionArgumentError(
                        f"model {index}'s `{where}` holds a {what} that is not model "
                        f"{index}'s own: it is {names[id(value)]}, so model {index} would run "
                        f"that model's weights. copy.deepcopy of a model keeps its functions, "
                        f"which still call the original's modules: build each model with its "
                        f"constructor (and load_state_dict to start from the same weights), "
                        f"not by copying another model")
                if holders is None and index > 0 and at_model0.get(where) is not value:
                    raise FusionArgumentError(
                        f"model {index}'s `{where}` holds a {what} that is none of model "
                        f"{index}'s submodules, parameters, buffers or tensor attributes, and "
                        f"not the one model 0 holds there; {_WHY}, which it cannot do for "
                        f"this one. Make it part of the model (a submodule: self.name = "
                        f"module; a tensor: self.register_buffer(name, tensor)) and use it "
                        f"from there. (A model made with copy.deepcopy keeps the original's "
                        f"functions, which call the original's modules: build each model "
                        f"with its constructor.)")


__all__ = ["check_function_references", "rebind_functions"]
