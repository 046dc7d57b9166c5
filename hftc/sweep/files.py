"""The sweep's output folder: every file written whole or not at all, and a failed write
(disk full, read-only folder) an error naming the folder that leaves the trials resumable."""

from __future__ import annotations

import contextlib
import errno
import io
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import SweepFileError

__all__ = ["atomic_write", "append_line", "save"]


#: What to do after the output folder failed a write; the trials wait, RUNNING.
_RESUME_HINT = ("the sweep stopped and its trials are kept, not failed: {fix}, then rerun "
                "the same command with --resume (resume=True) to continue them from their "
                "last checkpoints")


def _write_error(path: Path, exc: OSError) -> SweepFileError:
    """A :class:`SweepFileError` for a failed write of ``path``: what went wrong, in which
    folder, and what to do."""
    folder = path.parent
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"no space left on the device of {folder} (writing {path.name})"
        fix = f"free space in {folder} (or give another --out)"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        what = f"{folder} is not writable ({exc.strerror}, writing {path.name})"
        fix = f"make {folder} writable (or give another --out)"
    else:
        what = f"cannot write {path} ({exc.strerror or exc})"
        fix = f"make {folder} writable"
    return SweepFileError(f"{what}; " + _RESUME_HINT.format(fix=fix), str(folder))


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """``data`` into ``path`` whole or not at all: written to a hidden temporary file beside
    it, then renamed over it. A failed write (disk full, read-only folder) removes the
    temporary file and raises a :class:`SweepFileError` that names the folder."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            rest = memoryview(data).cast("B")
            while rest:
                rest = rest[os.write(fd, rest):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _write_error(path, exc) from exc


def append_line(path: Path, line: str) -> None:
    """``line`` appended to ``path`` in one write (a killed process loses none of it; a
    reader skips a line a power cut left short). A failed write raises a
    :class:`SweepFileError` that names the folder."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise _write_error(path, exc) from exc


def save(obj: Any, path: Path) -> None:
    # Serialized in memory first: torch's own file writer reports a full disk as
    # "unexpected pos ...", which names neither the file nor the cause.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(path, buffer.getbuffer())
