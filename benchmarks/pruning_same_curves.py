"""The pruning rule alone: the same learning curves pruned one at a time and in arrays.

``python -m benchmarks.pruning_same_curves [SPEC] [--seeds 0,1,2,3] [--configs FILE]``

``hftc bench --sweep SPEC --same-trials`` trains the same configurations on both sides,
but a trial's curve still differs between them (its dropout masks, and the data order
of a trial the sweep starts after round 0), so the trial-epochs mix the pruning rule
with that noise. Here each seed's ``n_trials`` configurations (``draw_trials``) are
(or those of ``--configs``: a JSON list of parameter dicts, or the ``--out`` file of
``hftc bench --sweep SPEC --same-trials fused``, its trials) trained for all their epochs
without pruning, once one at a time (stock) and once
fused, and each set of curves is cut three ways, without training again::

    one at a time:  stock Optuna, the spec's pruner, trial 0, 1, ... reported in turn
    arrays (rule):  the sweep's schedule (per_array trials side by side, a place
                    refilled as a trial leaves, decisions in trial-number order each
                    round) with pruning.py's reference: complete trials + running ones
                    numbered below that reached the step
    arrays (stock): the same schedule, the pruner shown the complete trials only

Prints the trial-epochs of each (deterministic: no timing).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from hftc.bench.sweep import draw_trials, run_fused
from hftc.sweep.pruning import Reference, prune_in_sequence
from hftc.sweep.serial import run_serial
from hftc.sweep.spec import load_spec
from hftc.sweep.storage import make_pruner


def one_at_a_time(spec, curves: list[list[float]]) -> int:
    """Trial-epochs a stock study reports for ``curves``, one trial after another."""
    study = optuna.create_study(direction=spec.direction, pruner=make_pruner(spec))
    epochs = 0
    for curve in curves:
        trial = study.ask()
        for step, value in enumerate(curve, 1):
            epochs += 1
            trial.report(value, step)
            if trial.should_prune():
                study.tell(trial, state=TrialState.PRUNED)
                break
        else:
            study.tell(trial, curve[-1])
    return epochs


def in_arrays(spec, curves: list[list[float]], rule: bool = True) -> int:
    """Trial-epochs of the sweep's schedule for ``curves`` (the module docstring)."""
    pruner = make_pruner(spec)
    study = optuna.create_study(direction=spec.direction, pruner=pruner)
    waiting, live, complete, epochs = list(range(len(curves))), {}, [], 0
    while waiting or live:
        while len(live) < spec.per_array and waiting:
            live[waiting.pop(0)] = 0
        for k in live:
            live[k] += 1
            epochs += 1
        out = set()
        for k in sorted(live):
            seen = dict(enumerate(curves[k][:live[k]], 1))
            if live[k] >= spec.epochs:
                done = optuna.trial.create_trial(value=curves[k][-1], params={},
                                                 distributions={}, intermediate_values=seen)
                done.number = k
                complete.append(done)
                out.add(k)
                continue
            running = [Reference(j, dict(enumerate(curves[j][:live[j]], 1)))
                       for j in live if j not in out and j != k] if rule else []
            if prune_in_sequence(pruner, study, k, k, seen, complete, running):
                out.add(k)
        for k in out:
            del live[k]
    return epochs


def curves_of(study: optuna.Study) -> list[list[float]]:
    return [[t.intermediate_values[s] for s in sorted(t.intermediate_values)]
            for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pruning_same_curves")
    p.add_argument("spec", nargs="?", default="benchmarks/sweep_mlp_digits.py")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--configs", default=None, help="a JSON list of parameter dicts, or an "
                   "hftc bench --sweep --same-trials --out file (its first round's trials)")
    args = p.parse_args(argv)
    given = None
    if args.configs is not None:
        given = json.loads(Path(args.configs).read_text())
        given = given if isinstance(given, list) else given["rows"]["fused"][0]["params"]
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print("seed  curves         one at a time  arrays (rule)  arrays (stock)  best")
    for seed in (int(s) for s in args.seeds.split(",")):
        spec = load_spec(args.spec).replace(seed=seed)
        configs = given if given is not None else draw_trials(spec)
        spec = spec.replace(n_trials=len(configs))
        unpruned = spec.replace(pruner="none")
        with tempfile.TemporaryDirectory(prefix="hftc-same-curves-") as tmp:
            sides = {"one at a time": run_serial(unpruned, Path(tmp) / "serial",
                                                 enqueue=configs).study,
                     "fused": run_fused(unpruned, Path(tmp) / "fused", configs).study}
            for name, study in sides.items():
                curves = curves_of(study)
                print(f"{seed:4d}  {name:13s}  {one_at_a_time(spec, curves):13d}  "
                      f"{in_arrays(spec, curves):13d}  {in_arrays(spec, curves, False):14d}"
                      f"  {max(c[-1] for c in curves):.4f}", flush=True)


if __name__ == "__main__":
    main()
