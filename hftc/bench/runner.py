"""Run the contenders side by side: one worker process per contender, interleaved rounds.

Every contender of a configuration (workload, N) lives in its own worker process
(the concurrent contender in N of them), forked from a forkserver that has
imported torch and hftc but computed nothing.  So no contender inherits another's
allocator state or compiled caches, and each one's peak memory is its own.

::

    coordinator                         workers (one per contender; N for concurrent)
    start all, wait "ready"     <----   build models + optimizer, 1st step (compiles), warm-up
    round r: for c in rotate(contenders, r):
        send ("warm",)          ---->   on a GPU one untimed step (after the cache release)
        send ("run", k_c)       ---->   k_c steps, timed
        wait for reply          <----   (only one contender computes at a time)
    ("mem",)                    ---->   peak RSS of building + warm-up above the worker's start

A round runs each contender ``k_c`` steps, ``k_c`` chosen from the warm-up so a
sample lasts at least ``min_sample_s`` (the timer and the machine's noise then
matter less for sub-millisecond steps); the sample is the mean step time of
those ``k_c``.  The contenders' order rotates every round.  Medians and min-max
over rounds are reported.

Memory: ``VmHWM`` (peak resident set) of the worker after building the contender,
its first step and the warm-up steps (the timed rounds repeat those steps), minus
its ``VmRSS`` when it started (after ``/proc/self/clear_refs`` reset the peak);
read before hftc's step is profiled for "where the step goes", whose profiler
holds memory of its own.
tracemalloc cannot see torch's allocations; the RSS peak can, at the cost of
counting the allocator's cached blocks (which a real job holds too).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import statistics
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .contenders import MULTI_PROCESS

#: How long a worker may take to build, compile and warm up before it is given up on.
START_TIMEOUT_S = 1800.0
#: At most this many warm-up steps while a contender is still choosing how to run
#: (hftc's default strategy decides within 2 + 4 x 6 calls).
_MAX_CHOOSING_STEPS = 40

#: The environment of concurrent-mps's processes: the MPS daemon's pipe and log
#: directories (set by ``suite.mps_daemon`` while the daemon runs).
MPS_ENV: dict[str, str] = {}


# --------------------------------------------------------------------------- in the worker


def _status_mib() -> dict[str, float]:
    """VmRSS, VmHWM and RssAnon of this process, in MiB (Linux ``/proc/self/status``)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon"):
                    out[key] = int(value.split()[0]) / 1024
    except OSError:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out = {"VmRSS": rss, "VmHWM": rss, "RssAnon": 0.0}
    return out


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _watch_memory(base_mib: float, cap_mib: float) -> None:
    """Exit the process (status 3) as soon as its RSS grows past ``cap_mib`` above ``base_mib``."""

    def watch():
        while True:
            if _status_mib()["VmRSS"] - base_mib > cap_mib:
                os._exit(3)
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()


def matmul_size(device: str, precision: str = "fp32") -> int:
    """The peak-rate matmul's size: 2048^3 on a CPU (512^3 in bf16, which CPUs without
    bf16 instructions run at ~1 GFLOP/s), 8192^3 on a GPU (2048^3 is ~0.1 ms there)."""
    if device != "cpu":
        return 8192
    return 2048 if precision == "fp32" else 512


def _matmul_step(setting):
    """One ``size``^3 matmul in the setting's precision (bf16 AMP: a bf16 matmul)."""
    import torch

    size = matmul_size(setting.device, setting.precision)
    dtype = torch.bfloat16 if setting.precision == "bf16" else torch.float32
    a, b = (torch.randn(size, size, device=setting.device, dtype=dtype) for _ in range(2))
    out = torch.empty(size, size, device=setting.device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def worker_main(conn: Connection, spec: dict[str, Any]) -> None:
    """One contender's process: build it, warm it up, then run steps on request."""
    os.environ.update(spec.get("env", {}))  # e.g. MPS's pipe directory, before CUDA starts
    import torch

    from .contenders import Setting

    setting = Setting(spec.get("device", "cpu"), spec.get("precision", "fp32"))
    on_gpu = setting.device != "cpu"
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    torch.set_num_threads(spec["threads"])
    start = _status_mib()
    peak_reset = _reset_peak()
    base = _status_mib()["VmRSS"] if peak_reset else start["VmHWM"]
    if on_gpu:
        # Device memory: the allocator's peak, and a cap the allocator enforces (OOM).
        if torch.device(setting.device).index is not None:
            torch.cuda.set_device(torch.device(setting.device))
        torch.cuda.reset_peak_memory_stats()
        if spec.get("cap_mib"):
            total = torch.cuda.get_device_properties(torch.device(setting.device)).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_mib"] * 2**20 / total))
    elif spec.get("cap_mib"):
        _watch_memory(base, spec["cap_mib"])
    try:
        from .contenders import build_step

        t0 = time.perf_counter()
        phases = choosing = settled_info = None
        if spec["contender"] == "matmul":
            fn, info = _matmul_step(setting), {}
        else:
            step = build_step(spec["contender"], spec["workload"], spec["n"],
                              model_index=spec.get("model_index"),
                              adam=spec.get("adam", "default"), setting=setting)
            fn, info, phases = step.fn, step.info, step.phases
            choosing, settled_info = step.choosing, step.settled_info
        if not on_gpu:
            # What hftc.fuse(autotune=True) does on the CPU once it has tuned, done for
            # every contender alike once built: no contender's step time then counts page
            # faults the others do not pay.
            import hftc

            hftc.keep_freed_memory()

        def timed(k: int) -> float:
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            setting.sync()
            return time.perf_counter() - t0

        build_s = time.perf_counter() - t0
        first_s = timed(1)
        warm = [timed(1) for _ in range(spec.get("warmup", 2))]
        while choosing is not None and choosing() and len(warm) < _MAX_CHOOSING_STEPS:
            warm.append(timed(1))  # the trial calls of hftc's strategy: not the steady state
        if settled_info is not None:
            info = dict(info, **settled_info())
        # The peak of building and warm steps; the profiler that splits a step's time
        # (phases) holds hundreds of MiB of its own (PointNet N=8: 433 -> 745 MiB) and
        # must not count as the contender's memory.
        if on_gpu:
            step_peak, base = torch.cuda.max_memory_allocated() / 2**20, 0.0
        else:
            step_peak = _status_mib()["VmHWM"]
        if phases is not None and spec.get("phases", True):
            # where a warm step's time goes, apart from the timed rounds; then warm again:
            # the profiler's aftermath slowed the next steps (docs/BENCHMARKS.md)
            info = dict(info, phases=phases())
            warm += [timed(1) for _ in range(spec.get("warmup", 2))]
        if on_gpu:
            _release_device_cache()
        conn.send(("ready", {"build_s": build_s, "first_step_s": first_s, "warm_s": warm,
                             "info": info}))
    except Exception as exc:  # reported as the contender's result, not a crash of the suite
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"))
        return
    while True:
        cmd, arg = conn.recv()
        if cmd == "warm":
            # Before the coordinator starts its clock: on a GPU one untimed step, in which
            # the allocator takes back what the last sample released.
            if on_gpu:
                timed(1)
            conn.send(None)
        elif cmd == "run":
            conn.send(timed(arg))
            if on_gpu:
                _release_device_cache()
        elif cmd == "mem":
            # Timed rounds repeat the warm steps: they add no new peak.
            conn.send({"peak_mib": step_peak - base, "runtime_mib": start["RssAnon"],
                       "exact_peak": peak_reset})
        else:
            conn.send(None)
            return


def _release_device_cache() -> None:
    """Give the caching allocator's free blocks back to the GPU while other contenders run.

    Every contender's worker (and the concurrent contender's N processes) lives on the
    one GPU for the whole configuration, and each allocator keeps its peak cached: in
    the H100 run of 2026-11-22 the peaks added up and hftc ran out of the 80 GB at
    MobileNetV2 N = 4, torch.func holding 35 GB it was not using. A worker now keeps
    only its live tensors between samples, and re-warms untimed before each one (the
    coordinator's "warm", before its clock starts).
    """
    import torch

    torch.cuda.empty_cache()


# --------------------------------------------------------------------------- in the coordinator


_CONTEXT: Any = None


def context():
    """The forkserver that forks every worker (torch and hftc imported once, nothing computed)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "hftc", "hftc.bench.contenders"])
        _CONTEXT = ctx
    return _CONTEXT


class WorkerError(RuntimeError):
    pass


#: CPU ids every worker is confined to (``set_cpus``); empty: wherever the OS puts it.
_CPUS: list[int] = []


def set_cpus(cores: int, threads: int = 1) -> list[int]:
    """Confine every worker started from now on to the first ``cores`` CPUs (0: no pinning).

    All contenders then get the same share of the machine: the concurrent contender's
    N processes share those cores instead of spreading over the idle ones.

    OpenMP's wait policy stays the default (spin a little, then sleep), as a user's
    torch has it, unless a process gets more threads than it has cores: then threads
    that spin-wait for a descheduled peer cost many times their work, so they wait
    passively.  Not the other way round: passive waiting made the stock MLP loop with
    2 threads on 2 cores several times slower (docs/DESIGN_NOTES.md), a handicap no
    user has.
    libgomp reads the policy when torch loads, so it is set before the forkserver
    (which preloads torch) starts.
    """
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    _CPUS[:] = available[:cores] if cores and available else []
    if threads > (len(_CPUS) or os.cpu_count() or 1):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return list(_CPUS)


class Worker:
    """A worker process and the coordinator's end of its pipe."""

    def __init__(self, spec: dict[str, Any]):
        spec = dict(spec, cpus=list(_CPUS))
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, spec), daemon=True)
        self.process.start()
        child.close()
        self.ready: dict[str, Any] = {}

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        kind, payload = self._recv(timeout)
        if kind == "error":
            self.close()
            raise WorkerError(payload)
        self.ready = payload
        return payload

    def _recv(self, timeout: float | None = None) -> Any:
        try:
            if timeout is not None and not self.conn.poll(timeout):
                raise WorkerError(f"no answer within {timeout:.0f} s")
            return self.conn.recv()
        except (EOFError, ConnectionError, BrokenPipeError) as exc:
            self.process.join(5)
            code = self.process.exitcode
            why = "over the memory cap" if code == 3 else f"exit code {code}"
            raise WorkerError(f"worker died ({why})") from exc

    def send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionError) as exc:
            raise WorkerError("worker died") from exc

    def kill(self) -> None:
        """End the process now (one that is not answering would not read a stop)."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop", None))
                self.process.join(10)
            except (BrokenPipeError, ConnectionError, OSError):
                pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


@dataclass
class ContenderRun:
    """One contender's measurements at one (workload, N)."""

    name: str
    step_s: list[float] = field(default_factory=list)   # mean step time per round
    steps_per_sample: int = 1
    build_s: float = 0.0
    first_step_s: float = 0.0
    peak_mib: float | None = None
    runtime_mib: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def median(self) -> float:
        return statistics.median(self.step_s)


class Contender:
    """A contender's worker(s): one, or N for the concurrent contender."""

    def __init__(self, name: str, workload: str, n: int, *, threads: int, warmup: int,
                 adam: str = "default", setting: dict[str, str] | None = None):
        self.run = ContenderRun(name)
        base = {"workload": workload, "n": n, "threads": threads, "warmup": warmup,
                "adam": adam, **(setting or {})}
        if name in MULTI_PROCESS:
            # The contender gets `threads` cores in all: its N processes share them.
            per_process = max(1, threads // n)
            env = dict(MPS_ENV) if name == "concurrent-mps" else {}
            specs = [dict(base, contender="serial", model_index=i, threads=per_process, env=env)
                     for i in range(n)]
        else:
            specs = [dict(base, contender=name)]
        self.workers: list[Worker] = []
        try:
            self.workers = [Worker(s) for s in specs]
            readies = [w.wait_ready() for w in self.workers]
        except WorkerError as exc:
            self.run.error = str(exc).strip()
            self.close()
            return
        self.run.build_s = max(r["build_s"] for r in readies)
        self.run.first_step_s = max(r["first_step_s"] for r in readies)
        self.run.info = readies[0]["info"]
        self.warm_s = max(statistics.median(r["warm_s"]) if r["warm_s"] else r["first_step_s"]
                          for r in readies)

    @property
    def ok(self) -> bool:
        return self.run.error is None

    def calibrate(self, min_sample_s: float, max_steps: int = 50) -> None:
        self.run.steps_per_sample = max(1, min(max_steps, math.ceil(min_sample_s / self.warm_s)))

    def time_round(self) -> None:
        """Run ``steps_per_sample`` steps (in every worker at once) and record the mean step."""
        k = self.run.steps_per_sample
        try:
            for w in self.workers:
                w.send(("warm", None))
            for w in self.workers:
                w._recv(START_TIMEOUT_S)
            t0 = time.perf_counter()
            for w in self.workers:
                w.send(("run", k))
            for w in self.workers:
                w._recv(START_TIMEOUT_S)
            self.run.step_s.append((time.perf_counter() - t0) / k)
        except WorkerError as exc:
            self.run.error = str(exc)
            self.close()

    def collect_memory(self) -> None:
        try:
            mems = []
            for w in self.workers:
                w.send(("mem", None))
                mems.append(w._recv(60))
        except WorkerError:
            return
        self.run.peak_mib = sum(m["peak_mib"] for m in mems)
        self.run.runtime_mib = sum(m["runtime_mib"] for m in mems)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []


def run_config(workload: str, n: int, contenders: Sequence[str], *, rounds: int,
               threads: int = 1, warmup: int = 2, min_sample_s: float = 0.05,
               adam: str = "default", setting: dict[str, str] | None = None,
               log=print) -> dict[str, ContenderRun]:
    """Time every contender on N models of ``workload``, interleaved round by round.

    ``setting``: ``{"device": ..., "precision": ...}`` (``contenders.Setting``'s fields).
    """
    live: list[Contender] = []
    results: dict[str, ContenderRun] = {}
    try:
        for name in contenders:
            c = Contender(name, workload, n, threads=threads, warmup=warmup, adam=adam,
                          setting=setting)
            results[name] = c.run
            if c.ok:
                c.calibrate(min_sample_s)
                live.append(c)
            else:
                log(f"    {name}: failed: {c.run.error.splitlines()[0]}")
        for r in range(rounds):
            shift = r % len(live) if live else 0
            for c in live[shift:] + live[:shift]:
                if c.ok:
                    c.time_round()
        for c in live:
            if c.ok:
                c.collect_memory()
    finally:
        for c in live:
            c.close()
    return results


def measure_matmul(worker: Worker, reps: int = 3, size: int = 2048,
                   steps: int = 1) -> list[float]:
    """GFLOP/s of ``reps`` timings of ``steps`` ``size``^3 matmuls in a worker (the suite's
    peak; ``size``: :func:`matmul_size` of the worker's device)."""
    out = []
    for _ in range(reps):
        worker.send(("run", steps))
        seconds = worker._recv(600)
        out.append(2 * size**3 * steps / seconds / 1e9)
    return out


def matmul_worker(threads: int, setting: dict[str, str] | None = None) -> Worker:
    w = Worker({"contender": "matmul", "workload": None, "n": 0, "threads": threads,
                "warmup": 1, **(setting or {})})
    w.wait_ready()
    return w


def fits(workload: str, contender: str, n: int, cap_mib: float, threads: int = 1,
         adam: str = "default", setting: dict[str, str] | None = None,
         timeout_s: float = START_TIMEOUT_S) -> tuple[bool, float | None, str]:
    """Does one training step of N models stay within ``cap_mib`` above a bare process
    (on a GPU: within ``cap_mib`` of device memory)?  A worker not ready within
    ``timeout_s`` does not fit (its reason says so)."""
    w = Worker({"workload": workload, "n": n, "threads": threads, "warmup": 1,
                "contender": contender, "cap_mib": cap_mib, "adam": adam, "phases": False,
                **(setting or {})})
    try:
        w.wait_ready(timeout_s)
        w.send(("mem", None))
        peak = w._recv(60)["peak_mib"]
        return peak <= cap_mib, peak, ""
    except WorkerError as exc:
        w.kill()  # still building when its time ran out: no stop to wait for
        return False, None, str(exc).splitlines()[0]
    finally:
        w.close()


def largest_n(workload: str, contender: str, cap_mib: float, *, threads: int = 1,
              limit: int = 4096, adam: str = "default", setting: dict[str, str] | None = None,
              budget_s: float | None = None, on_probe=None, log=print) -> dict[str, Any]:
    """HFTA's search for the largest N that fits: double N until it fails, then bisect.

    ``budget_s``: stop probing once this many seconds are spent (each probe gets what is
    left); ``largest_n`` is then the largest N seen to fit, and ``exact`` is False (the
    answer lies below ``smallest_failing``, or is unknown above it).  ``on_probe(result)``
    is called after every probe with the result so far (the suite saves it)."""
    probes: list[dict[str, Any]] = []
    started = time.perf_counter()
    lo, hi = 0, None
    result: dict[str, Any] = {"workload": workload, "contender": contender, "cap_mib": cap_mib,
                              "largest_n": 0, "limit": limit, "probes": probes,
                              "budget_s": budget_s, "exact": False, "smallest_failing": None}

    def left() -> float:
        return START_TIMEOUT_S if budget_s is None else budget_s - (
            time.perf_counter() - started)

    def probe(n: int) -> bool | None:
        """Whether N fits; None where the budget ran out before or during the probe."""
        if left() <= 0:
            return None
        ok, peak, why = fits(workload, contender, n, cap_mib, threads, adam, setting,
                             timeout_s=left())
        if not ok and peak is None and left() <= 0:
            log(f"    N={n:<5} not decided: the search's {budget_s:.0f} s budget ran out")
            return None
        probes.append({"n": n, "fits": ok, "peak_mib": peak, "why": why})
        log(f"    N={n:<5} {'fits' if ok else 'does not fit'}"
            + (f" ({peak:.0f} MiB)" if peak is not None else f" ({why})"))
        if on_probe is not None:
            on_probe(dict(result, largest_n=max([lo] + [p["n"] for p in probes if p["fits"]])))
        return ok

    n, complete = 1, True
    while n <= limit:
        ok = probe(n)
        if ok is None:
            complete = False
            break
        if ok:
            lo, n = n, n * 2
        else:
            hi = n
            break
    if hi is not None and complete:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = probe(mid)
            if ok is None:
                complete = False
                break
            if ok:
                lo = mid
            else:
                hi = mid
    result.update(largest_n=lo, smallest_failing=hi, exact=complete and hi is not None)
    return result
