"""What a sweep shows and leaves: progress bars, the leaderboard, results.csv, best.pt,
best.json and curves.png (the learning curves of every trial)."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from .files import atomic_write
from .storage import SURPLUS

__all__ = ["leaderboard", "write_results", "progress_bars", "plot_curves", "summary"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _value(v: float) -> str:
    """A metric in the leaderboard: 4 decimals, or 4 digits where that would be a column
    of hundreds of characters (a trial whose loss grew to 1e172 without overflowing)."""
    return f"{v:.4f}" if abs(v) < 1e6 else f"{v:.4g}"


def _sorted_complete(study: optuna.Study) -> list[FrozenTrial]:
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None and math.isfinite(t.value)]
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return sorted(done, key=lambda t: (-t.value if maximize else t.value, t.number))


def leaderboard(study: optuna.Study, metric: str = "value", top: int = 10) -> str:
    """The ``top`` complete trials, best first, as a text table, and the count of each state."""
    ranked = _sorted_complete(study)[:top]
    names = sorted({k for t in ranked for k in t.params})
    header = ["rank", "trial", metric, "epochs", *names]
    rows = [[str(i + 1), str(t.number), _value(t.value), str(len(t.intermediate_values)),
             *(_fmt(t.params.get(k, "")) for k in names)] for i, t in enumerate(ranked)]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    lines.append(f"{len(study.get_trials(deepcopy=False))} trials: {summary}")
    return "\n".join(lines)


def write_csv(study: optuna.Study, path: Path, metric: str) -> None:
    """One row per trial: number, state, metric, epochs, hyper-parameters, seed, ..."""
    trials = study.get_trials(deepcopy=False)
    names = sorted({k for t in trials for k in t.params})
    header = ["number", "state", metric, "epochs", *names, "seed", "duration_s", "retry_of",
              "note"]

    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(header)
    for t in trials:
        duration = t.duration.total_seconds() if t.duration else ""
        w.writerow([t.number, t.state.name, "" if t.value is None else repr(t.value),
                    len(t.intermediate_values), *(t.params.get(k, "") for k in names),
                    t.user_attrs.get("hftc_seed", ""),
                    f"{duration:.2f}" if duration != "" else "",
                    t.system_attrs.get("failed_trial", ""),
                    t.user_attrs.get("hftc_fail_reason", "") or t.user_attrs.get(SURPLUS, "")])
    atomic_write(path, text.getvalue().encode())


def plot_curves(study: optuna.Study, path: Path, metric: str) -> None:
    """Every trial's metric per epoch: complete trials in colour, pruned ones grey,
    the best one thick. Drawn with the Agg canvas (no display, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ranked = _sorted_complete(study)
    best = ranked[0].number if ranked else None
    for t in study.get_trials(deepcopy=False):
        steps = sorted(t.intermediate_values)
        if not steps:
            continue
        values = [t.intermediate_values[s] for s in steps]
        if t.number == best:
            ax.plot(steps, values, color="crimson", lw=2.5, zorder=5,
                    label=f"best: trial {t.number} ({values[-1]:.4f})")
        elif t.state == TrialState.COMPLETE:
            ax.plot(steps, values, color="tab:blue", lw=1, alpha=0.6)
        elif t.state == TrialState.PRUNED:
            ax.plot(steps, values, color="grey", lw=0.8, ls="--", alpha=0.6)
        else:
            ax.plot(steps, values, color="orange", lw=0.8, ls=":", alpha=0.6)
    ax.plot([], [], color="tab:blue", label="complete")
    ax.plot([], [], color="grey", ls="--", label="pruned")
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    ax.set_title(f"{study.study_name}: learning curves of {len(study.trials)} trials")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    atomic_write(path, png.getbuffer())


def write_results(sweep) -> tuple[dict[str, Path], str]:
    """results.csv, curves.png, best.pt and best.json in ``sweep.out``; the leaderboard."""
    study, out, metric = sweep.study, sweep.out, sweep.spec.metric_name
    files = {"results": out / "results.csv", "curves": out / "curves.png"}
    write_csv(study, files["results"], metric)
    plot_curves(study, files["curves"], metric)
    board = leaderboard(study, metric)
    ranked = _sorted_complete(study)
    if ranked:
        best = ranked[0]
        weights = out / "trials" / f"trial-{best.number}.pt"
        info = {"number": best.number, "value": best.value, "metric": metric,
                "direction": sweep.spec.direction,
                "params": best.user_attrs.get("hftc_params", best.params),
                "seed": best.user_attrs.get("hftc_seed"),
                "orders": best.user_attrs.get("hftc_orders"),
                "epochs": len(best.intermediate_values)}
        files["best_json"] = out / "best.json"
        atomic_write(files["best_json"], json.dumps(info, indent=1).encode())
        if weights.exists():
            files["best"] = out / "best.pt"
            atomic_write(files["best"], weights.read_bytes())
        else:
            # An earlier best.pt of this folder is another trial's: it would go with this
            # best.json as the best model's weights.
            (out / "best.pt").unlink(missing_ok=True)
            board += (f"\n(best.pt not written: trial {best.number} was trained by worker "
                      f"{best.user_attrs.get('hftc_worker')}; its weights are in that "
                      f"worker's OUT/trials/)")
    return files, board


#: the keys of SweepResult.timings that count things rather than seconds (hftc.ray.sweep)
_COUNTS = ("workers", "replaced", "nodes")


def summary(result) -> str:
    """The end of a sweep in a few lines: where the wall clock went, the speedup over
    training the same trials one by one (estimated from epochs trained alone), the sizes
    of the fused arrays and why trials could not share one."""
    tm = result.timings
    parts = [f"training {tm.get('train', 0.0):.1f} s", f"fusing {tm.get('fuse', 0.0):.1f} s",
             f"Optuna {tm.get('optuna', 0.0):.1f} s",
             f"checkpoints {tm.get('checkpoint', 0.0):.1f} s"]
    for key, words in (("on_epoch", "on_epoch"), ("results", "result files")):
        if tm.get(key, 0.0) >= 0.05:
            parts.append(f"{words} {tm[key]:.1f} s")
    # timings also holds a Ray sweep's counts (workers, nodes, replaced): not seconds
    other = result.wall_s - sum(v for k, v in tm.items() if k not in _COUNTS)
    if tm.get("ray_start", 0.0) >= 0.05:
        parts.append(f"reaching Ray {tm['ray_start']:.1f} s")
    before_s = _before_s(result)
    before = (f" (and {before_s:.1f} s before it: Python, the imports, the spec)"
              if before_s is not None else "")
    lines = [f"time: {result.wall_s:.1f} s wall clock for {result.trial_epochs} "
             f"trial-epochs: {', '.join(parts)}, start-up and other {max(other, 0.0):.1f} s"
             + _start_up(result) + before]
    if getattr(result, "cluster", ""):
        lines.append(result.cluster)
    lines.append(f"note: {result.note}" if result.note else speedup_line(result))
    if result.formations:
        sizes = [n for formation in result.formations for n in formation]
        shown = ", ".join("+".join(map(str, f)) for f in result.formations[:8])
        more = f", ... ({len(result.formations)} in all)" if len(result.formations) > 8 else ""
        lines.append(f"fused arrays: {shown}{more} trials per array as formed (mean "
                     f"{sum(sizes) / len(sizes):.1f})")
    if result.padded:
        ratios = [ratio for _, _, ratio in result.padded]
        trials, widths, ratio = max(result.padded, key=lambda p: p[1])
        lines.append(f"  padded widths: {len(result.padded)} array(s) held models of several "
                     f"widths, padded to the widest: {min(ratios):.2f}x-{max(ratios):.2f}x "
                     f"the models' own arithmetic (e.g. trials {trials}: {widths} widths, "
                     f"{ratio:.2f}x)")
    if result.mixed:
        combos = sorted({" + ".join(classes) for _, classes in result.mixed})
        lines.append(f"  optimizer classes in one array: {len(result.mixed)} array(s) "
                     f"({'; '.join(combos)})")
    for reason in result.apart:
        lines.append(f"  not in one array: {reason}")
    for what in getattr(result, "one_by_one", ()):
        lines.append(f"  run model by model, not fused (exact, not faster): {what}")
    return "\n".join(lines)


def _start_up(result) -> str:
    """What of "start-up and other" was measured: the spec's data() and, run one at a time
    (where this process's first torch.optim step pays it), torch._dynamo's import."""
    known = [("data()", getattr(result, "load_s", 0.0) or 0.0)]
    if getattr(result, "note", ""):  # (the fused side skips that import: hftc/patches.py)
        known.append(("torch._dynamo's import", getattr(result, "dynamo_import_s", 0.0) or 0.0))
    said = [f"{what} {seconds:.1f} s" for what, seconds in known if seconds >= 0.05]
    return f" (of it: {', '.join(said)})" if said else ""


def serial_estimate(result) -> tuple[float, str] | None:
    """The same study one trial at a time with stock Optuna, estimated from what was
    measured: (seconds, how) or None where no epoch was trained alone. Its training is
    the median epoch trained alone times the trial-epochs one at a time trains for
    these learning curves; its Optuna share and its start-up are measured where the
    sweep replayed its trials through stock Optuna (serial.replay_optuna)."""
    samples = sorted(result.serial_epoch_s)
    if not samples or not result.trial_epochs:
        return None
    epoch_s = samples[len(samples) // 2]
    epochs = result.serial_trial_epochs or result.trial_epochs
    train = epoch_s * epochs
    how = (f"{epochs} trial-epochs x {epoch_s * 1e3:.1f} ms (the median of {len(samples)} "
           f"epoch(s) trained alone)")
    if result.serial_optuna_s is None:
        return train, how + ("; it leaves out the serial run's own Optuna and start-up "
                             "(not measured: a shared or resumed study)")
    total = train + result.serial_optuna_s + result.load_s + result.dynamo_import_s
    dynamo = (f" + torch._dynamo's import {result.dynamo_import_s:.1f} s (which a script's "
              f"first torch.optim optimizer makes)" if result.dynamo_import_s >= 0.05 else "")
    before = ""
    if _before_s(result) is not None:
        charged = serial_before(result)
        total += charged
        before = (f" + its process's start {charged:.1f} s (this one's before the sweep, "
                  f"less hftc's import {getattr(result, 'hftc_import_s', 0.0):.1f} s)")
    return total, (how + f" + Optuna {result.serial_optuna_s:.1f} s (a sample of these trials "
                   f"through a stock Optuna study one at a time, scaled; off the clock) + data "
                   f"{result.load_s:.1f} s" + dynamo + before)


def serial_before(result) -> float:
    """The one-at-a-time script's start-up before its study: this process's before the
    sweep (Python, torch, optuna, the spec) less hftc's core import (clock.py)."""
    return max(0.0, (_before_s(result) or 0.0) - getattr(result, "hftc_import_s", 0.0))


def _before_s(result) -> float | None:
    """The result's seconds before the sweep's clock; None where not measured (or a
    result object of its own, e.g. a test's, that does not carry them)."""
    return getattr(result, "before_s", None)


def fused_seconds(result) -> float:
    """The fused side's seconds, as the estimate beside it counts its own: the sweep's
    wall clock, and the process's start where the estimate charges the serial side its
    own (both, or neither)."""
    before_s = _before_s(result)
    counted = before_s is not None and result.serial_optuna_s is not None
    return result.wall_s + (before_s if counted else 0.0)


def speedup_line(result) -> str:
    """``speedup: 2.10x wall clock against ...``: the summary's line on the speedup."""
    estimate = serial_estimate(result)
    if estimate is None and result.trial_epochs and not result.estimated:
        return "speedup: not estimated (--no-estimate)"
    if estimate is None:
        return "speedup: not estimated (no epoch was trained alone: nothing trained)"
    serial_s, how = estimate
    train = result.timings.get("train", 0.0)
    samples = sorted(result.serial_epoch_s)
    alone = samples[len(samples) // 2] * result.trial_epochs / train if train > 0 else None
    fused_s = fused_seconds(result)
    whole = (f" ({fused_s:.1f} s, the process's start included)" if fused_s != result.wall_s
             else "")
    return (f"speedup: {serial_s / fused_s:.2f}x wall clock{whole} against the same study one "
            f"trial at a time with stock Optuna, estimated: {serial_s:.1f} s = {how}"
            + (f"; training alone: {alone:.2f}x" if alone else ""))


class _Bars:
    """tqdm bars for trials and for the batches of the current epoch; silent off a terminal."""

    def __init__(self, sweep, enabled: bool):
        self.sweep = sweep
        self.epoch = None
        self.trials = None
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self.tqdm = tqdm
        self.trials = tqdm(total=sweep.spec.n_trials, desc="trials", unit="trial", position=0,
                           dynamic_ncols=True)
        self._update_trials()

    def _update_trials(self) -> None:
        if self.trials is None:
            return
        study = self.sweep.study
        finished = sum(1 for t in study.get_trials(deepcopy=False)
                       if t.state in (TrialState.COMPLETE, TrialState.PRUNED))
        self.trials.n = min(finished, self.trials.total)
        ranked = _sorted_complete(study)
        if ranked:
            self.trials.set_postfix(best=f"{ranked[0].value:.4f}", refresh=False)
        self.trials.refresh()

    def round_start(self, sweep) -> None:
        if self.trials is None:
            return
        n_batches = sweep.data.n_batches(sweep.spec.batch_size)
        sizes = "+".join(str(len(a.members)) for a in sweep.arrays)
        self.epoch = self.tqdm(total=n_batches, desc=f"round {sweep.round + 1} [{sizes}]",
                               unit="batch", position=1, leave=False, dynamic_ncols=True)

    def round_end(self, sweep) -> None:
        if self.epoch is not None:
            self.epoch.close()
            self.epoch = None
        self._update_trials()

    def waiting(self, running: int) -> None:
        if self.trials is not None:
            self.trials.set_description(f"trials (waiting for {running} on other workers)")
            self._update_trials()

    def close(self) -> None:
        if self.epoch is not None:
            self.epoch.close()
        if self.trials is not None:
            self._update_trials()
            self.trials.close()


def progress_bars(sweep) -> _Bars:
    return _Bars(sweep, sweep.progress)
