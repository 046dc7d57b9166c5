"""Results JSON -> markdown tables and PNG plots (docs/BENCHMARKS.md).

``python -m hftc.bench.report RESULTS.json [--docs docs/BENCHMARKS.md] [--plots docs]``
prints the tables; with ``--docs`` it replaces the part of the file between
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` with them, so the prose
around the numbers stays hand-written.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CommandLineError
from .contenders import CONTENDERS, FUSED

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

#: The targets of issues 7 and 29: (workload, N, contender hftc is compared with, ratio).
TARGETS = [
    ("mlp", 32, "serial", 4.0), ("mlp", 32, "concurrent", 4.0),
    ("mlp", 32, "torch.func", 1.1), ("mlp", 32, "hand-fused", 0.95),
    ("lenet5", 16, "serial", 1.3), ("lenet5", 16, "torch.func", 1.3),
    # issue 29: the models users train, at N = 4, with the default options
    ("convnext", 4, "serial", 1.2), ("efficientnet", 4, "serial", 1.2),
    ("style_transfer", 4, "serial", 1.0), ("lstm_lm", 4, "serial", 1.0),
    ("gpt", 4, "serial", 1.0),
]


# --------------------------------------------------------------------------- numbers


def throughput(run: dict[str, Any], n: int, batch: int) -> tuple[float, float, float] | None:
    """Samples/s summed over the N models: (median, min, max) over rounds."""
    times = run.get("step_s") or []
    if not times:
        return None
    return (n * batch / statistics.median(times), n * batch / max(times), n * batch / min(times))


def _paired_times(result: dict, workload: str, n: int, a: str,
                  b: str) -> tuple[list[float], list[float]] | None:
    """``a``'s and ``b``'s step times (one per round) at ``workload`` N = ``n``, if both ran."""
    for cfg in result["workloads"].get(workload, {}).get("configs", []):
        if cfg["n"] != n:
            continue
        ra, rb = cfg["contenders"].get(a), cfg["contenders"].get(b)
        if ra and rb and ra.get("step_s") and rb.get("step_s"):
            return ra["step_s"], rb["step_s"]
    return None


def ratio(result: dict, workload: str, n: int, a: str, b: str) -> float | None:
    """Median step time of ``b`` / median step time of ``a`` (a's speedup over b)."""
    times = _paired_times(result, workload, n, a, b)
    return None if times is None else statistics.median(times[1]) / statistics.median(times[0])


def paired_ratios(result: dict, workload: str, n: int, a: str,
                  b: str) -> tuple[float, float, float] | None:
    """``b``'s step time / ``a``'s, round by round: (median, min, max) over the rounds.

    Both ran in the same round, seconds apart, so a slow stretch of the machine moves
    both: the spread says how much of a ratio of medians is the machine's noise.
    """
    times = _paired_times(result, workload, n, a, b)
    if times is None:
        return None
    ratios = [tb / ta for ta, tb in zip(*times)]
    return statistics.median(ratios), min(ratios), max(ratios)


def ratio_interval(result: dict, workload: str, n: int, a: str, b: str, *,
                   level: float = 0.95, resamples: int = 2000) -> tuple[float, float] | None:
    """A bootstrap interval of :func:`ratio`: the rounds resampled with replacement, each
    resample's ratio of medians, and the central ``level`` of those (fixed seed).

    Rounds are resampled whole (``a``'s and ``b``'s sample of a round together), as
    they ran seconds apart.  With the suite's 4-12 rounds the interval is coarse, but
    it tells a ratio that the machine's noise could put on either side of a target
    (0.98x over rounds of 0.86-1.15x) from one it could not.
    """
    times = _paired_times(result, workload, n, a, b)
    if times is None or len(times[0]) < 2:
        return None
    ta, tb = (np.asarray(t, dtype=float) for t in times)
    picks = np.random.default_rng(0).integers(0, len(ta), size=(resamples, len(ta)))
    ratios = np.median(tb[picks], axis=1) / np.median(ta[picks], axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def _verdict(got: float | None, interval: tuple[float, float] | None, want: float) -> str:
    """yes / **no** by the ratio of medians; "within noise" where the interval spans ``want``."""
    if got is None:
        return "n/a"
    met = "yes" if got >= want else "**no**"
    if interval is not None and interval[0] < want <= interval[1]:
        met += " (within noise)"
    return met


def _fmt_interval(interval: tuple[float, float] | None) -> str:
    return "n/a" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}x"


def peak(result: dict) -> tuple[float, float, float]:
    values = result["peak_gflops"]
    return statistics.median(values), min(values), max(values)


def _fmt_rate(t: tuple[float, float, float] | None) -> str:
    if t is None:
        return "n/a"
    return f"{t[0]:,.0f} [{t[1]:,.0f}-{t[2]:,.0f}]"


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _fmt_ratios(t: tuple[float, float, float] | None) -> str:
    return "n/a" if t is None else f"{t[0]:.2f}x [{t[1]:.2f}-{t[2]:.2f}]"


# --------------------------------------------------------------------------- tables


def _contenders(result: dict) -> list[str]:
    seen = []
    for entry in result["workloads"].values():
        for cfg in entry["configs"]:
            seen += [c for c in cfg["contenders"] if c not in seen]
    return [c for c in CONTENDERS if c in seen]


def _on_gpu(result: dict) -> bool:
    return result["config"].get("device", "cpu") != "cpu"


def markdown(result: dict) -> str:
    m, cfg = result["machine"], result["config"]
    pk = peak(result)
    device, precision = cfg.get("device", "cpu"), cfg.get("precision", "fp32")
    gpu = m.get("gpu")
    where = (f"**{gpu['name']}** ({gpu['memory_gib']:.0f} GiB, CUDA {gpu['cuda']}"
             + (f", driver {gpu['driver']}" if gpu.get("driver") else "")
             + (f", cuDNN {gpu['cudnn']}" if gpu.get("cudnn") else "") + "), "
             if gpu else "")
    size = result.get("matmul_size", 2048)
    lines = [
        f"Run `{cfg['name']}` of {result['started']}, "
        f"{result.get('wall_s', 0) / 60:.1f} min: {where}{m['cpu']}, {m['cores']} cores, "
        f"{(m.get('memory_gib') or 0):.0f} GiB, Python {m['python']}, torch {m['torch']}, "
        f"hftc at `{m['git_commit']}`; device `{device}`, {precision}"
        + (" (forward and loss under `torch.autocast(bfloat16)`)" if precision == "bf16" else "")
        + f"; {result['threads']} intra-op thread{'s' * (result['threads'] != 1)} per process, "
        f"every worker on CPU(s) {result.get('cpus') or 'any'}; "
        f"Adam: {cfg.get('adam', 'default')}. "
        f"Load average (1, 5, 15 min) at the start "
        f"{', '.join(f'{v:.1f}' for v in result['load_start'])}, at the end "
        f"{', '.join(f'{v:.1f}' for v in result.get('load_end', []))}.",
        "",
        f"Peak {precision} matmul ({size}^3, {result['threads']} "
        f"thread{'s' * (result['threads'] != 1)}): "
        f"**{pk[0]:.1f} GFLOP/s** "
        f"median [{pk[1]:.1f}-{pk[2]:.1f}] over {len(result['peak_gflops'])} measurements "
        f"taken through the run.",
        "",
    ]
    commands = result.get("commands") or []
    if commands:
        lines += ["Made by:", "", "```", *commands, "```", ""]
    contenders = _contenders(result)
    lines += _targets_table(result)
    lines += _speedup_table(result)
    for name, entry in result["workloads"].items():
        lines += _workload_tables(name, entry, contenders, pk[0], _on_gpu(result))
    lines += _max_n_tables(result)
    return "\n".join(lines) + "\n"


def _targets_table(result: dict) -> list[str]:
    out = []
    for workload, n, other, want in TARGETS:
        # The issue-29 targets name the default options: hftc+defaults where the run has it.
        who = next((c for c in ("hftc+defaults", "hftc")
                    if _ran(result, workload, n, (c, other))), None)
        if who is None:
            continue  # a run without that workload, N or contender says nothing of it
        got = ratio(result, workload, n, who, other)
        interval = ratio_interval(result, workload, n, who, other)
        out.append(f"| {workload} N={n}: {who} >= {want}x {other} | {_fmt_ratio(got)} | "
                   f"{_fmt_interval(interval)} | {_verdict(got, interval, want)} |")
    for who in ("hftc", "hftc+defaults"):
        worst = None
        for name, entry in result["workloads"].items():
            for cfg in entry["configs"]:
                r = ratio(result, name, cfg["n"], who, "serial") if cfg["n"] >= 2 else None
                if r is not None and (worst is None or r < worst[0]):
                    worst = (r, name, cfg["n"])
        if worst:
            interval = ratio_interval(result, worst[1], worst[2], who, "serial")
            out.append(f"| every workload, every N >= 2: {who} >= 1.0x serial | lowest "
                       f"{worst[0]:.2f}x ({worst[1]} N={worst[2]}) | "
                       f"{_fmt_interval(interval)} | {_verdict(worst[0], interval, 1.0)} |")
    if _on_gpu(result):
        out += _gpu_targets(result)
    if not out:
        return []
    return ["### Targets", "",
            "*95% interval*: of the ratio of medians, over the rounds resampled "
            "(bootstrap); *within noise*: the interval spans the target.", "",
            "| target | measured (ratio of medians) | 95% interval | met |", "|---|---|---|---|",
            *out, ""]


def _ran(result: dict, workload: str, n: int, contenders: tuple[str, ...]) -> bool:
    """Whether the run measured every one of ``contenders`` on ``workload`` at N = ``n``."""
    configs = result["workloads"].get(workload, {}).get("configs", [])
    return any(cfg["n"] == n and all(cfg["contenders"].get(c) for c in contenders)
               for cfg in configs)


#: HFTA's lowest published training speedup over serial on a GPU (ANCHORS.md: 2.42-11.50x
#: on V100/RTX6000/A100 across its workloads); per-workload figures are not in ANCHORS.md.
HFTA_GPU_SERIAL = 2.42


def _gpu_targets(result: dict) -> list[str]:
    """On a GPU: ResNet-18, PointNet, MobileNetV2 at their largest N measured."""
    out = []
    for name in ("resnet18", "pointnet", "mobilenet_v2"):
        configs = result["workloads"].get(name, {}).get("configs", [])
        if not configs:
            continue
        n = max(c["n"] for c in configs)
        for other, want in (("serial", HFTA_GPU_SERIAL), ("torch.func", 1.5)):
            if not _ran(result, name, n, ("hftc", other)):
                continue
            got = ratio(result, name, n, "hftc", other)
            interval = ratio_interval(result, name, n, "hftc", other)
            label = "HFTA's lowest published" if other == "serial" else ""
            out.append(f"| {name} N={n} (largest run): hftc >= {want}x {other}"
                       f"{' (' + label + ')' if label else ''} | {_fmt_ratio(got)} | "
                       f"{_fmt_interval(interval)} | {_verdict(got, interval, want)} |")
    return out


def _speedup_table(result: dict) -> list[str]:
    ran = _contenders(result)
    # hftc's row; a run of only the default options (hftc+defaults) gets its own.
    who = "hftc" if "hftc" in ran or "hftc+defaults" not in ran else "hftc+defaults"
    others = ["serial", "concurrent", "concurrent-mps", "torch.func", "hand-fused"]
    if "concurrent-mps" not in ran:  # a GPU's contender only
        others.remove("concurrent-mps")
    defaults = who == "hftc" and "hftc+defaults" in ran  # both: a column for the defaults
    out = [f"### {who} (eager) against each baseline: speedup = baseline median step time / "
           f"{who} median step time", "",
           f"*vs serial, per round*: serial's step time / {who}'s in the same round, median "
           "[min-max] over the rounds.", "",
           "| workload | N | " + " | ".join(f"vs {o}" for o in others)
           + " | vs serial, per round | hftc+compile vs hftc |"
           + (" hftc+defaults vs serial, per round |" if defaults else ""),
           "|---|---|" + "---|" * (len(others) + 2 + defaults)]
    for name, entry in result["workloads"].items():
        for cfg in entry["configs"]:
            n = cfg["n"]
            cells = [_fmt_ratio(ratio(result, name, n, who, o)) for o in others]
            cells.append(_fmt_ratios(paired_ratios(result, name, n, who, "serial")))
            comp = ratio(result, name, n, "hftc+compile", "hftc")
            cells.append(_fmt_ratio(comp) if comp else "")
            if defaults:
                cells.append(_fmt_ratios(paired_ratios(result, name, n, "hftc+defaults",
                                                       "serial")))
            out.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return out + [""]


def _workload_tables(name: str, entry: dict, contenders: list[str], peak_gflops: float,
                     on_gpu: bool = False) -> list[str]:
    batch, flops = entry["batch"], entry["flops_per_model_step"]
    out = [f"### {name}", ""]
    if entry.get("note"):
        out += [f"*{entry['note']}.*", ""]
    out += [f"Batch {batch}; one model's forward + loss + backward = "
            f"{flops / 1e9:.3f} GFLOP (FlopCounterMode).", "",
            "Throughput, samples/s summed over the N models: median [min-max] over rounds.", "",
            "| N | " + " | ".join(contenders) + " |", "|---|" + "---|" * len(contenders)]
    for cfg in entry["configs"]:
        n = cfg["n"]
        cells = []
        for c in contenders:
            run = cfg["contenders"].get(c)
            if run is None:
                cells.append("")
            elif run.get("error"):
                cells.append("failed")
            else:
                cells.append(_fmt_rate(throughput(run, n, batch)))
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "Peak device memory, MiB (`torch.cuda.max_memory_allocated`); for the "
            "concurrent contenders, the sum over their N processes (each of which also holds "
            "a CUDA context, not counted)." if on_gpu else
            "Peak memory, MiB above a bare worker process (RSS high-water mark); for "
            "concurrent, the sum over its N processes, each of which also holds its own torch "
            "runtime (in brackets).", "",
            "| N | " + " | ".join(contenders) + " |", "|---|" + "---|" * len(contenders)]
    for cfg in entry["configs"]:
        cells = []
        for c in contenders:
            run = cfg["contenders"].get(c)
            if not run or run.get("peak_mib") is None:
                cells.append("")
            elif c == "concurrent" and not on_gpu:
                cells.append(f"{run['peak_mib']:.0f} (+{run['runtime_mib']:.0f})")
            else:
                cells.append(f"{run['peak_mib']:.0f}")
        out.append(f"| {cfg['n']} | " + " | ".join(cells) + " |")
    fused = [c for c in contenders if c in FUSED]
    out += ["", f"Efficiency: achieved model GFLOP/s (N x FLOPs of one model's step / median "
            f"step time) and its fraction of the peak matmul rate ({peak_gflops:.1f} GFLOP/s).",
            "", "| N | " + " | ".join(["serial"] + fused) + " |",
            "|---|" + "---|" * (len(fused) + 1)]
    for cfg in entry["configs"]:
        n = cfg["n"]
        cells = []
        for c in ["serial"] + fused:
            run = cfg["contenders"].get(c)
            if not run or not run.get("step_s"):
                cells.append("")
                continue
            rate = n * flops / statistics.median(run["step_s"]) / 1e9
            cells.append(f"{rate:.1f} ({rate / peak_gflops:.0%})")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    comp = [(cfg["n"], cfg["contenders"]["hftc+compile"]) for cfg in entry["configs"]
            if "hftc+compile" in cfg["contenders"]]
    hftc = [(cfg["n"], cfg["contenders"]["hftc"]) for cfg in entry["configs"]
            if "hftc" in cfg["contenders"]]
    if hftc:
        out += ["", "Set-up: `hftc.fuse` + first call (trace, match, fuse, codegen): "
                + ", ".join(f"N={n} {r['build_s']:.2f} s" for n, r in hftc) + "."]
    if comp:
        out += ["", "torch.compile: first step (dynamo + inductor, forward and backward; the "
                "inductor cache in /tmp may have been warm): "
                + ", ".join(f"N={n} {r['first_step_s']:.1f} s" for n, r in comp)
                + ". Steady-state steps only are timed."]
    out += _phase_table(hftc)
    out += _checkpoint_table(entry)
    lowerings = {}
    for n, r in hftc:
        for node, chosen in (r.get("info") or {}).get("lowerings", {}).items():
            lowerings.setdefault(node, {})[n] = chosen
    if lowerings:
        out += ["", "Lowerings autotune chose (`hftc.fuse(..., autotune=True)`), per fused "
                "node: " + "; ".join(
                    f"`{node}` " + ", ".join(f"N={n} {c}" for n, c in by_n.items())
                    for node, by_n in lowerings.items()) + "."]
    fallbacks = {f for _, r in hftc for f in (r.get("info") or {}).get("fallbacks", [])}
    if fallbacks:
        out += ["", "hftc ran model by model (no rule fuses them): "
                + "; ".join(sorted(fallbacks)) + "."]
    return out + [""]


def _checkpoint_table(entry: dict) -> list[str]:
    """hftc+ckpt against hftc at each N both ran: peak memory and step time."""
    rows = []
    for cfg in entry["configs"]:
        plain, ckpt = cfg["contenders"].get("hftc"), cfg["contenders"].get("hftc+ckpt")
        if not (plain and ckpt and plain.get("step_s") and ckpt.get("step_s")):
            continue
        mem = ("" if plain.get("peak_mib") is None or ckpt.get("peak_mib") is None else
               f"{plain['peak_mib']:.0f} -> {ckpt['peak_mib']:.0f}"
               + (f" ({ckpt['peak_mib'] / plain['peak_mib']:.2f}x)" if plain["peak_mib"] > 0
                  else ""))
        slower = statistics.median(ckpt["step_s"]) / statistics.median(plain["step_s"])
        rows.append(f"| {cfg['n']} | {mem} | {slower:.2f}x |")
    if not rows:
        return []
    return ["", "Activation checkpointing (`hftc.fuse(..., checkpoint=True)`, contender "
            "hftc+ckpt) against hftc: peak memory, MiB, and step time (hftc+ckpt / hftc).",
            "", "| N | peak memory hftc -> hftc+ckpt | step time |", "|---|---|---|", *rows]


def _phase_table(hftc: list[tuple[int, dict]]) -> list[str]:
    """Where hftc's step goes: forward, backward, optimizer; GEMM / optimizer / other time."""
    rows = [(n, (r.get("info") or {}).get("phases")) for n, r in hftc]
    rows = [(n, p) for n, p in rows if p]
    if not rows:
        return []
    out = ["", "Where hftc's step goes: median ms of forward + loss, backward and optimizer "
           "step (+ zero_grad), timed apart after the warm-up; and the step's self CPU time "
           "(torch.profiler) in matrix products and convolutions, in the optimizer step and "
           "in everything else (elementwise tails, layout copies, Python).", "",
           "| N | forward + loss | backward | optimizer | GEMM/conv | optimizer | other |",
           "|---|---|---|---|---|---|---|"]
    for n, p in rows:
        fractions = [f"{p[k]:.0%}" if k in p else "" for k in
                     ("gemm_fraction", "optimizer_fraction", "other_fraction")]
        out.append(f"| {n} | {p['forward_loss_s'] * 1e3:.2f} | {p['backward_s'] * 1e3:.2f} | "
                   f"{p['optimizer_s'] * 1e3:.2f} | " + " | ".join(fractions) + " |")
    return out


def _max_n_tables(result: dict) -> list[str]:
    if not result.get("max_n"):
        return []
    cap = ("device memory cap (MiB)" if _on_gpu(result)
           else "memory cap (MiB above a bare process)")
    out = ["### Largest N that fits", "",
           "Doubling N until a step does not fit, then bisecting (HFTA's search); *probes*: "
           "N: fits or not, and the step's peak MiB. A search cut by its time budget says "
           "so: the largest N seen to fit is then a lower bound.", "",
           f"| workload | contender | {cap} | largest N | probes |",
           "|---|---|---|---|---|"]
    for s in result["max_n"]:
        probes = ", ".join(
            f"{p['n']}: {'ok' if p['fits'] else 'no'}"
            + (f" {p['peak_mib']:.0f}" if p.get("peak_mib") is not None else "")
            for p in s["probes"])
        bound = ""
        if s.get("budget_s") is not None and not s.get("exact", True):
            bound = (f" (at least; the {s['budget_s']:.0f} s budget ran out"
                     + (f", below {s['smallest_failing']}" if s.get("smallest_failing")
                        else "") + ")")
        out.append(f"| {s['workload']} | {s['contender']} | {s['cap_mib']:.0f} | "
                   f"**{s['largest_n']}**{bound} | {probes} |")
    return out + [""]


# --------------------------------------------------------------------------- plots

#: One colour per contender in every panel.
COLORS = {"serial": "tab:blue", "concurrent": "tab:orange", "concurrent-mps": "tab:olive",
          "torch.func": "tab:green", "hand-fused": "tab:red", "hftc": "tab:purple",
          "hftc+compile": "tab:brown", "hftc+ckpt": "tab:pink", "hftc+step": "tab:cyan",
          "hftc+defaults": "tab:gray"}


def plot(result: dict, out_dir: Path, stem: str = "bench") -> list[Path]:
    """Throughput vs N per contender (one panel per workload) and peak memory vs N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    contenders = _contenders(result)
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    paths = []
    for kind in ("throughput", "memory"):
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names):
            entry = result["workloads"][name]
            for c in contenders:
                xs, ys, lo, hi = [], [], [], []
                for cfg in entry["configs"]:
                    run = cfg["contenders"].get(c)
                    if not run:
                        continue
                    if kind == "throughput":
                        t = throughput(run, cfg["n"], entry["batch"])
                        if t is None:
                            continue
                        xs.append(cfg["n"])
                        ys.append(t[0])
                        lo.append(t[0] - t[1])
                        hi.append(t[2] - t[0])
                    elif run.get("peak_mib") is not None:
                        # concurrent: its N processes' own torch runtimes are part of the cost
                        extra = ((run.get("runtime_mib") or 0)
                                 if c == "concurrent" and not _on_gpu(result) else 0)
                        xs.append(cfg["n"])
                        ys.append(max(run["peak_mib"] + extra, 1e-1))
                if not xs:
                    continue
                style = "-o" if c.startswith("hftc") else "--s"
                color = COLORS.get(c)
                width = 2.2 if c.startswith("hftc") else 1.2
                if kind == "throughput":
                    ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, ms=4, capsize=2, label=c,
                                color=color, lw=width)
                else:
                    ax.plot(xs, ys, style, ms=4, label=c, color=color, lw=width)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name} (batch {entry['batch']})")
            ax.set_xlabel("N (models)")
            ax.set_ylabel("samples/s (sum over N)" if kind == "throughput"
                          else "peak device MiB" if _on_gpu(result) else
                          "peak MiB above a bare process\n(concurrent: + N runtimes)")
            ax.grid(True, which="both", alpha=0.3)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        handles, labels = max((ax.get_legend_handles_labels() for ax in axes.flat),
                              key=lambda hl: len(hl[1]))
        # A legend row and a title as wide as three panels: wrapped to the figure's width,
        # and the file cut to what is drawn (bbox_inches="tight"), so neither is clipped.
        if labels:  # none where the runs only searched the largest N
            fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 2 * cols),
                       bbox_to_anchor=(0.5, 0.0))
        gpu = result["machine"].get("gpu")
        where = (f"{gpu['name']}, {result['config'].get('precision', 'fp32')}" if gpu else
                 f"{result['machine']['cpu']}, one core per contender, "
                 f"{result['threads']} thread/process")
        title = (f"hftc bench ({result['config']['name']}): training-step {kind} vs N; "
                 f"{where}; median and min-max over rounds" if kind == "throughput" else
                 f"hftc bench ({result['config']['name']}): peak memory vs N; {where}")
        fig.suptitle(textwrap.fill(title, width=int(14 * fig.get_figwidth())))
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{stem}_{kind}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


#: The block of docs/BENCHMARKS.md a GPU's runs go to, by the card's model: the first GPU
#: run's (an H100) is ``cuda``; every other card gets its own, ``cuda-<model>``.
CARD_BLOCKS = {"h100": "cuda"}


def card_block(gpu_name: str | None) -> str:
    """``cuda`` for an H100 (and a run whose card is unknown), ``cuda-h200`` for an
    "NVIDIA H200", ``cuda-a100`` for an "NVIDIA A100-SXM4-40GB", ...: one block per card,
    so that one card's run never overwrites another's numbers."""
    name = (gpu_name or "").replace("NVIDIA", "").strip()
    if not name:
        return "cuda"
    model = re.search(r"\b[A-Z]{1,2}\d{2,4}\b", name)
    slug = (model.group() if model else re.sub(r"[^0-9a-z]+", "-", name.lower())).lower()
    return CARD_BLOCKS.get(slug, f"cuda-{slug.strip('-')}")


def docs_block(config: dict[str, Any], gpu_name: str | None = None) -> str:
    """The BENCHMARKS.md block (and plot-file infix) of a run's ``config`` (a
    ``SuiteConfig`` as a dict): "" for the CPU fp32 default Adam suite on one pinned core,
    else e.g. "cuda" (:func:`card_block` of ``gpu_name``), "cuda-h200-bf16",
    "adam-fused", "cores-2"."""
    device, precision = config.get("device", "cpu"), config.get("precision", "fp32")
    cores, threads = config.get("cores", 1), config.get("threads", 1)
    adam = config.get("adam", "default")
    parts = []
    if device != "cpu":
        parts.append(card_block(gpu_name))
    elif cores != 1 or threads != 1:
        parts.append(f"cores-{cores or 'all'}" + (f"-threads-{threads}"
                                                  if threads != max(1, cores) else ""))
    if precision != "fp32":
        parts.append(precision)
    if adam != "default":
        parts.append(f"adam-{adam}")
    return "-".join(parts)


def result_block(result: dict[str, Any]) -> str:
    """:func:`docs_block` of a results JSON: its configuration on its card."""
    return docs_block(result["config"], (result["machine"].get("gpu") or {}).get("name"))


def plot_stem(block: str) -> str:
    """The plots' file stem of a block: ``bench`` (``bench_throughput.png``), else
    ``bench_<block>``."""
    return f"bench_{block}" if block else "bench"


def markers(block: str = "") -> tuple[str, str]:
    """The comment lines around a generated block (``block`` names a second one)."""
    if not block:
        return BEGIN, END
    return f"<!-- bench:{block}:begin -->", f"<!-- bench:{block}:end -->"


def update_docs(doc: Path, text: str, block: str = "") -> None:
    """Replace the generated part of ``doc`` (between the block's markers) with ``text``;
    for a repository's docs/BENCHMARKS.md, the numbers of its README and guides too
    (:mod:`hftc.bench.docs_numbers`), all or nothing: where a page names a figure the new
    tables lack, no file is written and the error says which."""
    begin, end = markers(block)
    body = doc.read_text() if doc.exists() else f"# Benchmarks\n\n{begin}\n{end}\n"
    if begin not in body or end not in body:
        body = _with_new_block(body, block)
    head, rest = body.split(begin, 1)
    _, tail = rest.split(end, 1)
    body = f"{head}{begin}\n{text}{end}{tail}"
    root = doc.resolve().parent.parent
    if not (doc.name == "BENCHMARKS.md" and doc.resolve().parent.name == "docs"
            and (root / "README.md").exists()):
        doc.write_text(body)
        return
    # README's and the guides' numbers are generated from these tables
    from .docs_numbers import FigureError
    from .docs_numbers import update as update_numbers

    try:
        changed = update_numbers(root, benchmarks=body)
    except FigureError as exc:
        raise CommandLineError(
            f"{doc}: not updated (nor README.md and the guides): with these results "
            f"{exc}, a figure a page cites. Report the earlier runs of the block "
            f"{block or 'main'!r} with these (e.g. scripts/gpu_bench.sh merge OLD_DIR NEW_DIR), "
            f"or change the page's hftc:numbers name") from None
    for path in changed:
        if path.resolve() != doc.resolve():
            print(f"updated {path}")


def _with_new_block(body: str, block: str) -> str:
    """``body`` with empty markers for ``block``: after the block it extends (a run's
    "cuda-h200-bf16" after "cuda-h200"), else at the end."""
    begin, end = markers(block)
    parts = block.split("-")
    for k in range(len(parts) - 1, 0, -1):
        base_end = markers("-".join(parts[:k]))[1]
        if base_end in body:
            head, tail = body.split(base_end, 1)
            return f"{head}{base_end}\n\n{begin}\n{end}{tail}"
    return body.rstrip() + f"\n\n{begin}\n{end}\n"


def _merge_workload(old: dict | None, new: dict) -> dict:
    """A workload measured by two runs: the configurations of both, by N, the later
    run's where both measured an N (a part rerun at some N replaces those only)."""
    if old is None or not new["configs"]:
        return old or dict(new, configs=list(new["configs"]))
    by_n = {cfg["n"]: cfg for cfg in old["configs"]}
    by_n.update({cfg["n"]: cfg for cfg in new["configs"]})
    return dict(new, configs=[by_n[n] for n in sorted(by_n)])


def merge(results: list[dict]) -> dict:
    """Several runs of one kind (e.g. a GPU suite run workload by workload, each within a
    time limit, over one or more leases) as one, in the order they ran: their workloads
    (a workload two runs measured: each N from the later run that has it), peak-rate
    samples and largest-N searches together; the first run's machine and configuration
    (with every commit the runs were made at), the runs' wall times summed.  Runs on
    other devices or cards, or in other precisions, are refused."""
    kinds = {(r["config"].get("device", "cpu"), r["config"].get("precision", "fp32"),
              r["config"].get("adam", "default"), (r["machine"].get("gpu") or {}).get("name"))
             for r in results}
    if len(kinds) > 1:
        raise ValueError(f"cannot merge runs of different kinds (device, precision, adam, "
                         f"card): {sorted(kinds, key=str)}")
    results = sorted(results, key=lambda r: r.get("started", ""))
    first = results[0]
    commits = list(dict.fromkeys(r["machine"].get("git_commit", "") for r in results))
    merged = dict(first, workloads={}, peak_gflops=[], max_n=[], wall_s=0.0, commands=[],
                  machine=dict(first["machine"], git_commit=", ".join(filter(None, commits))))
    for r in results:
        merged["commands"] += r.get("commands", [])
        # A part that only searched the largest N has its workloads without configurations:
        # they do not replace another part's measurements.
        for name, entry in r["workloads"].items():
            merged["workloads"][name] = _merge_workload(merged["workloads"].get(name), entry)
        merged["peak_gflops"] += r["peak_gflops"]
        merged["max_n"] += r.get("max_n", [])
        merged["wall_s"] += r.get("wall_s", 0.0)
    merged["load_end"] = results[-1].get("load_end", [])
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hftc.bench.report")
    p.add_argument("results", type=Path, nargs="+",
                   help="results JSON; several runs of one kind are merged (merge())")
    p.add_argument("--docs", type=Path, help="update this markdown file between the markers")
    p.add_argument("--plots", type=Path, help="write the PNG plots into this folder")
    p.add_argument("--block", default="",
                   help="update the block with these markers ('auto': the runs' own, "
                        "e.g. cuda-h200-bf16 for bf16 runs on an H200)")
    p.add_argument("--stem", default=None,
                   help="plot file names: STEM_throughput.png, ... (default: bench, or "
                        "bench_BLOCK)")
    args = p.parse_args(argv)
    try:
        return _report(args)
    except (CommandLineError, ValueError) as exc:  # runs that cannot merge, a figure lost
        print(f"python -m hftc.bench.report: {exc}", file=sys.stderr)
        return 2


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as exc:  # e.g. cut mid-write by a time limit before saves were whole
        raise ValueError(f"{path}: not a results JSON ({exc})") from None


def _report(args: argparse.Namespace) -> int:
    result = merge([_load(path) for path in args.results])
    block = result_block(result) if args.block == "auto" else args.block
    text = markdown(result)
    if args.docs:  # first: where the tables cannot go in, no plot is replaced either
        update_docs(args.docs, text, block)
        print(f"updated {args.docs}")
    else:
        print(text)
    if args.plots:
        for path in plot(result, args.plots, args.stem or plot_stem(block)):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
