"""What a sweep's trials were trained with, recorded in its study, so that a worker that
joins the study later (``--resume`` after an edit of the spec, a second machine, a rerun
with ``--trials`` to extend it) with another spec is refused instead of mixing the two.

The record is the study's user attribute ``hftc_spec``: one string per field that
changes what a trial trains or reports, a digest of each function of the spec, and the
simple module constants those functions read::

    {"epochs": "6", "batch_size": "16", "dtype": "torch.float64", ...,
     "space": "3f2a...", "model": "9c01...", ..., "constants": {"SLOW": "0.3"}}

A function's digest is of its compiled code (bytecode, constants, names; not its line
numbers or comments), its simple default values, and, by the names it reads, the
functions and classes of its own module it uses (``model`` building the spec's
``class CNN``): an edited comment or a moved line changes nothing, an edited range in
``space`` or layer in ``CNN`` does, and is refused. A module constant whose assignment
was edited (``HIDDEN = 8`` -> ``12``) is refused too; one whose line is the same and gives
another value (``SLOW = float(os.environ.get(...))``, a data path) is said in a
``SweepWarning``.
``n_trials``, ``per_array``, ``device``, ``eval_batch_size`` and the padding are left
out (a sweep may be extended, or run with other arrays on another machine), and so is
``on_epoch`` (logging).

The sampler and the pruner are recorded too, by what they are: the Optuna class and its
constructor's arguments as the object holds them (``MedianPruner(n_startup_trials=4,
n_warmup_steps=2, ...)``; not a sampler's seed, which the sweep reseeds per trial): they
choose the trials to come and which stop, so a resume with another ``--pruner`` or
``--sampler`` would make one study of two searches. A class of the user's own (a pruner
defined in the spec) is recorded by its code as well. An argument Optuna resolves on first
use (``max_resource="auto"``, a ``None`` default) is compared only where both are set:
a spec object run again in one process is no edit."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

import optuna

from ..errors import SweepError
from .spec import SweepSpec, hook_name
from .storage import make_pruner, make_sampler

__all__ = ["spec_fingerprint", "check_same_spec", "ATTR"]

ATTR = "hftc_spec"
#: the record's key of the digests of the constants' assignments (_Digest.sources)
_SOURCES = "constant_sources"
# (not device, eval_batch_size, pad_widths / max_padding: where and in which arrays the
# trials run, not what one trains; a worker on another machine or after an out-of-memory
# error may change them)
_VALUES = ("epochs", "batch_size", "seed", "dtype", "direction")
_FUNCTIONS = ("space", "model", "data", "optimizer", "loss", "train_step", "scheduler", "metric")
_LIBRARIES = ("torch", "optuna", "hftc", "numpy", "sklearn")
# the search: which trials come, which stop (described by the objects made of them)
_CHOOSERS = {"sampler": lambda spec: make_sampler(spec, spec.seed), "pruner": make_pruner}
# (a sampler's seed: every draw is reseeded from the spec's seed, sampling.py)
_NOT_COMPARED = ("self", "args", "kwargs", "seed")
# the options of `hftc sweep` that set a field, for the error to name
_OPTIONS = {"epochs": "--epochs", "seed": "--seed", "sampler": "--sampler",
            "pruner": "--pruner"}
_UNKNOWN = "?"
_LAZY = ("None", "'auto'")  # an argument Optuna sets on first use
_SIMPLE = (int, float, str, bool, bytes, type(None))


def _user_code(obj: Any) -> bool:
    """A function or class of the user's own modules (``from models import CNN`` beside
    the spec, a project's package): its code is the spec's as much as the spec file's.
    Not a library's (installed, the standard library's, or one of ``_LIBRARIES``)."""
    name = getattr(obj, "__module__", None) or ""
    path = getattr(sys.modules.get(name), "__file__", None)
    if not path or name.startswith(_LIBRARIES):
        return False
    installed = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    resolved = os.path.realpath(path)
    return not any(resolved.startswith(os.path.realpath(p) + os.sep) for p in installed if p)


def _simple(value: Any) -> str | None:
    """The repr of a constant made of numbers, strings, tuples, lists and dicts (None for
    anything whose repr may hold an address)."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset, set)):
        parts = [_simple(v) for v in value]
        if isinstance(value, (set, frozenset)):
            parts = sorted(p for p in parts if p is not None) if None not in parts else parts
        return None if None in parts else f"{type(value).__name__}({parts})"
    if isinstance(value, dict):
        parts = [(_simple(k), _simple(v)) for k, v in value.items()]
        return None if any(None in p for p in parts) else f"dict({parts})"
    return None


def _code_parts(code: types.CodeType, out: list[str], names: set[str]) -> None:
    out.append(code.co_code.hex())
    out.append(repr(code.co_names))
    out.append(repr(code.co_varnames))
    names.update(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_parts(const, out, names)
        else:
            out.append(_simple(const) or type(const).__name__)


class _Digest:
    """One field's digest: the code it runs (``out``) and the simple constants of its
    module it reads (``constants``, by name), kept apart: an edited layer or range is
    another spec, a knob read from the environment (``SLOW = float(os.environ[...])``)
    is said, not refused."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.seen: set[int] = set()
        self.constants: dict[str, str] = {}
        #: a constant's name -> a digest of its assignment's source in the spec's module
        #: (``HIDDEN = 8``): an edited line is another spec, a value read from the
        #: environment by the same line is said only
        self.sources: dict[str, str] = {}

    def add(self, obj: Any, module: str | None) -> None:
        out = self.out
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        fn = getattr(obj, "__func__", obj)  # a bound method: its function
        if isinstance(fn, functools.partial):  # partial(my_loss, smoothing=0.1)
            out.append(repr([_simple(a) for a in fn.args]) + repr(sorted(
                (k, _simple(v)) for k, v in fn.keywords.items())))
            self.add(fn.func, module)
        elif isinstance(fn, types.FunctionType) and fn.__module__.startswith(_LIBRARIES):
            out.append(f"{fn.__module__}.{fn.__qualname__}")  # default_optimizer: by name
        elif isinstance(fn, types.FunctionType):
            names: set[str] = set()
            _code_parts(fn.__code__, out, names)
            out.append(repr([_simple(d) for d in (fn.__defaults__ or ())]))
            for name in sorted(names):  # what it uses of its own module (a class, a helper)
                if name in fn.__globals__:
                    self.add_global(name, fn.__globals__[name], fn.__module__)
        elif isinstance(obj, type):
            if obj.__module__.startswith(_LIBRARIES) or (obj.__module__ != module
                                                          and not _user_code(obj)):
                out.append(f"{obj.__module__}.{obj.__qualname__}")
                return
            module = obj.__module__  # (its methods' own-module names are its module's)
            for key, member in sorted(vars(obj).items()):
                if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                    out.append(key)
                    self.add(getattr(member, "fget", None) or getattr(member, "__func__", member),
                             module)
                elif not key.startswith("__"):
                    out.append(f"{key}={_simple(member)}")
        else:
            # a builtin, a callable object (an nn.Module loss): its class's name
            # and simple state (not its module, named after the spec file)
            name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
            state = getattr(obj, "__dict__", None) or {}
            out.append(f"{name}{ {k: _simple(v) for k, v in sorted(state.items()) if _simple(v)} }")

    def add_global(self, name: str, value: Any, module: str) -> None:
        """A global a function reads: its own module's functions and classes by their
        code, simple constants by value (apart); anything else (torch, a module) not."""
        if isinstance(value, (types.FunctionType, type)) and (value.__module__ == module
                                                              or _user_code(value)):
            self.out.append(getattr(value, "__qualname__", ""))
            self.add(value, module)
        elif not isinstance(value, types.ModuleType) and _simple(value) is not None:
            self.constants[name] = _simple(value)
            source = _assignments(module).get(name)
            if source is not None:
                self.sources[name] = source
        elif isinstance(value, dict) and all(isinstance(k, _SIMPLE) for k in value):
            for key, item in value.items():  # ACTS = {"relu": nn.ReLU, ...}
                self.out.append(repr(key))
                if isinstance(item, (types.FunctionType, type)) and item.__module__ != module \
                        and not _user_code(item):
                    self.out.append(f"{item.__module__}.{item.__qualname__}")
                else:
                    self.add_global(name, item, module)

    @classmethod
    def of(cls, obj: Any) -> _Digest:
        digest = cls()
        if obj is None or isinstance(obj, str):
            digest.out.append(repr(obj))
        else:
            digest.add(obj, getattr(obj, "__module__", None))
        return digest


def _argument(value: Any) -> str | dict[str, Any]:
    """One constructor argument as an Optuna object holds it: a constant by its repr, a
    nested sampler or pruner (``PatientPruner``'s) by its description, a function or
    class by its name, anything else by its type."""
    if _simple(value) is not None:
        return _simple(value)
    if isinstance(value, (optuna.samplers.BaseSampler, optuna.pruners.BasePruner)):
        return describe_optuna(value)
    if isinstance(value, (types.FunctionType, type)):
        return f"{value.__module__}.{value.__qualname__}"
    return type(value).__qualname__


def describe_optuna(obj: Any) -> dict[str, Any]:
    """A sampler or pruner by its class and its constructor's arguments, read back from
    the attributes Optuna keeps them in (``_n_startup_trials``; TPE's prior in its
    ``_parzen_estimator_parameters``)::

        {"class": "optuna.pruners._median.MedianPruner", "n_startup_trials": "4", ...}"""
    cls = type(obj)
    described: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    if not cls.__module__.startswith(_LIBRARIES):  # a pruner of the user's own: by its code
        # (not its module's name, which is the spec file's)
        described.update({"class": cls.__qualname__, "code": _hashed(_Digest.of(cls))})
    held = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for value in list(held.values()):  # a NamedTuple of arguments (TPE's)
        if isinstance(value, tuple) and hasattr(value, "_asdict"):
            held.update({f"_{k}": v for k, v in value._asdict().items()})
    for name in inspect.signature(cls.__init__).parameters:
        for attr in (f"_{name}", name):
            if name not in _NOT_COMPARED and attr in held:
                described[name] = _argument(held[attr])
                break
    return described


def _chooser(spec: SweepSpec, key: str) -> dict[str, Any] | str:
    try:
        return describe_optuna(_CHOOSERS[key](spec))
    except Exception:  # noqa: BLE001  (a sampler we cannot make or read: not compared)
        return _UNKNOWN


def _differing(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The arguments in which two descriptions differ (``class`` first), those both
    hold and neither left to Optuna's first use (the module docstring)."""
    if recorded.get("class") != now.get("class"):
        return ["class"]
    return [k for k in recorded.keys() & now.keys() - {"class"}
            if recorded[k] not in _LAZY and now[k] not in _LAZY
            and (_differing(recorded[k], now[k]) if isinstance(recorded[k], dict)
                 and isinstance(now[k], dict) else recorded[k] != now[k])]


def _differs(recorded: Any, now: Any) -> bool:
    """Whether one field's record differs (a sampler's or pruner's: by :func:`_differing`)."""
    if _UNKNOWN in (recorded, now):
        return False
    if isinstance(recorded, dict) and isinstance(now, dict):
        return bool(_differing(recorded, now))
    return recorded != now


def _shown(described: Any, only: list[str]) -> str:
    """A description as Python, with the arguments in ``only``: ``MedianPruner(
    n_warmup_steps=2)``; just the class where the classes differ."""
    if not isinstance(described, dict):
        return str(described)
    shown = {k: _shown(v, sorted(v)) if isinstance(v, dict) else v
             for k, v in described.items()}
    args = ", ".join(f"{k}={shown[k]}" for k in sorted(only)
                     if k not in ("class", "code") and k in shown)
    name = str(described.get("class", "?")).rsplit(".", 1)[-1]
    code = f" (its code {described['code']})" if "code" in only and "code" in described else ""
    return (name if "class" in only or (code and not args) else f"{name}({args})") + code


def _assignments(module: str | None) -> dict[str, str]:
    """A digest of each top-level assignment's source in ``module`` (its file as it is
    on disk now), by the names it assigns; {} where it cannot be read."""
    path = getattr(sys.modules.get(module or ""), "__file__", None)
    try:
        text = Path(path).read_text() if path else None
        tree = ast.parse(text) if text is not None else None
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[str, str] = {}
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            code = hashlib.sha256(ast.dump(node.value).encode()).hexdigest()[:16] \
                if node.value is not None else ""
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = code
    return found


def _hashed(digest: _Digest) -> str:
    return hashlib.sha256("\n".join(digest.out).encode()).hexdigest()[:16]


def spec_fingerprint(spec: SweepSpec) -> dict[str, Any]:
    """The study's record of ``spec`` (the module docstring): the values, each function's
    code digest, the sampler's and the pruner's description, and under ``"constants"``
    the simple module constants the functions read."""
    record: dict[str, Any] = {key: str(getattr(spec, key)) for key in _VALUES}
    record.update({key: _chooser(spec, key) for key in _CHOOSERS})
    constants: dict[str, str] = {}
    sources: dict[str, str] = {}
    for key in _FUNCTIONS:
        try:
            digest = _Digest.of(getattr(spec, key))
        except Exception:  # noqa: BLE001  (an object we cannot read: not compared)
            record[key] = _UNKNOWN
            continue
        record[key] = _hashed(digest)
        constants.update(digest.constants)
        sources.update(digest.sources)
    record["constants"] = constants
    record[_SOURCES] = sources
    return record


def _said(spec: SweepSpec, key: str) -> str:
    value = getattr(spec, key)
    if key in _VALUES or isinstance(value, str) or value is None:
        return f"{key} = {value!r}" if not isinstance(value, str) else f"{key} = '{value}'"
    try:
        return (f"{hook_name(key, value)} (its code, or that of a function or class of "
                f"its module it uses)")
    except Exception:  # noqa: BLE001  (an object without a source: its name)
        return f"{key} ({type(value).__name__})"


def _change(spec: SweepSpec, key: str, was: Any, now: Any) -> str:
    """One changed field, said with the option that sets it: ``pruner was MedianPruner,
    now NopPruner (--pruner or the spec's pruner)``."""
    if key not in _VALUES and key not in _CHOOSERS:
        return f"{_said(spec, key)} changed"
    option = f" ({_OPTIONS[key]} or the spec's {key})" if key in _OPTIONS else ""
    if isinstance(was, dict) and isinstance(now, dict):
        was, now = (_shown(d, _differing(was, now)) for d in (was, now))
    return f"{key} was {was}, now {now}{option}"


def check_same_spec(recorded: dict[str, Any] | None, spec: SweepSpec, study: str,
                    where: str) -> list[str]:
    """Refuse a spec other than the one the study's trials were trained with: a
    :class:`~hftc.errors.SweepError` saying which fields changed. Returns what changed
    that is only said (a module constant the spec's functions read: a knob set from the
    environment, a path), for a warning."""
    if not isinstance(recorded, dict):
        return []  # a study from before the record, or made by hand: nothing to compare
    now = spec_fingerprint(spec)
    changed = [key for key in now if key not in ("constants", _SOURCES) and key in recorded
               and _differs(recorded[key], now[key])]
    before = recorded.get("constants") if isinstance(recorded.get("constants"), dict) else {}
    was_written = recorded.get(_SOURCES) if isinstance(recorded.get(_SOURCES), dict) else {}
    differing = [name for name, value in now["constants"].items()
                 if name in before and before[name] != value]
    # An assignment edited in the spec (HIDDEN = 8 -> 12) changes what trials train; the
    # same line giving another value (a knob read from the environment) is said only.
    edited = [name for name in differing if name in was_written
              and name in now[_SOURCES] and was_written[name] != now[_SOURCES][name]]
    constants = [f"{name} was {before[name]}, now {now['constants'][name]}"
                 for name in differing if name not in edited]
    if not changed and not edited:
        return constants
    said = [_change(spec, key, recorded[key], now[key]) for key in changed]
    said += [f"{name} was {before[name]}, now {now['constants'][name]} (its line in the spec "
             f"edited)" for name in edited]
    raise SweepError(
        f"the sweep {study!r} in {where} was started with another spec: "
        f"{'; '.join(said + constants)}. Its trials so far were sampled, trained and pruned "
        f"with the first; resumed or new ones would be with this one, and one study would "
        f"mix the two. Undo the "
        f"change (give the first run's options again: --epochs, --seed, --sampler, --pruner) to "
        f"continue it, or start a new sweep (another --out, or --study)")
