"""Every error a user's input can cause, as a class.

Each message names the model index, the node, its module path in the user's
code and what to change.  Internals never leak a bare ``AssertionError`` or
``IndexError``: anything that reaches the user is one of these (or a
``ValueError`` / ``TypeError`` subclass of them, for bad arguments).
"""

from __future__ import annotations

import linecache
import sys


class FusionError(Exception):
    """Base class of every error hftc raises because of its input."""


class MismatchError(FusionError):
    """The N models are not structurally identical, so they cannot be fused."""


class TraceError(FusionError):
    """A model cannot be traced into a graph; the message says what to pass or change."""


class UnsupportedOperatorError(FusionError):
    """Operators that cannot be fused, all of them listed (not just the first)."""

    def __init__(self, message: str, operators: list[str] | None = None):
        super().__init__(message)
        self.operators = list(operators or [])


class RaggedResultError(UnsupportedOperatorError):
    """An op that runs per model gave the models results one fused program cannot hold:
    tensors of different shapes (a boolean mask that keeps a different number of rows in
    each) or different Python values (``.item()`` of a per-model tensor)."""


class FusionWarning(UserWarning):
    """hftc runs something slower than asked, correctly, and says why (the first-call
    check found the fused program's outputs not the models': they run one by one)."""


class UsageWarning(UserWarning):
    """hftc runs the code as written, but the code is very likely not what was meant with
    a fused module, and the message says what to write instead: a loss taken over all N
    models at once (``F.mse_loss(fused(x), y)``, ``losses.mean()``: each model's gradient
    divided by N), the models ``unfuse()`` returned trained while the fused module is
    stepped, ``skip_models`` used to freeze a model whose batch norm still learns.
    Shown once per line of the user's code (Python's default filter)."""


class FusionArgumentError(FusionError, ValueError):
    """A bad argument to ``hftc.fuse`` or to a fused module (list, inputs, in_dims)."""


class InputShapeError(FusionArgumentError):
    """A call's input has sizes the models' exported program does not take (torch.export
    fixed them: the model's code or the example does, or every dim could not be kept
    symbolic); the message names the input, its shape, the shape exported and what to do."""


class ModelInputError(FusionError, RuntimeError):
    """A call's inputs the models cannot take, raised inside the fused program: said in
    model 0's own op's words (its node, module path and torch's message). A
    ``RuntimeError``, as torch's own error was."""


class FusionNotImplementedError(FusionError, NotImplementedError):
    """What a plain module or optimizer does and a fused one cannot (``add_param_group``
    on a fused optimizer, whose param groups are the models); the message says what to do
    instead.  A ``NotImplementedError``, as torch's own refusals of the kind are."""


class FusionTypeError(FusionError, TypeError):
    """An argument of the wrong type (a non-module in the model list, say)."""


class SpecError(FusionError, ValueError):
    """A sweep spec is missing a piece or has one of the wrong kind (the message says which)."""


class CommandLineError(FusionError, SystemExit):
    """A bad argument on ``hftc``'s command line that argparse cannot see: a FACTORY or
    SPEC that does not load (no such file, a typo, a SyntaxError or an exception at its
    import, named at the user's line), an output file that cannot be written.  ``hftc``
    prints it and exits 2, as argparse's own usage errors do.  A ``SystemExit`` (its
    ``code`` the message), as the ``SystemExit("hftc: ...")`` it replaces was."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = message


class SweepError(FusionError, RuntimeError):
    """A sweep cannot start or go on; the message says what to do."""


class SweepFileError(SweepError):
    """A file or folder of a sweep's ``--out`` cannot be written (disk full, read-only) or
    read (damaged); the message names it, and the sweep's trials are left resumable."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class MissingExtraError(FusionError, ModuleNotFoundError):
    """An optional integration (``hftc.ray``, ``hftc.hf``, ``hftc.lightning``) needs a package
    that is not installed; the message names the extra that installs it
    (``pip install 'hftc[ray]'``), ``.extra`` holds its name."""

    def __init__(self, message: str, extra: str = ""):
        super().__init__(message)
        self.extra = extra


class SweepWarning(UserWarning):
    """A sweep goes on after something the user should know about (a damaged file it
    could not use: the trials it held are retried from epoch 0)."""


class FusionIndexError(FusionArgumentError, IndexError):
    """A model index out of range (``fused.model_state_dict(5)`` of 3 models)."""


#: Where torch.fx / torch.export / dynamo start the debugging text they add to an error's
#: message (the failing node, tracebacks of the graph, logging switches, links).
_DEBUGGING_TEXT = (
    "\n\nWhile executing", "While executing %", "\nOriginal traceback:", "Use tlparse",
    "\nFor more information, run with TORCH_LOGS", "Set TORCH_LOGS", "\nFor extended logs",
    "\nIf you suspect the guard", "\nFor more debugging help", "\nFor C++ stack trace",
    "\nThe following call raised this error", "\nThe error above occurred when calling",
    "\nfrom user code:", "\nYou can suppress this exception", "\nconsider using data-dependent",
    "\nCaused by:",
    # fx's advice for len() (wrap it), which records a call that cannot compute a size
    " If you want this call to be recorded",
)


def plain_message(exc: BaseException) -> str:
    """``"TypeName: message"`` of an exception raised inside torch, without the debugging
    text torch.fx and torch.export append to it (``While executing %x ...``, ``Original
    traceback``, ``Use tlparse ...``, ``For more information, run with TORCH_LOGS=...``),
    which tells an hftc user nothing they can act on."""
    text = str(exc)
    cut = min((k for k in (text.find(marker) for marker in _DEBUGGING_TEXT) if k >= 0),
              default=len(text))
    text = " ".join(text[:cut].split()).rstrip(" .")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class StepCaptureError(FusionError, RuntimeError):
    """``hftc.compile_step`` cannot capture (or compile) a training step: something in it
    reads a value on the host (``.item()``), gives a shape that depends on the data, or
    copies from host memory, which a replayed graph would not redo.  The message names the
    op and the line, and what to change (or ``mode="eager"``, which runs anything)."""


#: hftc's own folder: ``python -m hftc`` runs hftc/__main__.py as ``__main__``, whose
#: frames are hftc's all the same (they were named as "the user's line").
_HFTC_DIR = __file__[:-len("errors.py")]


def is_user_frame(frame) -> bool:
    """Not hftc's, torch's or ``copy``'s (a ``copy.deepcopy`` of a fused module names the
    line that called it), nor ``typing_extensions``' (the ``deprecated`` wrapper of some
    of torch's functions), not code made at run time (a generated forward)."""
    name = frame.f_globals.get("__name__") or ""
    filename = frame.f_code.co_filename
    return name.split(".")[0] not in ("hftc", "torch", "copy", "typing_extensions") \
        and not filename.startswith("<") \
        and not filename.startswith(_HFTC_DIR)


def user_stacklevel() -> int:
    """The ``stacklevel`` at which ``warnings.warn``, called by this function's caller,
    names the user's line: the innermost frame outside hftc and torch (and outside code
    made at run time, a generated forward)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        if is_user_frame(frame):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def user_line() -> str:
    """`` at file:line: `code` `` of the user's innermost frame; ``""`` where there is none
    (the whole stack hftc's, as under ``hftc inspect``), rather than hftc's own line."""
    frame = sys._getframe(1)
    while frame is not None and not is_user_frame(frame):
        frame = frame.f_back
    if frame is None:
        return ""
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f" at {frame.f_code.co_filename}:{frame.f_lineno}" + (f": `{code}`" if code else "")
