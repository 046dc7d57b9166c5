"""``hftc bench --sweep [SPEC]``: a whole sweep, both sides for real, as whole processes.

::

    fused:   python -m hftc.bench.sweep fused  SPEC OUT   # hftc.sweep.run(spec): arrays
    serial:  python -m hftc.bench.sweep serial SPEC OUT   # optuna study.optimize, one
                                                          # stock trial at a time
    rounds:  fused, serial, fused, serial, ...            # alternated: a machine whose
                                                          # load drifts loads both alike

Each process imports what it needs (torch, optuna, the spec's data), builds its study on
its own SQLite file and trains every trial; its wall clock is timed from outside, start
to exit. Reported: the median wall clock of each side and the median of the per-round
ratios, the trial-epochs each trained, the best value each found.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run_sweep_bench", "format_sweep_bench"]


def _side(which: str, spec_ref: str, out: str, threads: int) -> dict:
    """One side, in this process: the fused sweep or the one-at-a-time stock study."""
    import torch

    torch.set_num_threads(threads)
    from ..sweep.spec import load_spec

    spec = load_spec(spec_ref)
    if which == "fused":
        from ..sweep import run

        result = run(spec, out=Path(out) / "fused", progress=False)
        study, epochs = result.study, result.trial_epochs
    else:
        from ..sweep.serial import run_serial

        result = run_serial(spec, Path(out) / "serial")
        study, epochs = result.study, result.trial_epochs
    try:
        best = study.best_value
    except ValueError:
        best = None
    return {"trial_epochs": epochs, "best": best, "trials": len(study.trials)}


def run_sweep_bench(spec_ref: str = "hftc.sweep.digits", rounds: int = 3, threads: int = 1,
                    log=print) -> dict:
    """``rounds`` alternated pairs of whole processes (fused, then serial); the figures."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    rows: dict[str, list[dict]] = {"fused": [], "serial": []}
    with tempfile.TemporaryDirectory(prefix="hftc-bench-sweep-") as tmp:
        for k in range(rounds):
            for which in ("fused", "serial"):
                out = Path(tmp) / f"{which}-{k}"
                report = out / "report.json"
                cmd = [sys.executable, "-m", "hftc.bench.sweep", which, spec_ref, str(out),
                       str(threads), str(report)]
                start = time.perf_counter()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - start
                if proc.returncode != 0:
                    raise SystemExit(f"hftc bench --sweep: the {which} side failed:\n"
                                     f"{proc.stderr[-2000:]}")
                row = json.loads(report.read_text()) | {"wall_s": wall}
                rows[which].append(row)
                log(f"round {k + 1}/{rounds} {which:6s} {wall:6.1f} s  "
                    f"{row['trial_epochs']} trial-epochs  best {row['best']}")
    ratios = [s["wall_s"] / f["wall_s"] for f, s in zip(rows["fused"], rows["serial"])]
    return {"spec": spec_ref, "rounds": rounds, "threads": threads, "rows": rows,
            "fused_wall_s": statistics.median(r["wall_s"] for r in rows["fused"]),
            "serial_wall_s": statistics.median(r["wall_s"] for r in rows["serial"]),
            "speedup": statistics.median(ratios), "ratios": ratios}


def format_sweep_bench(result: dict) -> str:
    """The figures as a few lines of text."""
    f, s = result["rows"]["fused"], result["rows"]["serial"]

    def median(rows, key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    return "\n".join([
        f"sweep {result['spec']}: {result['rounds']} round(s) of whole processes, "
        f"{result['threads']} thread(s) each, alternated",
        f"  hftc sweep (fused arrays):           median {result['fused_wall_s']:.1f} s, "
        f"{median(f, 'trial_epochs'):.0f} trial-epochs, best {median(f, 'best'):.4f}",
        f"  stock Optuna, one trial at a time:   median {result['serial_wall_s']:.1f} s, "
        f"{median(s, 'trial_epochs'):.0f} trial-epochs, best {median(s, 'best'):.4f}",
        f"  speedup: {result['speedup']:.2f}x wall clock (median of the rounds' ratios "
        f"{', '.join(f'{r:.2f}' for r in result['ratios'])})",
    ])


if __name__ == "__main__":  # one side, as a whole process: which spec out threads report
    which, spec_ref, out, threads, report = sys.argv[1:6]
    Path(report).parent.mkdir(parents=True, exist_ok=True)
    Path(report).write_text(json.dumps(_side(which, spec_ref, out, int(threads))))
