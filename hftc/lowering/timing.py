"""The one way hftc chooses between programs that compute the same answers: time them.

Every choice made by timing (an op's lowering, the whole forward's program, the fused
program against the N models one by one, padding models into one array or not) goes
through this module: one measurement loop, one margin, one tie rule, one disk cache::

    measure({"fused": run_a, "model_loop": run_b}, device, rounds=5)
        round 1: fused, model_loop        (each call timed alone, kernels waited for)
        round 2: model_loop, fused        (the order alternates: drift hits both)
        ...                               -> {"fused": [s, s, ...], "model_loop": [...]}
    choose(times, default="fused")
        ratio[way] = median over rounds of way's seconds / default's
        another way than the default only if ratio < 1 - MARGIN (between ties the
        default stays, so a choice does not flip with noise); then a tie on time goes to
        the way whose peak memory is MEMORY_MARGIN lower
    store_entry(key, {"chosen": ..., "times": ...}, cache_path())   (the next process
        with the same device, software and shapes times nothing: lookup_entry)

A choice made by timing makes the bits of a run depend on the machine's load and on what
the cache holds (the candidates round differently), so nothing is timed by default:
``strategy="timed"`` and ``autotune=True`` ask for it, and
``torch.use_deterministic_algorithms(True)`` turns it off (:func:`timing_allowed`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: How much faster (a fraction of the default's time, the median of the per-round
#: ratios) another way must measure to replace the default.
MARGIN = 0.03
#: Between ways that tie on time (within MARGIN), one whose peak memory is at least this
#: fraction lower is taken: a larger N then fits, for no time.
MEMORY_MARGIN = 0.2
#: Interleaved timed rounds of one measurement.
ROUNDS = 5


def timing_allowed() -> bool:
    """Whether a choice between numerically different programs may be made by timing:
    not under ``torch.use_deterministic_algorithms(True)``."""
    return not torch.are_deterministic_algorithms_enabled()


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s kernels (a CUDA call returns before its kernels end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(ways: dict[str, Callable[[], Any]], device: torch.device, *,
            rounds: int = ROUNDS, min_rounds: int | None = None,
            budget_s: float | None = None, repeats: dict[str, int] | None = None,
            times: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Seconds of one call of each way, per round, the rounds interleaved (the ways'
    order reversed every other round).  ``repeats[way]`` calls make one timed call's
    figure (short ops).  With ``budget_s``: stop after ``min_rounds`` (default 2) once
    the rounds took ``budget_s``, at most ``rounds``.  ``times`` (an earlier call's
    result) is extended: a second block of rounds over the ways still in the running."""
    times = times if times is not None else {}
    for name in ways:
        times.setdefault(name, [])
    names = list(ways)
    start = time.perf_counter()
    for round_ in range(rounds):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            count = (repeats or {}).get(name, 1)
            synchronize(device)
            begin = time.perf_counter()
            for _ in range(count):
                ways[name]()
            synchronize(device)
            times[name].append((time.perf_counter() - begin) / count)
        if budget_s is not None and round_ + 1 >= (min_rounds or 2) \
                and time.perf_counter() - start >= budget_s:
            break
    return times


def ratios(times: dict[str, Sequence[float] | float], default: str) -> dict[str, float]:
    """Each way's median over the rounds they share of its seconds / ``default``'s (a
    single figure per way: the plain ratio)."""
    rows = {name: [t] if isinstance(t, (int, float)) else list(t) for name, t in times.items()}
    base = rows[default]
    out = {}
    for name, row in rows.items():
        shared = min(len(row), len(base))
        out[name] = statistics.median(row[k] / max(base[k], 1e-12) for k in range(shared))
    return out


def medians(times: dict[str, Sequence[float] | float]) -> dict[str, float]:
    """Each way's median seconds."""
    return {name: float(t) if isinstance(t, (int, float)) else statistics.median(t)
            for name, t in times.items()}


def choose(times: dict[str, Sequence[float] | float], default: str,
           peaks: dict[str, int | float | None] | None = None) -> str:
    """The one tie rule (see the module docstring): the fastest way if it beats
    ``default`` by :data:`MARGIN`, else ``default``; then, among the ways within MARGIN
    of that one's time, the one with a peak :data:`MEMORY_MARGIN` lower, if any."""
    if default not in times:
        return min(medians(times).items(), key=lambda kv: kv[1])[0]
    by_ratio = ratios(times, default)
    fastest = min(by_ratio, key=by_ratio.get)
    chosen = fastest if by_ratio[fastest] < 1 - MARGIN else default
    if not peaks or peaks.get(chosen) is None:
        return chosen
    lighter = [name for name, r in by_ratio.items()
               if r <= (1 + MARGIN) * by_ratio[chosen] and peaks.get(name) is not None
               and peaks[name] <= (1 - MEMORY_MARGIN) * peaks[chosen]]
    return min(lighter, key=peaks.get) if lighter else chosen


# --------------------------------------------------------------------------- the cache


def cache_path() -> Path:
    """Where choices persist: ``$HFTC_CACHE_DIR`` / ``$XDG_CACHE_HOME/hftc`` / ``~/.cache/hftc``."""
    root = os.environ.get("HFTC_CACHE_DIR")
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "hftc")
    return Path(root) / "autotune.json"


#: entries read or written by this process, by file and key
_MEMORY: dict[tuple[str, str], dict[str, Any]] = {}


def _load(path: Path) -> dict[str, dict[str, Any]]:
    try:
        with open(path) as f:
            entries = json.load(f)
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a torn/corrupt one: time again


def lookup_entry(key: str, path: Path) -> dict[str, Any] | None:
    """The cached entry for ``key``; one that is not ``{"chosen": str, "times": {str:
    number}}`` (a file edited or damaged) counts as none: the choice is timed again."""
    if (str(path), key) not in _MEMORY:
        entry = _load(path).get(key)
        if not _well_formed(entry):
            return None
        _MEMORY[str(path), key] = entry
    return _MEMORY[str(path), key]


def _well_formed(entry: Any) -> bool:
    times = entry.get("times") if isinstance(entry, dict) else None
    return (isinstance(entry, dict) and isinstance(entry.get("chosen"), str)
            and isinstance(times, dict) and all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in times.items()))


def store_entry(key: str, entry: dict[str, Any], path: Path) -> None:
    """Merge into the file and replace it atomically (concurrent trials lose nothing
    worse than an entry to re-time)."""
    _MEMORY[str(path), key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _load(path)
        entries[key] = entry
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: keep the choice for this process
        warnings.warn(f"hftc: cannot write its timing cache {path}: {exc}", stacklevel=3)


def device_key(device: torch.device) -> str:
    """The hardware and software a timing holds for: the device, torch's version and
    hftc's own code (a changed kernel choice inside a runtime function leaves the generated
    program, and so the rest of the key, as it was)."""
    software = f"torch {torch.__version__}:hftc {hftc_code_fingerprint()}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"cuda:{name}:{software}"
    return f"{device.type}:{_cpu_name()}:{torch.get_num_threads()} threads:{software}"


@functools.cache
def hftc_code_fingerprint() -> str:
    """A hash of the source of every hftc module: timings cached by another hftc are stale."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha1()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_values(value: Any) -> Any:
    """Shapes, strides and dtypes of ``value``'s tensors (nested as given), for keys."""
    if isinstance(value, Tensor):
        return [list(value.shape), list(value.stride()), str(value.dtype)]
    if isinstance(value, (tuple, list)):
        return [describe_values(v) for v in value]
    return repr(value)


__all__ = ["MARGIN", "MEMORY_MARGIN", "ROUNDS", "cache_path", "choose", "describe_values",
           "device_key", "hftc_code_fingerprint", "lookup_entry", "measure", "medians",
           "ratios", "store_entry", "synchronize", "timing_allowed"]
