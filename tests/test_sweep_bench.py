"""hftc bench --sweep: both sides of a sweep for real, as whole processes; the summary's
and serial.replay_optuna's account of the one-at-a-time side."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import hftc.sweep as hs
from hftc.sweep.serial import replay_optuna, run_serial

SPEC = '''
import torch
from torch import nn

name = "benchtiny"
metric = "accuracy"
epochs = 3
batch_size = 32
n_trials = 4
per_array = 4
pruner = "median"


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 0.5, log=True)}


def model(params):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(1)
    return (x[:128], y[:128]), (x[128:], y[128:])
'''


def _spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "benchtiny.py"
    path.write_text(SPEC)
    return path


def test_bench_sweep_runs_both_sides_as_processes(tmp_path):
    from hftc.bench.sweep import format_sweep_bench, run_sweep_bench

    lines = []
    result = run_sweep_bench(str(_spec_file(tmp_path)), rounds=1, log=lines.append)
    fused, serial = result["rows"]["fused"][0], result["rows"]["serial"][0]
    assert fused["trials"] == serial["trials"] == 4
    assert 4 <= fused["trial_epochs"] <= 12 and 4 <= serial["trial_epochs"] <= 12
    assert result["speedup"] == serial["wall_s"] / fused["wall_s"]
    # The one-at-a-time side is stock torch: no hftc patch, hftc's import not charged.
    assert fused["torch_patched"] and not serial["torch_patched"]
    assert serial["hftc_import_s"] > 0.0
    text = format_sweep_bench(result)
    assert "stock Optuna, one trial at a time" in text and "speedup: " in text
    assert len(lines) == 2


def test_bench_sweep_seeds_run_both_sides_of_each_round_with_its_seed(tmp_path):
    """--seeds 3,4: round k's two processes both run the spec with seed seeds[k] (each
    sampler's first trial differs between the seeds, and a seed's serial side asks what
    a one-at-a-time study of that seed asks); the total ratio is the rounds' totals'."""
    from hftc.bench.sweep import format_sweep_bench, run_sweep_bench

    spec_file = _spec_file(tmp_path)
    result = run_sweep_bench(str(spec_file), rounds=2, log=lambda line: None, seeds=[3, 4])
    fused, serial = result["rows"]["fused"], result["rows"]["serial"]
    assert [r["seed"] for r in fused] == [r["seed"] for r in serial] == [3, 4]
    assert fused[0]["params"][0] != fused[1]["params"][0]
    assert serial[0]["params"][0] != serial[1]["params"][0]
    alone = run_serial(hs.load_spec(spec_file).replace(seed=4), tmp_path / "alone")
    assert serial[1]["params"] == [t.params for t in sorted(alone.study.trials,
                                                            key=lambda t: t.number)]
    assert result["total_ratio"] == pytest.approx(
        sum(r["wall_s"] for r in serial) / sum(r["wall_s"] for r in fused))
    assert "over the seeds 3, 4: " in format_sweep_bench(result)


def test_bench_seeds_must_be_integers(capsys):
    from hftc.__main__ import main

    with pytest.raises(SystemExit, match="give integers separated by commas"):
        main(["bench", "--sweep", "hftc.sweep.digits", "--seeds", "1,x"])


@pytest.mark.parametrize("source", ["random", "fused", "serial"])
def test_bench_sweep_same_trials_trains_the_same_configurations_on_both_sides(tmp_path,
                                                                             source):
    """--same-trials: the configurations drawn once (seeded RandomSampler), or those one
    side's own sampler asked, are what trial 0, 1, ... trained on both sides; with 4
    trials the median pruner's 4 startup trials are never all before a trial (one at a
    time, or in the array's order), so neither side prunes and both train every epoch."""
    from hftc.bench.sweep import draw_trials, format_sweep_bench, run_sweep_bench

    spec_file = _spec_file(tmp_path)
    drawn = draw_trials(hs.load_spec(spec_file))
    assert drawn == draw_trials(hs.load_spec(spec_file))  # seeded: drawn alike each time
    lines = []
    result = run_sweep_bench(str(spec_file), rounds=1, log=lines.append, same_trials=source)
    fused, serial = result["rows"]["fused"][0], result["rows"]["serial"][0]
    assert fused["params"] == serial["params"]
    assert len({p["lr"] for p in fused["params"]}) == 4
    if source == "random":
        assert fused["params"] == drawn
    elif source == "fused":  # the sweep's sampler asked them (reseeded per trial:
        assert fused["params"] != drawn  # sampling.py), not draw_trials' RandomSampler
    for side in (fused, serial):
        assert side["trials"] == 4 and side["pruned"] == 0
        assert side["epochs"] == [3, 3, 3, 3] and side["trial_epochs"] == 12
    first = "serial" if source == "serial" else "fused"
    assert lines[0].startswith(f"round 1/1 {first}")
    assert result["same_trials"] == source
    assert "the same trials on both sides" in format_sweep_bench(result)


def test_bench_sweep_same_trials_refuses_an_unknown_source(tmp_path):
    from hftc.bench.sweep import run_sweep_bench

    with pytest.raises(SystemExit, match="use one of random, fused, serial"):
        run_sweep_bench(str(_spec_file(tmp_path)), rounds=1, same_trials="tpe")


def test_serial_side_is_stock_optuna_one_at_a_time(tmp_path):
    spec = hs.load_spec(_spec_file(tmp_path))
    result = run_serial(spec, tmp_path / "serial")
    trials = result.study.get_trials()
    assert len(trials) == 4 and result.trial_epochs == sum(
        len(t.intermediate_values) for t in trials)
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    assert 0 < result.train_s < result.wall_s


def test_replay_prunes_the_curves_one_at_a_time(tmp_path):
    """The replay reports each trial's curve in number order through the spec's pruner:
    a curve below the median of the complete ones is cut where one at a time cuts it."""
    spec = hs.load_spec(_spec_file(tmp_path)).replace(epochs=4)
    study = optuna.create_study(direction="maximize")
    curves = [[0.5, 0.6, 0.7, 0.8]] * 4 + [[0.1, 0.1, 0.1, 0.1], [0.9, 0.9, 0.9, 0.9]]
    for curve in curves:
        study.add_trial(optuna.trial.create_trial(
            value=curve[-1], intermediate_values=dict(enumerate(curve, 1)), params={},
            distributions={}))
    seconds, epochs = replay_optuna(spec, study.get_trials(), tmp_path / "replay")
    # median pruner: 4 startup trials, warm-up min(2, epochs - 1) = 2: the fifth is cut
    # at step 2, the others train all 4 epochs
    assert epochs == 4 * 4 + 2 + 4 and seconds > 0


def test_the_replay_charges_the_study_made_first_in_a_process(tmp_path):
    """A one-at-a-time script's create_study is its process's first RDB storage (SQLAlchemy
    imported, the schema made); the replay's is made second, warm: the sweep's own first
    creation is what the serial side is charged where it is the larger."""
    spec = hs.load_spec(_spec_file(tmp_path)).replace(epochs=2)
    study = optuna.create_study(direction="maximize")
    for _ in range(3):
        study.add_trial(optuna.trial.create_trial(
            value=0.5, intermediate_values={1: 0.5, 2: 0.5}, params={}, distributions={}))
    warm, _ = replay_optuna(spec, study.get_trials(), tmp_path / "warm")
    charged, _ = replay_optuna(spec, study.get_trials(), tmp_path / "first",
                               first_made_s=warm + 5.0)
    assert charged >= 5.0 > warm  # (the first creation, plus the per-trial share)


def test_the_summary_charges_the_serial_side_its_optuna(tmp_path):
    result = hs.run(_spec_file(tmp_path), out=tmp_path / "out", progress=False)
    assert result.serial_optuna_s is not None and result.serial_optuna_s > 0
    assert result.serial_trial_epochs is not None
    summary = result.summary
    assert "against the same study one trial at a time with stock Optuna" in summary
    assert "+ Optuna " in summary and "+ data " in summary


def test_no_estimate_skips_the_estimate_and_changes_no_trial(tmp_path, monkeypatch, capsys):
    """``hftc sweep --no-estimate``: no epoch trained alone, no replay through stock
    Optuna, the summary says why there is no speedup; every trial's curve is the one
    the default run (with its estimate) gives."""
    import hftc.sweep.engine as engine
    import hftc.sweep.serial as serial
    from hftc.__main__ import main

    spec = _spec_file(tmp_path)
    default = hs.run(spec, out=tmp_path / "default", progress=False)
    assert default.serial_epoch_s and default.serial_optuna_s is not None
    calls = []
    monkeypatch.setattr(engine, "train_alone", lambda *a, **k: calls.append("train_alone"))
    monkeypatch.setattr(serial, "replay_optuna", lambda *a, **k: calls.append("replay"))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "quiet"), "--no-progress",
                 "--no-estimate"]) == 0
    out = capsys.readouterr().out
    assert calls == []
    assert "speedup: not estimated (--no-estimate)" in out
    quiet = optuna.load_study(study_name="benchtiny",
                              storage=f"sqlite:///{tmp_path / 'quiet' / 'study.db'}")
    curves = {t.number: (t.state, t.intermediate_values) for t in quiet.get_trials()}
    assert curves == {t.number: (t.state, t.intermediate_values)
                      for t in default.study.get_trials()}


def test_a_sweep_too_small_to_gain_says_so_and_runs_one_at_a_time(tmp_path):
    import pytest

    from hftc.errors import SweepWarning

    with pytest.warns(SweepWarning, match="too small to gain from fusing.*per_array=1"):
        result = hs.run(_spec_file(tmp_path), per_array=1, out=tmp_path / "out",
                        progress=False)
    assert len(result.study.trials) == 4 and result.timings["fuse"] == 0.0
    assert result.study.study_name.endswith("-serial")
    assert "note: run one trial at a time with stock Optuna" in result.summary
    assert {"results", "curves", "best_json", "best"} <= set(result.files)
    assert result.files["best"].exists()


def test_a_sweep_run_one_at_a_time_records_what_a_fused_one_does(tmp_path):
    """Run one at a time (too small to gain), the trials had no seed, data order or params
    of space() recorded (results.csv's seed empty, best.json's seed and orders null, its
    params without the constants), so none could be replayed alone; a diverged trial
    completed with the accuracy of its NaN weights. Now each is recorded and replays alone
    exactly, a diverged trial fails with its reason while the others go on, and --resume
    runs the study again to the same results."""
    import csv
    import json
    import warnings

    from hftc.errors import SweepWarning

    spec = hs.load_spec(_spec_file(tmp_path))

    def space(trial):
        lr = trial.suggest_float("lr", 1e-3, 0.5, log=True)
        return {"lr": float("inf") if trial.number == 1 else lr, "momentum": 0.5}

    spec = spec.replace(space=space, n_trials=3, epochs=2, pruner="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SweepWarning)
        result = hs.run(spec, per_array=1, out=tmp_path / "out", progress=False)
        again = hs.run(spec, per_array=1, out=tmp_path / "out", progress=False, resume=True)
    trials = result.study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL,
                                         TrialState.COMPLETE]
    assert trials[1].user_attrs["hftc_fail_reason"].startswith("diverged: accuracy is ")
    for t in (trials[0], trials[2]):
        assert t.user_attrs["hftc_seed"] == t.number and t.user_attrs["hftc_params"] == {
            **t.params, "momentum": 0.5}
        _, history = hs.train_alone(spec, t.user_attrs["hftc_params"], t.user_attrs["hftc_seed"],
                                    t.user_attrs["hftc_orders"])
        assert history == [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert [r["seed"] for r in rows] == ["0", "1", "2"]
    best = json.loads((tmp_path / "out" / "best.json").read_text())
    assert best["params"]["momentum"] == 0.5 and best["seed"] == best["number"]
    assert best["orders"] == [0, 1]
    assert [(t.state, t.value, t.params) for t in again.study.trials] == [
        (t.state, t.value, t.params) for t in trials]
    assert "result files" in result.summary or result.timings["results"] < 0.05


def test_sweep_serial_runs_the_stock_study_with_the_sweeps_files(tmp_path, capsys):
    """``hftc sweep SPEC --serial``: what the fused sweep is compared with, one trial at a
    time with stock Optuna, in OUT/serial.db, with the sweep's files and summary."""
    from hftc.__main__ import main

    out = tmp_path / "out"
    assert main(["sweep", str(_spec_file(tmp_path)), "--serial", "--out", str(out),
                 "--trials", "3", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "note: run one trial at a time with stock Optuna, no fusing (--serial)" in text
    assert (out / "serial.db").exists() and not (out / "study.db").exists()
    assert (out / "results.csv").exists() and (out / "best.json").exists()
    study = optuna.load_study(study_name="benchtiny-serial", storage=f"sqlite:///{out}/serial.db")
    assert len(study.trials) == 3
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)


@pytest.mark.parametrize("extra", [["--resume"], ["--storage", "sqlite:///x.db"], ["--ray"]])
def test_sweep_serial_refuses_the_options_it_cannot_honour(tmp_path, capsys, extra):
    from hftc.__main__ import main

    assert main(["sweep", str(_spec_file(tmp_path)), "--serial", "--out", str(tmp_path / "o"),
                 *extra]) == 2
    assert "--serial runs stock Optuna one trial at a time" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bench_workloads_sweep_is_the_demos_sweep_bench(monkeypatch, capsys):
    import hftc.bench.sweep as bench_sweep
    from hftc.__main__ import main

    asked = []

    def fake_bench(spec_ref, rounds, threads, same_trials, seeds):
        asked.append((spec_ref, rounds, threads, same_trials))
        assert seeds is None
        return {"rows": {}, "speedup": 1.0}

    monkeypatch.setattr(bench_sweep, "run_sweep_bench", fake_bench)
    monkeypatch.setattr(bench_sweep, "format_sweep_bench", lambda result: "formatted")
    assert main(["bench", "--workloads", "sweep", "--rounds", "2"]) == 0
    assert asked == [("hftc.sweep.digits", 2, 1, None)]
    assert "formatted" in capsys.readouterr().out
    assert main(["bench", "--workloads", "sweep,mlp"]) == 2  # a usage error
    assert "the sweep workload runs alone" in capsys.readouterr().err
    assert len(asked) == 1
