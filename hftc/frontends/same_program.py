"""Whether ``torch.export`` of one model is the program of another: the export front-end
exports one model of each group this module proves alike, not all N.

A non-strict export runs forward in Python on fake tensors.  What it records can depend on

- the code: every submodule's class (its ``forward``) and anything forward reads from
  the instance (plain attributes, hooks, a ``forward`` set on the instance);
- the parameters' and buffers' metadata (names, tying, shape, dtype, device, strides,
  ``requires_grad``, Python attributes set on them);
- tensors that are plain attributes (``self.scale = torch.tensor(3.0)``): export
  treats them as constants and bakes their values in (``x * self.scale.item()`` is
  recorded as ``x * 3.0``);
- the example inputs, which are the same for every model (or slices of one stack);
- the values of parameters and buffers only through data-dependent ops (``.item()``,
  ``.tolist()``, boolean masks), which leave ``aten.item`` / unbacked symbols in the
  exported graph: the export front-end exports every model itself when model 0's
  program has them (:func:`reads_tensor_values`).

:func:`program_difference` compares the first three, recursively and exactly (floats by
their bits, tensors by ``torch.equal``, objects it cannot see into by identity): two
models it finds no difference between trace to the same graph, with their own
parameters and buffers.  Where it cannot prove that, it names the difference and each
model is exported itself (slower, never wrong)::

    program_difference(T5(), T5())                -> None (export one, reuse it)
    program_difference(Net(p=0.1), Net(p=0.2))   -> "module `drop`: attribute `p` ..."
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

#: Values compared with ``==`` (after an exact type check): no state beyond their value.
_VALUE_TYPES = (bool, int, complex, str, bytes, type(None), range, slice, type(Ellipsis),
                torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)

#: The exact types among those whose objects carry no ``__dict__``: ``==`` says it all.
_EXACT_VALUES = frozenset({bool, int, str, bytes, type(None)})

#: ``nn.Module.__dict__`` entries compared structurally, not as attributes.
_REGISTRIES = ("_parameters", "_buffers", "_modules")

_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def program_difference(model0: nn.Module, model: nn.Module) -> str | None:
    """``None`` when exporting ``model`` records the program exporting ``model0`` did
    (read at ``model``'s own parameters and buffers), else what differs, in words."""
    modules0 = list(model0.named_modules(remove_duplicate=False))
    modules = list(model.named_modules(remove_duplicate=False))
    if [(p, type(m)) for p, m in modules0] != [(p, type(m)) for p, m in modules]:
        return "the module trees differ (submodule paths or classes)"
    if _tying(modules0) != _tying(modules):
        return "the modules are shared between paths differently"
    try:
        return _state_difference(model0, model, modules0, modules)
    except RecursionError:  # an attribute nested deeper than Python compares
        return "an attribute is nested too deeply to compare"


def number_differences(model0: nn.Module, model: nn.Module) -> list[tuple[str, str]] | None:
    """The (module path, attribute) of the float attributes whose values differ, when
    nothing else :func:`program_difference` compares does; None when something else
    differs, or nothing::

        number_differences(MLP(p=0.1), MLP(p=0.2))     -> [("drop", "p")]
        number_differences(MLP(p=0.1), MLP(p=0.1))     -> None (alike)
    """
    modules0 = list(model0.named_modules(remove_duplicate=False))
    modules = list(model.named_modules(remove_duplicate=False))
    if ([(p, type(m)) for p, m in modules0] != [(p, type(m)) for p, m in modules]
            or _tying(modules0) != _tying(modules)):
        return None
    compare = _Comparison(model0, model)
    numbers = [(path, key) for (path, sub0), (_, sub) in zip(modules0, modules)
               for key, value in vars(sub0).items()
               if type(value) is float and type(vars(sub).get(key)) is float
               and not compare.same(value, vars(sub)[key])]
    if not numbers:
        return None
    try:
        if _state_difference(model0, model, modules0, modules, set(numbers)) is not None:
            return None
    except RecursionError:
        return None
    return numbers


def _state_difference(model0: nn.Module, model: nn.Module,
                      modules0: list[tuple[str, nn.Module]],
                      modules: list[tuple[str, nn.Module]],
                      ignored: set[tuple[str, str]] = frozenset()) -> str | None:
    compare = _Comparison(model0, model)
    for (path, sub0), (_, sub) in zip(modules0, modules):
        where = f"module `{path or '<root>'}`"
        for registry in ("_parameters", "_buffers"):
            tensors0, tensors = vars(sub0)[registry], vars(sub)[registry]
            if list(tensors0) != list(tensors):
                return f"{where}: the {registry[1:]} differ in names"
            for name, t0 in tensors0.items():
                if not _same_metadata(t0, tensors[name]):
                    return f"{where}: `{name}` differs in shape, dtype, device or strides"
                if t0 is not None and not compare.same(vars(t0), vars(tensors[name])):
                    return f"{where}: `{name}` has Python attributes that differ"
        state0, state = vars(sub0), vars(sub)
        if state0.keys() != state.keys():
            return f"{where}: the attributes differ ({sorted(state0.keys() ^ state.keys())})"
        for key, value0 in state0.items():
            if key not in _REGISTRIES and (path, key) not in ignored and not compare.same(
                    value0, state[key]):
                return f"{where}: attribute `{key}` differs"
    if _tensor_tying(model0) != _tensor_tying(model):
        return "parameters or buffers are tied differently"
    return None


def attribute_differences(model0: nn.Module, model: nn.Module, limit: int = 3) -> list[str]:
    """The attribute paths where ``model``'s Python state differs from ``model0``'s, with
    both values where they are plain, for a refusal to name (at most ``limit``)::

        attribute_differences(Bert(use_cache=True), Bert(use_cache=False))
            -> ["`config.use_cache` (False vs True)"]
        attribute_differences(Net({"heads": 2}), Net({"heads": 4}))
            -> ["`cfg['heads']` (4 vs 2)"]

    Empty where the module trees differ (the refusal names those) or nothing differs."""
    modules0 = list(model0.named_modules(remove_duplicate=False))
    modules = list(model.named_modules(remove_duplicate=False))
    if [(p, type(m)) for p, m in modules0] != [(p, type(m)) for p, m in modules]:
        return []
    try:
        return _attribute_differences(modules0, modules, _Comparison(model0, model), limit)
    except RecursionError:  # an attribute nested deeper than Python compares
        return []


def _attribute_differences(modules0: list[tuple[str, nn.Module]],
                           modules: list[tuple[str, nn.Module]], compare: _Comparison,
                           limit: int) -> list[str]:
    """:func:`attribute_differences` over the two module trees (alike in paths and classes)."""
    found: list[str] = []
    for (path, sub0), (_, sub) in zip(modules0, modules):
        if type(sub).__module__.startswith("torch."):
            continue  # (torch's modules: the refusal names their hyper-parameters already)
        state0, state = vars(sub0), vars(sub)
        for key in [k for k in state if k not in _REGISTRIES]:
            where = f"{path}.{key}" if path else key
            if key not in state0:
                found.append(f"`{where}` (model 0 has none)")
            else:
                _differing_leaves(compare, state[key], state0[key], where, found, depth=0)
            if len(found) >= limit:
                return found[:limit]
        found += [f"`{path}.{k}` (only model 0 has one)" if path else f"`{k}` (only model 0 "
                  f"has one)" for k in state0 if k not in state]
    return found[:limit]


def _differing_leaves(compare: _Comparison, value: Any, value0: Any, where: str,
                      found: list[str], depth: int) -> None:
    """Append to ``found`` the paths below ``where`` at which ``value`` and ``value0`` differ:
    into dicts, lists and tuples, and objects' attributes (a dataclass, a namespace, a
    transformers config), down to the values that differ."""
    if compare.same(value, value0):
        return
    before = len(found)
    if isinstance(value, functools.partial) and isinstance(value0, functools.partial) \
            and compare.same(value.func, value0.func) and compare.same(value.args, value0.args):
        value, value0, where = value.keywords, value0.keywords, f"{where}.keywords"
    if depth < 8 and type(value) is type(value0) and not isinstance(
            value, (nn.Module, torch.Tensor, str, bytes, enum.Enum)):
        if isinstance(value, dict):
            if list(value) == list(value0):
                for k in value:
                    _differing_leaves(compare, value[k], value0[k], f"{where}[{k!r}]", found,
                                      depth + 1)
                if len(found) > before:
                    return
        elif isinstance(value, (list, tuple)) and len(value) == len(value0):
            for k, (v, v0) in enumerate(zip(value, value0)):
                _differing_leaves(compare, v, v0, f"{where}[{k}]", found, depth + 1)
            if len(found) > before:
                return
        elif hasattr(value, "__dict__") and not callable(value) and vars(value).keys() == \
                vars(value0).keys():
            for k in vars(value):
                _differing_leaves(compare, vars(value)[k], vars(value0)[k], f"{where}.{k}",
                                  found, depth + 1)
            if len(found) > before:
                return
    plain = (float, enum.Enum) + _PRINTED_TYPES
    both = (f" ({value!r} vs {value0!r})" if isinstance(value, plain) and isinstance(
        value0, plain) and len(repr(value)) + len(repr(value0)) < 80 else "")
    found.append(f"`{where}`{both}")


#: How many distinct programs :func:`alike_models` compares a model with: past that many,
#: a model alike none of them is its own (traced itself), so grouping N models that all
#: differ (a sweep over dropout p) costs O(N), not O(N**2) comparisons.
ALIKE_CANDIDATES = 16


def alike_models(models: Sequence[nn.Module]) -> list[int]:
    """For each model, the first model :func:`program_difference` proves it alike (itself
    where none is)::

        models   Net Net Net(p=0.2) Net Net(p=0.2)
        alike    0   0   2          0   2

    A model is compared only with the models of its :func:`fingerprint`: N models that
    all differ in a number (a sweep over dropout p) cost N fingerprints, no comparison.
    """
    alike: list[int] = []
    candidates: dict[tuple, list[int]] = {}
    for i, model in enumerate(models):
        same_print = candidates.setdefault(fingerprint(model), [])
        first = next((j for j in same_print if program_difference(models[j], model) is None), i)
        if first == i and len(same_print) < ALIKE_CANDIDATES:
            same_print.append(i)
        alike.append(first)
    return alike


#: The plain values a fingerprint holds: hashable, and equal whenever ``_Comparison``
#: finds them the same (floats go in by their bits, every NaN alike).
_PRINTED_TYPES = (bool, int, str, bytes, type(None), torch.dtype, torch.device)


def fingerprint(model: nn.Module) -> tuple:
    """What :func:`program_difference` compares that a hash can hold: the module tree
    (paths, classes) and each module's attribute names and plain values (numbers,
    strings, dtypes). Models with different fingerprints differ; equal ones may still
    differ elsewhere (a dict, a tensor), which only :func:`program_difference` sees::

        fingerprint(Net(p=0.1)) != fingerprint(Net(p=0.2))    # differ: no comparison
    """
    printed: list[Any] = []
    for path, module in model.named_modules(remove_duplicate=False):
        state = vars(module)
        printed.append((path, type(module), tuple(sorted(state))))
        for key, value in state.items():
            kind = type(value)
            if kind is float:
                printed.append((key, "nan" if math.isnan(value) else value.hex()))
            elif kind in _PRINTED_TYPES:
                printed.append((key, kind, value))
    return tuple(printed)


def reads_tensor_values(program: torch.export.ExportedProgram) -> bool:
    """Whether the exported graph read tensor values on the host: ``.item()``, ``.tolist()``,
    a size that depends on values (``x[mask]``), all of which leave unbacked symbols."""
    for node in program.graph.nodes:
        if node.meta.get("unbacked_bindings"):
            return True
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.name() in (
                "aten::item", "aten::_local_scalar_dense"):
            return True
    return False


def _tying(modules: list[tuple[str, nn.Module]]) -> list[str]:
    """For each path, the first path of the same module object."""
    first: dict[int, str] = {}
    return [first.setdefault(id(m), p) for p, m in modules]


def _tensor_tying(model: nn.Module) -> list[tuple[str, str]]:
    """Each parameter's and buffer's name, with the first name of the same tensor object."""
    first: dict[int, str] = {}
    return [(name, first.setdefault(id(t), name)) for name, t in _named_tensors(model)]


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _same_metadata(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device and a.requires_grad == b.requires_grad
            and a.layout == b.layout and (a.layout != torch.strided or a.stride() == b.stride()))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``0.0`` and ``-0.0`` differ, a NaN equals itself); a tensor
    without values (on the meta device) is never proven equal."""
    if a.layout != torch.strided or a.is_quantized or a.is_meta or b.is_meta:
        return False
    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).contiguous().view(torch.uint8)
    return bool(torch.equal(as_bytes(a), as_bytes(b)))


class _Comparison:
    """Exact, recursive equality of what two models' forward can read, where a model's
    own submodules, parameters and buffers correspond by path (their contents are compared
    by :func:`program_difference`, their values not at all)."""

    def __init__(self, model0: nn.Module, model: nn.Module):
        self.module_paths0 = {id(m): p for p, m in model0.named_modules(remove_duplicate=False)}
        self.module_paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.tensor_names0: dict[int, str] = {}
        self.tensor_names: dict[int, str] = {}
        for names, root in ((self.tensor_names0, model0), (self.tensor_names, model)):
            for name, t in _named_tensors(root):
                names.setdefault(id(t), name)
        self._assumed: set[tuple[int, int]] = set()  # pairs being compared (cycles)

    def same(self, a: Any, b: Any) -> bool:
        if a is b:
            return True
        kind = type(a)
        if kind is not type(b):
            return False
        if kind in _EXACT_VALUES:  # (no attributes besides the value: compared as below)
            return bool(a == b)
        if (kind is dict or kind is list) and not a and not b:
            return True  # (a module's empty hook dicts, a dozen each: nothing to compare)
        if kind is OrderedDict and not a and not b and not vars(a) and not vars(b):
            return True
        if isinstance(a, nn.Module) and (id(a) in self.module_paths0 or id(b) in self.module_paths):
            return self.module_paths0.get(id(a)) == self.module_paths.get(id(b))
        if isinstance(a, torch.Tensor):
            if id(a) in self.tensor_names0 or id(b) in self.tensor_names:
                return self.tensor_names0.get(id(a)) == self.tensor_names.get(id(b))
            # a constant to export: its value may be baked into the program
            return _same_metadata(a, b) and _same_bytes(a, b)
        if isinstance(a, float):
            return (math.isnan(a) and math.isnan(b) or (a == b and math.copysign(1, a) ==
                                                        math.copysign(1, b))) \
                and self._same_attributes(a, b)
        if isinstance(a, _VALUE_TYPES):
            return bool(a == b) and self._same_attributes(a, b)
        if isinstance(a, (enum.Enum, type, types.BuiltinFunctionType, types.ModuleType)):
            return False  # not the same object (checked above)
        key = (id(a), id(b))
        if key in self._assumed:
            return True
        self._assumed.add(key)
        try:
            return self._same_contents(a, b)
        finally:
            self._assumed.discard(key)

    def _same_attributes(self, a: Any, b: Any) -> bool:
        """The Python attributes an object of a builtin kind carries besides its value (a
        ``str`` or ``dict`` subclass's ``__dict__``, a function's ``f.gain = 0.5``)."""
        return not hasattr(a, "__dict__") or self.same(vars(a), vars(b))

    def _same_contents(self, a: Any, b: Any) -> bool:
        if isinstance(a, (tuple, list)):
            return len(a) == len(b) and all(map(self.same, a, b)) and self._same_attributes(a, b)
        if isinstance(a, dict):
            # (a defaultdict's factory gives what forward reads at a missing key)
            return (list(a) == list(b) and all(self.same(a[k], b[k]) for k in a)
                    and self.same(getattr(a, "default_factory", None),
                                  getattr(b, "default_factory", None))
                    and self._same_attributes(a, b))
        if isinstance(a, (set, frozenset)):
            return a == b and all(isinstance(v, _VALUE_TYPES + (float,)) for v in a) \
                and self._same_attributes(a, b)
        if isinstance(a, types.FunctionType):  # a lambda made per instance: same code and cells
            return (a.__code__ is b.__code__ and a.__globals__ is b.__globals__
                    and self.same(a.__defaults__, b.__defaults__)
                    and self.same(a.__kwdefaults__, b.__kwdefaults__)
                    and self.same(_cells(a), _cells(b)) and self._same_attributes(a, b))
        if isinstance(a, types.MethodType):
            return self.same(a.__func__, b.__func__) and self.same(a.__self__, b.__self__)
        if isinstance(a, functools.partial):
            return (self.same(a.func, b.func) and self.same(a.args, b.args)
                    and self.same(a.keywords, b.keywords) and self._same_attributes(a, b))
        if isinstance(a, weakref.ref):
            return self.same(a(), b())
        if type(a).__module__ == "numpy":
            import numpy as np
            return (getattr(a, "shape", None) == getattr(b, "shape", None)
                    and getattr(a, "dtype", None) == getattr(b, "dtype", None)
                    and bool(np.array_equal(a, b, equal_nan=True)))
        if not all(c is object or c.__flags__ & _HEAP_TYPE for c in type(a).__mro__):
            return False  # an object with state Python cannot see (a Generator, a lock)
        if dataclasses.is_dataclass(a) or hasattr(a, "__dict__") or _slots(type(a)):
            return (self.same(getattr(a, "__dict__", {}), getattr(b, "__dict__", {}))
                    and all(self.same(getattr(a, s, _MISSING), getattr(b, s, _MISSING))
                            for s in _slots(type(a))))
        return False


_MISSING = object()


def _cells(fn: types.FunctionType) -> list[Any]:
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # not yet assigned
            cells.append(_MISSING)
    return cells


def _slots(cls: type) -> list[str]:
    return [s for c in cls.__mro__ for s in getattr(c, "__slots__", ())
            if s not in ("__dict__", "__weakref__")]
