"""The seconds a sweep's process spent before the sweep's own clock started.

A user times a sweep as a whole process (``time hftc sweep spec.py``), and the
one-at-a-time script it is compared with pays most of the same start-up: Python and the
imports of torch, optuna and the spec's modules. The summary's speedup counts both sides'
start-up::

    fused:  [python, torch, hftc, optuna, the spec] [the sweep's clock .......]
    serial: [python, torch,       optuna, the spec] [its estimated study ....]

The first bracket is measured where the process is the ``hftc`` command
(:func:`command_process`; a sweep started from a notebook or a script of the user's
has done other work before, which is not the sweep's); the second side is charged the
same less hftc's own core import (``hftc._CORE_LOAD_S``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["command_process", "before_sweep"]

_command = False


@contextlib.contextmanager
def command_process() -> Iterator[None]:
    """Within: this process is the ``hftc sweep`` / ``hftc demo`` command, whose start-up
    is the sweep's (an in-process caller of the command's ``main`` is so only within)."""
    global _command
    before, _command = _command, True
    try:
        yield
    finally:
        _command = before


def before_sweep() -> float | None:
    """Seconds since this process started, where it is the ``hftc`` command and the
    operating system tells (Linux's ``/proc``); else None."""
    if not _command:
        return None
    try:
        with open("/proc/self/stat") as f:
            # the command's name (field 2) may hold spaces: fields after its ")"
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started)
