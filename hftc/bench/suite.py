"""The benchmark suite: every workload, every N, every contender, in one run.

``python -m hftc bench`` (or ``hftc bench``) runs :func:`run_suite` and
writes ``<results>/<name>.json`` (:data:`RESULTS_DIR`); :mod:`hftc.bench.report` turns that
into the tables and plots of ``docs/BENCHMARKS.md``.

Per workload, in order: the peak fp32 matmul rate (a 2048^3 matmul in a worker
with the contenders' thread count; again at the end of the run), the FLOPs of one
model's training step (``torch.utils.flop_counter.FlopCounterMode`` over forward,
loss and backward, with a corrected formula for grouped convolutions' backward;
the optimizer's elementwise work is not counted), then for
each N all contenders side by side (``runner.run_config``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import runner
from .contenders import CONTENDERS, OPT_IN
from .workloads import WORKLOADS

# A source checkout keeps its runs in benchmarks/results/ (docs/BENCHMARKS.md cites them);
# an installed hftc writes into the working directory.
_CHECKOUT_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RESULTS_DIR = _CHECKOUT_RESULTS if _CHECKOUT_RESULTS.is_dir() else Path("hftc-bench-results")


@dataclass
class SuiteConfig:
    """What to run. ``default_config(quick)`` gives the two standard suites."""

    workloads: list[str]
    sizes: dict[str, list[int]]
    contenders: list[str]
    rounds: dict[str, int]
    compile_sizes: dict[str, list[int]] = field(default_factory=dict)
    threads: int = 1
    cores: int = 1                     # workers confined to this many CPUs (0: not pinned)
    adam: str = "default"              # "fused": fused=True for stock and hftc Adam
    device: str = "cpu"                # or "cuda": every contender on the GPU
    precision: str = "fp32"            # or "bf16": forward and loss under autocast
    min_sample_s: float = 0.05
    max_n: list[dict[str, Any]] = field(default_factory=list)  # {workload, contender, cap_mib}
    max_n_budget_s: float | None = None  # seconds per largest-N search (None: no limit)
    name: str = "full"


def default_config(quick: bool = False, device: str = "cpu") -> SuiteConfig:
    """The full suite (< 30 min on the 2-core development machine) or ``--quick`` (< 3 min),
    with the workloads' sizes for ``device`` (``Workload.on``)."""
    on = {name: w.on(device) for name, w in WORKLOADS.items()}
    if quick:
        names = ["mlp", "lenet5"]
        return SuiteConfig(
            workloads=names,
            sizes={w: list(on[w].quick_sizes) for w in names},
            contenders=default_contenders(device),
            rounds={w: 3 for w in names},
            compile_sizes={"mlp": [8]},
            device=device,
            name="quick",
        )
    names = list(WORKLOADS)
    return SuiteConfig(
        workloads=names,
        sizes={w: list(on[w].sizes) for w in names},
        contenders=default_contenders(device),
        rounds={w: on[w].rounds for w in names},
        compile_sizes={w: list(on[w].compile_sizes) for w in names},
        max_n=[{"workload": "pointnet", "contender": "hftc", "cap_mib": 1024},
               {"workload": "pointnet", "contender": "hand-fused", "cap_mib": 1024}],
        device=device,
    )


def default_contenders(device: str) -> list[str]:
    """Every contender that runs on ``device`` (concurrent-mps: a GPU's only), but the
    opt-in ones (hftc+ckpt)."""
    return [c for c in CONTENDERS
            if (device != "cpu" or c != "concurrent-mps") and c not in OPT_IN]


@contextlib.contextmanager
def mps_daemon(log=print) -> Iterator[str | None]:
    """CUDA's MPS control daemon for the concurrent-mps contender, in a private pipe
    directory; yields None (and why, in the log) where it cannot be started."""
    binary = shutil.which("nvidia-cuda-mps-control")
    if binary is None:
        log("MPS: nvidia-cuda-mps-control not found; concurrent-mps is not run")
        yield None
        return
    root = tempfile.mkdtemp(prefix="hftc-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in env.values():
        os.makedirs(d)
    proc = subprocess.run([binary, "-d"], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)
    if proc.returncode != 0:
        log(f"MPS: the daemon did not start ({proc.stderr.strip() or proc.returncode}); "
            "concurrent-mps is not run")
        yield None
        return
    runner.MPS_ENV.update(env)
    try:
        yield root
    finally:
        runner.MPS_ENV.clear()
        subprocess.run([binary], input="quit\n", env={**os.environ, **env}, text=True,
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def _machine(device: str = "cpu") -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) / 2**20
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    gpu = None
    if device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        gpu = {"name": props.name, "memory_gib": props.total_memory / 2**30,
               "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
               **_nvidia_smi()}
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "git_commit": commit}


def _nvidia_smi() -> dict[str, str]:
    """The driver version and the card's name as ``nvidia-smi`` reports them ({} without it)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return {}
    try:
        proc = subprocess.run([binary, "--query-gpu=name,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    first = proc.stdout.strip().splitlines()[:1]
    if proc.returncode != 0 or not first or "," not in first[0]:
        return {}
    name, driver = (v.strip() for v in first[0].rsplit(",", 1))
    return {"smi_name": name, "driver": driver}


def _load() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return []


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation,
                         transposed, output_padding, groups, output_mask, out_shape=None,
                         **kwargs) -> int:
    """FLOPs of ``aten.convolution_backward``: each of grad-input and grad-weight costs what
    the forward costs.  (torch 2.13's own formula ignores ``groups`` and counts a depthwise
    convolution's backward ``groups`` times too high: 65x for MobileNetV2's.)"""
    spatial = 1
    for d in (x_shape if transposed else grad_out_shape)[2:]:
        spatial *= d
    batch = grad_out_shape[0]
    per_output = 1
    for d in w_shape[1:]:
        per_output *= d
    channels = w_shape[0]
    forward = 2 * batch * spatial * channels * per_output
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def flops_per_model_step(workload: str, device: str = "cpu") -> float:
    """FLOPs of one model's forward + loss + backward on one batch (FlopCounterMode),
    counted on the CPU at the workload's sizes for ``device``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from .contenders import make_models

    w = WORKLOADS[workload].on(device)
    model = make_models(w, 1)[0]
    x, y = w.inputs()
    mapping = {torch.ops.aten.convolution_backward: _conv_backward_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        w.loss(model(x), y).backward()
    return float(counter.get_total_flops())


def write_results(out: Path, result: dict[str, Any]) -> None:
    """Write the results JSON whole or not at all: a run its time limit ends mid-write
    (scripts/gpu_bench.sh's parts) keeps the last save for the merge to read."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(result, indent=1))
    os.replace(partial, out)


def run_suite(cfg: SuiteConfig, *, log=print, out: Path | None = None) -> dict[str, Any]:
    """Run the suite; return (and write to ``out``, if given) the results as JSON data."""
    import torch

    torch.set_num_threads(cfg.threads)
    cpus = runner.set_cpus(cfg.cores, cfg.threads)
    setting = {"device": cfg.device, "precision": cfg.precision}
    on_gpu = cfg.device != "cpu"
    started = time.time()
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "machine": _machine(cfg.device),
        "threads": cfg.threads,
        "cpus": cpus,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        # The command that made this file, as typed (the report lists every part's).
        "commands": [shlex.join(["python", "-m", "hftc", *sys.argv[1:]])
                     if Path(sys.argv[0]).name in ("__main__.py", "hftc")
                     else shlex.join(sys.argv)],
        "load_start": _load(),
        "peak_gflops": [],
        "workloads": {},
        "max_n": [],
    }

    def save():
        if out is not None:
            write_results(out, result)

    gpu = result["machine"]["gpu"]
    log(f"hftc bench ({cfg.name}): {result['machine']['cpu']}, {os.cpu_count()} cores, "
        + (f"{gpu['name']}, " if gpu else "")
        + f"torch {torch.__version__}, {cfg.device}, {cfg.precision}, "
        f"{cfg.threads} intra-op thread(s) per process, "
        f"workers on CPU(s) {cpus or 'any'}, "
        f"Adam: {cfg.adam}, "
        f"load {', '.join(f'{v:.1f}' for v in result['load_start'])}")
    contenders = list(cfg.contenders)
    with contextlib.ExitStack() as stack:
        if "concurrent-mps" in contenders:
            if not on_gpu or stack.enter_context(mps_daemon(log)) is None:
                contenders.remove("concurrent-mps")
        result["contenders"] = contenders
        peak_worker = runner.matmul_worker(cfg.threads, setting)
        stack.callback(peak_worker.close)
        _run_workloads(cfg, contenders, setting, peak_worker, result, save, log)
    result["load_end"] = _load()
    result["wall_s"] = time.time() - started
    save()
    log(f"\ndone in {result['wall_s'] / 60:.1f} min; load "
        f"{', '.join(f'{v:.1f}' for v in result['load_end'])}")
    return result


def _run_workloads(cfg: SuiteConfig, contenders: list[str], setting: dict[str, str],
                   peak_worker: runner.Worker, result: dict[str, Any], save, log) -> None:
    """Every workload's configurations, then the largest-N searches (into ``result``)."""
    on_gpu = cfg.device != "cpu"
    matmul = {"size": runner.matmul_size(cfg.device, cfg.precision),
              "steps": 10 if on_gpu else 1}
    result["matmul_size"] = matmul["size"]
    for name in cfg.workloads:
        w = WORKLOADS[name].on(cfg.device)
        peak = runner.measure_matmul(peak_worker, **matmul)
        result["peak_gflops"] += peak
        flops = flops_per_model_step(name, cfg.device)
        entry = {"batch": w.batch, "note": w.note, "flops_per_model_step": flops,
                 "peak_gflops": peak, "configs": []}
        result["workloads"][name] = entry
        log(f"\n{name}: batch {w.batch}, {flops / 1e9:.3f} GFLOP per model step; "
            f"peak matmul now {max(peak):.1f} GFLOP/s" + (f"  ({w.note})" if w.note else ""))
        for n in cfg.sizes[name]:
            here = [c for c in contenders
                    if c != "hftc+compile" or n in cfg.compile_sizes.get(name, [])]
            runs = runner.run_config(name, n, here, rounds=cfg.rounds[name],
                                     threads=cfg.threads, min_sample_s=cfg.min_sample_s,
                                     warmup=w.warmup, adam=cfg.adam, setting=setting, log=log)
            entry["configs"].append({"n": n, "load": _load(),
                                     "contenders": {k: asdict(v) for k, v in runs.items()}})
            log(_config_line(name, n, w.batch, runs))
            save()
    for search in cfg.max_n:
        cap = search["cap_mib"]
        if on_gpu and not cap:  # the whole device, as HFTA searched
            import torch

            cap = search["cap_mib"] = (
                torch.cuda.get_device_properties(torch.device(cfg.device)).total_memory / 2**20)
        log(f"\nlargest N of {search['workload']} ({search['contender']}) within "
            f"{cap:.0f} MiB:")
        result["max_n"].append({**search, "largest_n": 0, "probes": []})

        def saved(partial: dict[str, Any]) -> None:  # a search cut short keeps its probes
            result["max_n"][-1] = partial
            save()

        found = runner.largest_n(search["workload"], search["contender"], cap,
                                 threads=cfg.threads, adam=cfg.adam, setting=setting,
                                 budget_s=cfg.max_n_budget_s, on_probe=saved, log=log)
        result["max_n"][-1] = found
        log(f"    -> N = {found['largest_n']}")
        save()
    result["peak_gflops"] += runner.measure_matmul(peak_worker, **matmul)


def _config_line(name: str, n: int, batch: int, runs: dict[str, runner.ContenderRun]) -> str:
    parts = []
    serial = runs.get("serial")
    base = serial.median() if serial and serial.step_s else None
    for c, r in runs.items():
        if not r.step_s:
            parts.append(f"{c} failed")
            continue
        sps = n * batch / r.median()
        ratio = f" {base / r.median():.2f}x" if base else ""
        parts.append(f"{c} {sps:,.0f}/s{ratio}")
    return f"  N={n:<3} " + " | ".join(parts)
