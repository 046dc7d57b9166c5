"""Running the user's own code for the command line (``hftc inspect``'s FACTORY file,
``hftc sweep``'s SPEC): an error in it is one paragraph naming the user's file and line,
not a traceback through importlib and hftc."""

from __future__ import annotations

import importlib
import linecache
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import FusionError, is_user_frame

_HFTC = str(Path(__file__).resolve().parent.parent)


def user_code_error(exc: BaseException, what: str, where: str = "") -> str:
    """``what`` (``"the sweep spec s.py"``) and what went wrong in it: a SyntaxError's file,
    line and caret, else the exception at the user's innermost line: outside hftc and torch
    (a factory's ``nn.Linear(3, bais=4)``, not torch's line that raised), else outside hftc
    only, else ``where`` (``"file.py:12"``, the factory's own line, for a call that failed
    before its first line ran: a factory that takes arguments)."""
    if isinstance(exc, SyntaxError):
        text = (exc.text or "").rstrip("\n")
        where = f"{exc.filename}:{exc.lineno}"
        shown = ""
        if text.strip():
            indent = len(text) - len(text.lstrip())
            caret = " " * max((exc.offset or 1) - 1 - indent, 0) + "^"
            shown = f":\n    {text.strip()}\n    {caret}"
        return f"{what} has a {type(exc).__name__} at {where}: {exc.msg}{shown}"
    frames = [(frame, line) for frame, line in traceback.walk_tb(exc.__traceback__)
              if not frame.f_code.co_filename.startswith(("<", _HFTC))]
    users = [(frame, line) for frame, line in frames if is_user_frame(frame)]
    at = f" at {where}" if where else ""
    if users or frames:
        frame, lineno = (users or frames)[-1]
        filename = frame.f_code.co_filename
        line = linecache.getline(filename, lineno).strip()
        at = f" at {filename}:{lineno}" + (f": `{line}`" if line else "")
    return f"{what} raised {type(exc).__name__}: {exc}{at}"


def definition_line(fn: Callable) -> str:
    """``file.py:12``, where ``fn`` (a function, or a class: its ``__init__``) is defined;
    ``""`` for one without Python source (a builtin)."""
    code = getattr(getattr(fn, "__init__", None) if isinstance(fn, type) else fn,
                   "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def run_user_code(fn: Callable[[], Any], what: str, error: type[Exception],
                  where: str = "") -> Any:
    """``fn()``; an exception out of the user's code (not Ctrl-C, not hftc's own clear
    errors) becomes ``error`` with :func:`user_code_error`'s message (``where``: the line
    to name when none of the user's ran)."""
    try:
        return fn()
    except FusionError:
        raise
    except Exception as exc:  # the user's code: any error it raises is theirs to fix
        raise error(user_code_error(exc, what, where)) from exc


def import_user_module(module_name: str, what: str, missing: str,
                       error: type[Exception]) -> Any:
    """``importlib.import_module(module_name)``; a module that is not there is ``error``
    ``"{missing}: No module named ..."``, an error inside the module (a SyntaxError, its
    own ``import`` of a package not installed) :func:`user_code_error`'s, at its line."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        parts = module_name.split(".")
        if exc.name is None or exc.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise error(f"{missing}: {exc}") from exc
        raise error(user_code_error(exc, what)) from exc
    except Exception as exc:  # the module's own error, at its line
        raise error(user_code_error(exc, what)) from exc


def make_models(factory: Callable[[], Any], spec: str, n: int) -> list[Any]:
    """``hftc inspect``'s N models: ``factory()`` called ``n`` times, each call's model a new
    ``nn.Module`` of one class; anything else is a CommandLineError naming ``spec`` and the
    factory's line (not a FusionTypeError about "model 0" the user never listed)."""
    from torch import nn

    from ..errors import CommandLineError

    where = definition_line(factory)
    what = f"hftc inspect: the factory {spec}" + (f" (defined at {where})" if where else "")
    models = [run_user_code(factory, what, CommandLineError, where) for _ in range(n)]
    for call, model in enumerate(models, 1):
        if not isinstance(model, nn.Module):
            hint = (f"; return an instance, {model.__name__}(...), not the class"
                    if isinstance(model, type) else "")
            raise CommandLineError(
                f"{what} returned {model!r} ({type(model).__name__}) on call {call}, not a "
                f"torch.nn.Module: FACTORY is called with no arguments and returns one "
                f"model{hint}")
        earlier = next((i for i, m in enumerate(models[:call - 1], 1) if m is model), None)
        if earlier is not None:
            raise CommandLineError(
                f"{what} returned the same {type(model).__name__} object on calls {earlier} "
                f"and {call}: build a new model in each call (hftc fuses N separate models)")
        if _class_name(model) != _class_name(models[0]):
            raise CommandLineError(
                f"{what} returned a {_class_name(models[0])} on call 1 and a "
                f"{_class_name(model)} on call {call}: hftc inspect fuses N models of one "
                f"class (hftc.fuse_groups sorts a mixed list into groups that fuse)")
    return models


def _class_name(model: Any) -> str:
    """``torch.nn.modules.linear.Linear``: a class by its name, so that a class defined in
    the factory's body (a new class object each call, ``make.<locals>.Net``) is one."""
    return f"{type(model).__module__}.{type(model).__qualname__}"
