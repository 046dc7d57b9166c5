"""Running the user's own code for the command line (``hftc inspect``'s FACTORY file,
``hftc sweep``'s SPEC): an error in it is one paragraph naming the user's file and line,
not a traceback through importlib and hftc."""

from __future__ import annotations

import linecache
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import FusionError

_HFTC = str(Path(__file__).resolve().parent.parent)


def user_code_error(exc: BaseException, what: str) -> str:
    """``what`` (``"the sweep spec s.py"``) and what went wrong in it: a SyntaxError's file,
    line and caret, else the exception at the innermost line outside hftc and importlib."""
    if isinstance(exc, SyntaxError):
        text = (exc.text or "").rstrip("\n")
        where = f"{exc.filename}:{exc.lineno}"
        shown = ""
        if text.strip():
            indent = len(text) - len(text.lstrip())
            caret = " " * max((exc.offset or 1) - 1 - indent, 0) + "^"
            shown = f":\n    {text.strip()}\n    {caret}"
        return f"{what} has a {type(exc).__name__} at {where}: {exc.msg}{shown}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(("<", _HFTC))]
    at = ""
    if frames:
        frame = frames[-1]
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        at = f" at {frame.filename}:{frame.lineno}" + (f": `{line}`" if line else "")
    return f"{what} raised {type(exc).__name__}: {exc}{at}"


def run_user_code(fn: Callable[[], Any], what: str, error: type[Exception]) -> Any:
    """``fn()``; an exception out of the user's code (not Ctrl-C, not hftc's own clear
    errors) becomes ``error`` with :func:`user_code_error`'s message."""
    try:
        return fn()
    except FusionError:
        raise
    except Exception as exc:  # the user's code: any error it raises is theirs to fix
        raise error(user_code_error(exc, what)) from exc
