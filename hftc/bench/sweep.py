"""``hftc bench --sweep [SPEC]``: a whole sweep, both sides for real, as whole processes.

::

    fused:   python -m hftc.bench.sweep fused  SPEC OUT   # hftc.sweep.run(spec, estimate=False):
                                                          # hftc sweep --no-estimate, arrays
    serial:  python -m hftc.bench.sweep serial SPEC OUT   # optuna study.optimize, one
                                                          # stock trial at a time
    rounds:  fused, serial, fused, serial, ...            # alternated: a machine whose
                                                          # load drifts loads both alike

Each process imports what it needs (torch, optuna, the spec's data), builds its study on
its own SQLite file and trains every trial; its wall clock is timed from outside, start
to exit. The one-at-a-time side is stock torch: its loop is hftc.sweep.serial's, but it
runs without hftc's torch patches (``HFTC_STOCK_TORCH=1``: no step hooks, no checked
losses) and its wall clock leaves out hftc's core import, measured in the process, as a
script without hftc would. The fused side runs without its summary's speedup estimate
(epochs trained alone, a sample of trials through stock Optuna: what this bench measures for real).
Reported: the median wall clock of each side and the median of the per-round ratios,
the trial-epochs each trained, the best value each found.

``--same-trials [SOURCE]``: both sides train the very same configurations, so their
trial-epochs differ by the pruning, not by what each side's sampler asked (TPE one at a
time against TPE in batches of ``per_array``)::

    random (default):  configs = draw_trials(spec)   # n_trials dicts, once, from the
                                                      # spec's space, RandomSampler(seed)
    fused:             the fused sweep samples (its sampler), configs = its trials' params
    serial:            the one-at-a-time study samples first, configs = its trials' params
    the other side(s): study.enqueue_trial(c) for c in configs, then it runs as usual

Trial k has the same parameters and the same seed (``spec.seed + k``) on both sides, and
the same pruner; what differs is the data order of a trial the sweep starts after round
0 (a fused array trains its trials on its round's order), its dropout masks (a fused
model draws its own, never the stock model's) and what the pruner is shown.
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

__all__ = ["run_sweep_bench", "format_sweep_bench", "draw_trials", "run_fused", "SAME_TRIALS"]


def draw_trials(spec, n: int | None = None) -> list[dict]:
    """``n`` (default ``spec.n_trials``) parameter dicts from ``spec.space``, drawn with
    ``RandomSampler(seed=spec.seed)`` in a study in memory: what ``--same-trials``
    enqueues on both sides."""
    import warnings

    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=spec.seed),
                                        direction=spec.direction)
            drawn = []
            for _ in range(spec.n_trials if n is None else n):
                trial = study.ask()
                spec.space(trial)
                drawn.append(dict(trial.params))
    finally:
        optuna.logging.set_verbosity(verbosity)
    return drawn


def run_fused(spec, out: Path, trials: list[dict] | None = None):
    """The fused sweep in ``out`` as ``hftc sweep --no-estimate`` runs it; with ``trials``,
    its study made first with them enqueued (the sweep asks the waiting trials first, in
    their numbers' order)."""
    from ..sweep import run

    if trials is not None:
        import optuna

        out.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(study_name=spec.name, direction=spec.direction,
                                    storage=f"sqlite:///{out.resolve() / 'study.db'}")
        for params in trials:
            study.enqueue_trial(params)
    return run(spec, out=out, progress=False, estimate=False)


def _side(which: str, spec_ref: str, out: str, threads: int,
          trials: list[dict] | None = None, seed: int | None = None) -> dict:
    """One side, in this process: the fused sweep or the one-at-a-time stock study; with
    ``trials``, these configurations enqueued (``--same-trials``); with ``seed``, the
    spec's seed replaced (``--seeds``)."""
    import torch

    torch.set_num_threads(threads)
    from ..sweep.spec import load_spec

    spec = load_spec(spec_ref)
    if seed is not None:
        spec = spec.replace(seed=seed)
    if trials is not None:
        spec = spec.replace(n_trials=len(trials))
    if which == "fused":
        result = run_fused(spec, Path(out) / "fused", trials)
    else:
        from ..sweep.serial import run_serial

        # (the fused side's study name: a HyperbandPruner puts trial k in the same bracket)
        result = run_serial(spec, Path(out) / "serial", enqueue=trials, study_name=spec.name)
    study, epochs = result.study, result.trial_epochs
    try:
        best = study.best_value
    except ValueError:
        best = None
    ordered = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    import hftc

    return {"trial_epochs": epochs, "hftc_import_s": hftc._CORE_LOAD_S,
            "torch_patched": sys.modules["hftc.patches"]._installed, "best": best,
            "trials": len(ordered),
            "pruned": sum(t.state.name == "PRUNED" for t in ordered),
            "params": [t.params for t in ordered],
            "epochs": [len(t.intermediate_values) for t in ordered]}


#: ``--same-trials SOURCE``: where both sides' configurations come from, in words
SAME_TRIALS = {"random": "drawn at random", "fused": "the fused sweep's",
               "serial": "the one-at-a-time study's"}


def _one_process(which: str, spec_ref: str, out: Path, threads: int, env: dict,
                 trials_file: Path | None, seed: int | None = None) -> dict:
    """One side as a whole process, timed from outside: its report and wall clock."""
    import hftc

    report = out / "report.json"
    cmd = [sys.executable, "-m", "hftc.bench.sweep", which, spec_ref, str(out), str(threads),
           str(report), "-" if trials_file is None else str(trials_file),
           "-" if seed is None else str(seed)]
    if which == "serial":  # stock torch, as a script without hftc runs it
        env = dict(env, **{hftc.STOCK_TORCH: "1"})
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"hftc bench --sweep: the {which} side failed:\n"
                         f"{proc.stderr[-2000:]}")
    row = json.loads(report.read_text())
    # The one-at-a-time side imports hftc's code (its loop is hftc.sweep.serial's), which a
    # stock script does not: its wall clock less that import, measured in the process.
    return row | {"wall_s": wall - (row["hftc_import_s"] if which == "serial" else 0.0),
                  "seed": seed}


def run_sweep_bench(spec_ref: str = "hftc.sweep.digits", rounds: int = 3, threads: int = 1,
                    log=print, same_trials: str | None = None,
                    seeds: list[int] | None = None) -> dict:
    """``rounds`` alternated pairs of whole processes (fused, then serial); the figures.

    ``same_trials`` (a key of :data:`SAME_TRIALS`): both sides train the same
    configurations, enqueued: ``"random"``, those of :func:`draw_trials`; ``"fused"``
    (``"serial"``), those the fused sweep's (the one-at-a-time study's) own sampler
    asked, that side run first in each round and the other given its trials.
    ``seeds``: round k runs both sides with the spec's seed ``seeds[k % len(seeds)]``
    (which trials the samplers ask, their seeds, the data order); the figures then also
    give the rounds' total wall clocks, the whole set of studies either way."""
    if same_trials is not None and same_trials not in SAME_TRIALS:
        raise SystemExit(f"hftc bench --sweep --same-trials {same_trials}: use one of "
                         f"{', '.join(SAME_TRIALS)}")
    env = dict(os.environ, PYTHONHASHSEED="0")
    rows: dict[str, list[dict]] = {"fused": [], "serial": []}
    order = ("serial", "fused") if same_trials == "serial" else ("fused", "serial")
    with tempfile.TemporaryDirectory(prefix="hftc-bench-sweep-") as tmp:
        trials_file = None
        for k in range(rounds):
            seed = seeds[k % len(seeds)] if seeds else None
            if same_trials == "random" and (trials_file is None or seeds):
                from ..sweep.spec import load_spec

                spec = load_spec(spec_ref)
                trials_file = Path(tmp) / f"trials-random-{k}.json"
                trials_file.write_text(json.dumps(draw_trials(
                    spec if seed is None else spec.replace(seed=seed))))
            if same_trials in ("fused", "serial"):
                trials_file = None  # the first side samples; the second trains its trials
            for which in order:
                row = _one_process(which, spec_ref, Path(tmp) / f"{which}-{k}", threads, env,
                                   trials_file, seed)
                rows[which].append(row)
                if same_trials in ("fused", "serial") and trials_file is None:
                    trials_file = Path(tmp) / f"trials-{k}.json"
                    trials_file.write_text(json.dumps(row["params"]))
                log(f"round {k + 1}/{rounds} {which:6s} "
                    + ("" if seed is None else f"seed {seed}  ")
                    + f"{row['wall_s']:6.1f} s  "
                    f"{row['trial_epochs']} trial-epochs ({row['pruned']} pruned)  "
                    f"best {row['best']}")
    ratios = [s["wall_s"] / f["wall_s"] for f, s in zip(rows["fused"], rows["serial"])]
    return {"spec": spec_ref, "rounds": rounds, "threads": threads, "rows": rows,
            "same_trials": same_trials, "seeds": seeds,
            "total_ratio": sum(r["wall_s"] for r in rows["serial"])
            / sum(r["wall_s"] for r in rows["fused"]),
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
        f"{result['threads']} thread(s) each, alternated"
        + (f", the same trials on both sides ({SAME_TRIALS[result['same_trials']]})"
           if result.get("same_trials") else ""),
        f"  hftc sweep --no-estimate (fused):    median {result['fused_wall_s']:.1f} s, "
        f"{median(f, 'trial_epochs'):.0f} trial-epochs, best {median(f, 'best'):.4f}",
        f"  stock Optuna, one trial at a time:   median {result['serial_wall_s']:.1f} s, "
        f"{median(s, 'trial_epochs'):.0f} trial-epochs, best {median(s, 'best'):.4f}",
        f"  speedup: {result['speedup']:.2f}x wall clock (median of the rounds' ratios "
        f"{', '.join(f'{r:.2f}' for r in result['ratios'])})",
        *([f"  over the seeds {', '.join(map(str, result['seeds']))}: "
           f"{result['total_ratio']:.2f}x the rounds' total wall clock (stock "
           f"{sum(r['wall_s'] for r in s):.1f} s, fused {sum(r['wall_s'] for r in f):.1f} s; "
           f"trial-epochs {sum(r['trial_epochs'] for r in s)} / "
           f"{sum(r['trial_epochs'] for r in f)})"] if result.get("seeds") else []),
    ])


if __name__ == "__main__":  # one side, as a process: which spec out threads report trials seed
    which, spec_ref, out, threads, report, trials_arg, seed_arg = sys.argv[1:8]
    enqueued = None if trials_arg == "-" else json.loads(Path(trials_arg).read_text())
    Path(report).parent.mkdir(parents=True, exist_ok=True)
    Path(report).write_text(json.dumps(_side(which, spec_ref, out, int(threads), enqueued,
                                             None if seed_arg == "-" else int(seed_arg))))
    if which == "fused":  # as `hftc sweep` ends (a stock script's process does not)
        from ..sweep.collector import freeze_at_exit

        freeze_at_exit()
