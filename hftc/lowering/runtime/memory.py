"""Keep the memory a training step frees for the next step (CPU, Linux with glibc).

A fused step holds N models' activations at once: tens to hundreds of MiB,
allocated in the forward and freed after the backward, every step.  glibc's
malloc gives freed memory at the top of its heap back to the kernel once more
than its trim threshold is free, and serves blocks above its mmap threshold
with fresh ``mmap()`` calls; both thresholds adapt (up to 64 and 32 MiB) to
what the process has freed so far.  A working set larger than that is then
returned and faulted in again, page by zeroed page, every step, where the serial
loop's one-model working set stays under the thresholds (docs/DESIGN_NOTES.md).

:func:`keep_freed_memory` sets, with ``mallopt``::

    M_MMAP_MAX = 0                every block comes from the heap (ResNet-18's stacked
                                  layer-4 weight gradients at N = 4 are 36 MiB, above the
                                  largest mmap threshold glibc accepts, 32 MiB)
    M_TRIM_THRESHOLD = 2 GiB - 1  freed heap memory stays with the process

so a step's memory is faulted in once, in the first step, and reused after. The
process's resident memory then stays at its peak, which a training job reaches every
step anyway. ``hftc.fuse(models)`` calls it on CPU tensors before its strategy
choice times the fused program (unless ``strategy="model_loop"``), ``hftc.compile_step``
before its first steps with the models in order on the CPU (each makes the N models'
stacked gradients anew: a small GPT's step in order took 5% longer without it), and
``hftc.fuse(..., autotune=True)`` once it has tuned a forward's ops (set
``HFTC_KEEP_FREED_MEMORY=0`` to prevent either): after the ops' tuning, whose
candidates allocate buffers of every size that would otherwise stay in the heap
(called before the tuning, the peak grew by a quarter: docs/DESIGN_NOTES.md), and
before the whole forward's, whose candidates must be timed as the steps will run
them: under the defaults the fused program (N models' buffers at once) was faulted
in on every timed run and the model loop was not, and PointNet N = 16 timed 1.33 s
against the loop's 0.98 s where the steps took 0.95 s either way. Elsewhere (not
glibc) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["keep_freed_memory", "peak_memory"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: mallopt takes an int: the largest trim threshold it can be given.
_TRIM_THRESHOLD = 2**31 - 1

_applied = False


def keep_freed_memory() -> bool:
    """Stop glibc's malloc from returning freed memory to the kernel between steps.

    Returns whether the setting is in force (False where the C library is not
    glibc or refused it).  Idempotent; process-wide (every allocation of the
    process, not only hftc's).
    """
    global _applied
    if _applied:
        return True
    libc = _libc()
    if libc is None:
        return False
    try:
        mallopt = libc.mallopt
    except AttributeError:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_MAX, 0),
        (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)))
    return _applied


def keep_freed_memory_for_tuning() -> bool:
    """:func:`keep_freed_memory` unless ``HFTC_KEEP_FREED_MEMORY`` is ``0`` (the compile
    pipeline's call on CPU inputs: autotune's, and the strategy choice's without it;
    ``hftc.compile_step``'s before it runs the models in order)."""
    if os.environ.get("HFTC_KEEP_FREED_MEMORY", "1").strip().lower() in ("0", "false", "no"):
        return False
    return keep_freed_memory()


def _libc() -> Any:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0])
    except (OSError, ValueError):
        pass
    return None


def peak_memory(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int | None]:
    """``fn()``, and how many bytes above its starting point its memory peaked at.

    On a GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
    On the CPU (Linux with glibc): the rise of the process's resident set, with the
    heap's free memory handed back first (``malloc_trim``) and the high-water mark
    reset (``/proc/self/clear_refs``), so ``fn``'s own allocations are what is counted,
    oneDNN's and MKL's buffers included.  ``None`` where it cannot be measured.
    Both reset the peak the process reports (``VmHWM``; CUDA's peak statistics).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - start
    libc = _libc()
    if device.type != "cpu" or libc is None:
        return fn(), None
    libc.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return fn(), None
    start = _status_kib("VmRSS")
    out = fn()
    peak = _status_kib("VmHWM")
    if start is None or peak is None:
        return out, None
    return out, max(0, peak - start) * 1024
