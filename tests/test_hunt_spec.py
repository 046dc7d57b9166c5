"""The sweep spec and the fused trials API as an Optuna user writes them: the same
decisions as the same study run one trial at a time with stock Optuna, on the same
enqueued trials."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState
from torch import nn

import hftc.sweep as hs
from hftc.sweep.serial import run_serial


@pytest.fixture(autouse=True)
def _quiet():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


class _Const(nn.Module):
    """Scores ``q`` every epoch (zero weight, bias ``q``, trained with lr 0): a learning
    curve set by the trial's parameter, through the sweep's whole loop."""

    def __init__(self, q: float):
        super().__init__()
        self.fc = nn.Linear(1, 1)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.fill_(q)

    def forward(self, x):
        return self.fc(x)


def _data():
    x, y = torch.ones(16, 1), torch.zeros(16, dtype=torch.long)
    return (x, y), (x, y)


def _space(trial):
    return {"q": trial.suggest_float("q", 0.0, 1.0), "lr": 0.0}


def _score(output, target):
    return float(output.mean())


def _const_spec(pruner, n_trials: int, **kw) -> hs.SweepSpec:
    return hs.SweepSpec(name="const", space=_space, model=lambda p: _Const(p["q"]), data=_data,
                        metric=_score, direction="maximize", epochs=2, batch_size=16,
                        n_trials=n_trials, per_array=n_trials, pruner=pruner,
                        sampler="random", **kw)


def _enqueued_study(folder: Path, qs: list[float]) -> None:
    folder.mkdir(parents=True)
    study = optuna.create_study(study_name="const", storage=f"sqlite:///{folder}/study.db",
                                direction="maximize")
    for q in qs:
        study.enqueue_trial({"q": q})


def _states(study: optuna.Study) -> list[tuple[float, str]]:
    return [(round(t.params["q"], 6), t.state.name) for t in study.get_trials()]


def test_the_pruner_is_asked_at_the_last_epoch_as_in_optunas_loop(tmp_path: Path):
    """Optuna's loop (report, should_prune, every epoch; then return the value) prunes a
    trial at its last epoch too: trial 2 (0.6, below the median 0.75 of 0 and 1) is pruned
    there, one at a time. The fused sweep completed every trial that reached the last
    epoch without asking the pruner, so the study's complete trials (TPE's and the median's
    view of it, best_trial's candidates) were not the one-at-a-time study's."""
    qs = [0.5, 1.0, 0.6, 0.9]

    def pruner():  # warm-up to the last epoch: the last epoch is the only one it prunes at
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=2)

    _enqueued_study(tmp_path / "fused", qs)
    fused = hs.run(_const_spec(pruner(), 4), out=tmp_path / "fused", progress=False,
                   estimate=False)
    serial = run_serial(_const_spec(pruner(), 4), tmp_path / "serial",
                        enqueue=[{"q": q} for q in qs])
    assert _states(serial.study)[2] == (0.6, "PRUNED")
    assert _states(fused.study) == _states(serial.study)
    assert fused.study.best_trial.params == serial.study.best_trial.params


def test_trial_array_epochs_asks_the_pruner_at_the_last_epoch():
    """``for _ in array.epochs(E)`` completed a trial at its E-th report without asking the
    pruner, where ``objective(trial)`` asks it after every report."""
    scores = [0.5, 1.0, 0.6, 0.9]

    def pruner():
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1)

    def alone(trial):
        for step in range(2):
            trial.report(scores[trial.number], step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return scores[trial.number]

    def objective(array):
        for _ in array.epochs(2):
            array.report([scores[n] for n in array.numbers])

    one_at_a_time = optuna.create_study(direction="maximize", pruner=pruner())
    one_at_a_time.optimize(alone, n_trials=4)
    fused = optuna.create_study(direction="maximize", pruner=pruner())
    hs.optimize(fused, objective, n_trials=4, array_size=4)
    expected = [(t.state, t.last_step) for t in one_at_a_time.get_trials()]
    assert expected[2] == (TrialState.PRUNED, 1)
    assert [(t.state, t.last_step) for t in fused.get_trials()] == expected


class _LoggingMedian(optuna.pruners.MedianPruner):
    """A user's pruner: Optuna's median, reading more of the study than Optuna's does."""

    seen: list = []

    def prune(self, study, trial):
        self.seen.append((len(study.trials), study.directions[0].name, study.study_name))
        return super().prune(study, trial)


def test_a_users_median_pruner_subclass_may_read_the_study():
    """The study a median pruner sees inside an array (pruning.py's one-at-a-time view)
    had get_trials and direction only: a subclass reading study.trials raised an
    AttributeError from hftc's internals."""
    scores = [0.5, 1.0, 0.2, 0.9]

    def objective(array):
        for step in range(2):
            array.report([scores[n] for n in array.numbers], step)
        return [scores[n] for n in array.numbers]

    study = optuna.create_study(direction="maximize", study_name="mine",
                                pruner=_LoggingMedian(n_startup_trials=1, n_warmup_steps=0))
    hs.optimize(study, objective, n_trials=4, array_size=4)
    assert _LoggingMedian.seen and _LoggingMedian.seen[0] == (4, "MAXIMIZE", "mine")
    assert [t.state for t in study.get_trials()][2] == TrialState.PRUNED


def test_a_brute_force_sampler_runs_its_points_once_as_study_optimize_does(tmp_path: Path):
    """``BruteForceSampler`` (a define-by-run grid) asked N at a time past its last free
    points gave the extra trials repeated points (it samples at random once nothing is
    free), where ``study.optimize`` stops at the last point: 6 trials of 4 points."""

    def alone(trial):
        return trial.suggest_categorical("a", [1, 2]) * 10 + trial.suggest_int("b", 0, 1)

    def objective(array):
        a, b = array.suggest_categorical("a", [1, 2]), array.suggest_int("b", 0, 1)
        return [x * 10 + y for x, y in zip(a, b)]

    def points(study):
        return [tuple(t.params.values()) for t in study.get_trials()]

    one_at_a_time = optuna.create_study(sampler=optuna.samplers.BruteForceSampler(seed=0))
    one_at_a_time.optimize(alone, n_trials=6)
    assert len(points(one_at_a_time)) == 4
    for size in (3, 4):
        fused = optuna.create_study(sampler=optuna.samplers.BruteForceSampler(seed=0))
        hs.optimize(fused, objective, n_trials=6, array_size=size)
        assert sorted(points(fused)) == sorted(points(one_at_a_time)), size

    def space(trial):
        return {"q": trial.suggest_categorical("q", [0.2, 0.4, 0.6, 0.8]), "lr": 0.0}

    spec = _const_spec("none", 6).replace(space=space, per_array=3,
                                                       sampler=optuna.samplers.BruteForceSampler())
    result = hs.run(spec, out=tmp_path / "fused", progress=False, estimate=False)
    assert sorted(t.params["q"] for t in result.study.get_trials()) == [0.2, 0.4, 0.6, 0.8]


def test_enqueued_trials_past_n_trials_wait_as_in_study_optimize(tmp_path: Path):
    """``n_trials`` is the study's size: four enqueued trials and ``n_trials = 2`` ran all
    four (waiting trials were run whatever the budget, for the retries of dead workers'
    trials); study.optimize(n_trials=2) runs the first two and leaves two WAITING."""
    qs = [0.2, 0.5, 0.9, 0.7]
    _enqueued_study(tmp_path / "fused", qs)
    fused = hs.run(_const_spec("none", 2).replace(per_array=4), out=tmp_path / "fused",
                   progress=False, estimate=False)
    one_at_a_time = optuna.create_study()
    for q in qs:
        one_at_a_time.enqueue_trial({"q": q})
    one_at_a_time.optimize(lambda t: t.suggest_float("q", 0.0, 1.0), n_trials=2)
    expected = [(t.state, t.params) for t in one_at_a_time.get_trials()]
    assert [s for s, _ in expected] == [TrialState.COMPLETE] * 2 + [TrialState.WAITING] * 2
    assert [(t.state, t.params) for t in fused.study.get_trials()] == expected


def test_a_space_that_raises_trial_pruned_prunes_that_trial_alone(tmp_path: Path):
    """``raise optuna.TrialPruned()`` in space() (a configuration the model cannot take,
    Optuna's habit) stopped the whole sweep, failing that trial and leaving the others
    RUNNING; study.optimize prunes that trial and goes on."""

    def space(trial):
        q = trial.suggest_float("q", 0.0, 1.0)
        if q > 0.8:
            raise optuna.TrialPruned("q is too large for this model")
        return {"q": q, "lr": 0.0}

    qs = [0.2, 0.9, 0.5, 0.7]
    _enqueued_study(tmp_path / "fused", qs)
    fused = hs.run(_const_spec("none", 4).replace(space=space), out=tmp_path / "fused",
                   progress=False, estimate=False)
    one_at_a_time = optuna.create_study()
    for q in qs:
        one_at_a_time.enqueue_trial({"q": q})
    one_at_a_time.optimize(lambda t: space(t)["q"], n_trials=4)
    assert [t.state.name for t in one_at_a_time.get_trials()] == [
        "COMPLETE", "PRUNED", "COMPLETE", "COMPLETE"]
    assert _states(fused.study) == [(round(t.params["q"], 6), t.state.name)
                                    for t in one_at_a_time.get_trials()]


def test_a_refill_build_that_raises_trial_pruned_prunes_only_the_newcomer():
    """``build(trial)`` of ``refill_with`` raising optuna.TrialPruned failed the new trial
    and the raise ended the objective, pruning every live trial of the array with it."""
    import hftc

    torch.manual_seed(0)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)

    def build(trial):
        lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        if lr > 0.05:
            raise optuna.TrialPruned("lr too large")
        return nn.Linear(4, 1).double(), {"lr": lr}

    def objective(array):
        built = [build(t) for t in array.trials]
        fused = array.fuse([m for m, _ in built])
        opt = hftc.optim.SGD(fused.parameters(), lr=[h["lr"] for _, h in built])
        array.refill_with(build)
        for _ in array.epochs(2):
            opt.zero_grad()
            losses = hftc.per_model(nn.functional.mse_loss)(fused(x), y)
            losses.sum().backward()
            opt.step()
            values = [float("nan") if t.number == 1 else v  # trial 1 diverges: a free place
                      for t, v in zip(array.trials, losses.tolist())]
            array.report(values)

    study = optuna.create_study()
    for lr in (0.01, 0.02, 0.09, 0.03):
        study.enqueue_trial({"lr": lr})
    hs.optimize(study, objective, n_trials=4, array_size=2)
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "FAIL", "PRUNED",
                                                          "COMPLETE"]


def test_a_study_in_the_folder_is_continued_by_arrays_of_one_not_replaced(tmp_path: Path):
    """A sweep of arrays of one (``per_array = 1``: too small to gain, run with stock
    Optuna in a fresh ``serial.db``) ignored the study already in ``--out``: its enqueued
    trials did not run, its finished trials were not counted in ``n_trials``, and
    results.csv / best.json were written over with the fresh study's."""
    import json

    out = tmp_path / "sweep"
    _enqueued_study(out, [0.2, 0.9, 0.5])
    first = hs.run(_const_spec("none", 2), out=out, progress=False, estimate=False)
    assert [t.params.get("q") for t in first.study.get_trials()] == [0.2, 0.9, None]
    again = hs.run(_const_spec("none", 3).replace(per_array=1), out=out, progress=False,
                   estimate=False)
    assert [round(t.params["q"], 6) for t in again.study.get_trials()] == [0.2, 0.9, 0.5]
    assert all(t.state == TrialState.COMPLETE for t in again.study.get_trials())
    assert json.loads((out / "best.json").read_text())["params"]["q"] == 0.9
    assert len((out / "results.csv").read_text().strip().splitlines()) == 1 + 3


def test_a_multi_objective_spec_is_a_spec_error_saying_what_to_do(tmp_path: Path):
    """``directions = ["minimize", "maximize"]`` (optuna.create_study's name) in a spec
    file was read as a helper of the user's: the sweep ran one objective, the default
    direction, silently. A list in ``direction`` is refused with the same advice."""
    from hftc.errors import SpecError

    spec = tmp_path / "multi.py"
    spec.write_text(
        "import torch\nfrom torch import nn\n"
        "directions = ['minimize', 'maximize']\n"
        "def space(trial):\n    return {'lr': trial.suggest_float('lr', 1e-3, 1e-1)}\n"
        "def model(params):\n    return nn.Linear(2, 2)\n"
        "def data():\n    x = torch.randn(8, 2)\n    y = torch.zeros(8, dtype=torch.long)\n"
        "    return (x, y), (x, y)\n")
    with pytest.raises(SpecError, match=r"defines directions = \['minimize', 'maximize'\].*"
                                        r"one objective.*hftc\.sweep\.optimize"):
        hs.load_spec(spec)
    with pytest.raises(SpecError, match="spec.direction is .*one objective"):
        _const_spec("none", 2).replace(direction=["minimize", "maximize"])


@pytest.mark.parametrize("line, said", [
    ("storage = 'sqlite:///shared.db'", r"storage = 'sqlite:///shared\.db'.*--storage URL"),
    ("study_name = 'lr-sweep-3'", r"study_name = 'lr-sweep-3'.*name = \.\.\."),
    ("timeout = 3600", r"timeout = 3600.*no time limit.*hftc\.sweep\.optimize"),
    ("n_jobs = 4", r"n_jobs = 4.*per_array"),
    ("callbacks = [print]", r"callbacks = .*on_epoch"),
])
def test_optunas_arguments_in_a_spec_are_a_spec_error_not_ignored(tmp_path: Path, line, said):
    """study.optimize's / create_study's names in a spec were read by nothing: a
    ``storage`` URL left each machine its own SQLite study, a ``timeout`` never stopped
    the sweep. Now a SpecError names the line's value and what the sweep has instead."""
    from hftc.errors import SpecError

    spec = tmp_path / "optuna_habits.py"
    spec.write_text(
        "import torch\nfrom torch import nn\n" + line + "\n"
        "def space(trial):\n    return {'lr': trial.suggest_float('lr', 1e-3, 1e-1)}\n"
        "def model(params):\n    return nn.Linear(2, 2)\n"
        "def data():\n    x = torch.randn(8, 2)\n    y = torch.zeros(8, dtype=torch.long)\n"
        "    return (x, y), (x, y)\n")
    with pytest.raises(SpecError, match=said):
        hs.load_spec(spec)
    spec.write_text(spec.read_text().replace(line.split(" =")[0], "_" + line.split(" =")[0]))
    assert hs.load_spec(spec).name == "optuna_habits"  # a value of the user's own: fine


def test_the_one_at_a_time_replay_puts_trials_in_the_sweeps_hyperband_brackets(tmp_path):
    """The summary's one-at-a-time trial-epochs (serial.replay_optuna) replayed the curves
    in an unnamed study: a HyperbandPruner's bracket of trial k is hash(study name, k), so
    each run pruned them in other, random brackets (another count each time)."""
    import math

    from hftc.sweep.serial import replay_optuna

    epochs = 9
    spec = _const_spec(optuna.pruners.HyperbandPruner(min_resource=1, max_resource=epochs,
                                                      reduction_factor=3), 24)
    spec = spec.replace(epochs=epochs, name="hb-sweep")
    curves = [[abs(math.sin(k * 1.7)) + 1.0 / (e + 1) for e in range(epochs)] for k in range(24)]
    trials = [optuna.trial.create_trial(value=c[-1], params={}, distributions={},
                                        intermediate_values=dict(enumerate(c, 1)))
              for c in curves]
    for k, t in enumerate(trials):
        t.number = k
    one_at_a_time = optuna.create_study(study_name="hb-sweep", direction="maximize",
                                        pruner=optuna.pruners.HyperbandPruner(
                                            min_resource=1, max_resource=epochs,
                                            reduction_factor=3))
    expected = 0
    for curve in curves:
        trial, state = one_at_a_time.ask(), TrialState.COMPLETE
        for step, value in enumerate(curve, 1):
            expected += 1
            trial.report(value, step)
            if trial.should_prune():
                state = TrialState.PRUNED
                break
        one_at_a_time.tell(trial, curve[-1] if state == TrialState.COMPLETE else None,
                           state=state)
    assert expected < 24 * epochs  # (Hyperband pruned some)
    counts = {replay_optuna(spec, trials, tmp_path / f"r{i}", sample=2)[1] for i in range(2)}
    assert counts == {expected}


def test_a_sampler_or_pruner_class_without_parentheses_is_made_with_its_defaults(tmp_path):
    """``sampler = optuna.samplers.TPESampler`` (the class) was called as a function
    ``sampler(seed)``: TPESampler(0) is consider_prior=0, CmaEsSampler(seed) is x0=seed;
    a sampler that needs arguments (GridSampler) failed inside Optuna."""
    from hftc.errors import SpecError
    from hftc.sweep.storage import make_pruner, make_sampler

    spec = _const_spec(optuna.pruners.MedianPruner, 3).replace(
        sampler=optuna.samplers.TPESampler, seed=5)
    sampler = make_sampler(spec, 7)
    assert type(sampler) is optuna.samplers.TPESampler
    default = optuna.samplers.TPESampler(seed=7)
    assert sampler._parzen_estimator_parameters == default._parzen_estimator_parameters
    assert type(make_pruner(spec)) is optuna.pruners.MedianPruner
    result = hs.run(spec, out=tmp_path / "s", progress=False, estimate=False)
    assert [t.state for t in result.study.get_trials()] == [TrialState.COMPLETE] * 3
    with pytest.raises(SpecError, match=r"spec.sampler is the class GridSampler.*"
                                        r"optuna\.samplers\.GridSampler\(\.\.\.\)"):
        make_sampler(spec.replace(sampler=optuna.samplers.GridSampler), 0)


class _CountingMedian(optuna.pruners.MedianPruner):
    """A user's pruner that writes down each decision it is asked for (its own log)."""

    def __init__(self):
        super().__init__(n_startup_trials=1, n_warmup_steps=0)
        self.asked: list[tuple[int, int]] = []

    def prune(self, study, trial):
        self.asked.append((trial.number, trial.last_step))
        return super().prune(study, trial)


def test_the_speedup_estimates_replay_does_not_call_the_users_pruner(tmp_path: Path):
    """After the sweep, off its clock, the summary's estimate replays the learning curves
    through a stock Optuna study: with the spec's own pruner object, whose log (TensorBoard,
    a file, a count) then held each decision twice, the second ones about no real trial."""
    pruner = _CountingMedian()
    result = hs.run(_const_spec(pruner, 4), out=tmp_path / "s", progress=False)
    assert result.estimated and pruner.asked
    decided = [(t.number, s) for t in result.study.get_trials() for s in t.intermediate_values]
    assert sorted(pruner.asked) == sorted(decided)


class _BrokenSampler(optuna.samplers.RandomSampler):
    """A sampler that cannot sample (CmaEsSampler without its cmaes package raises so)."""

    def sample_independent(self, study, trial, param_name, param_distribution):
        raise ModuleNotFoundError("No module named 'cmaes'")


def test_a_samplers_error_at_the_start_of_a_trial_names_the_sampler(tmp_path: Path):
    """The note on an error raised while a trial started blamed the spec's space(),
    model(), optimizer() or scheduler() and its params ({} here: nothing was suggested yet)
    where the study's sampler had raised inside trial.suggest_*."""
    spec = _const_spec("none", 2).replace(sampler=_BrokenSampler())
    with pytest.raises(ModuleNotFoundError) as raised:
        hs.run(spec, out=tmp_path / "s", progress=False, estimate=False)
    note = "\n".join(getattr(raised.value, "__notes__", []))
    assert "raised in the study's sampler (_BrokenSampler)" in note, note
    assert "Make the spec's function take these params" not in note


def test_best_json_keeps_derived_numpy_values_of_the_space(tmp_path: Path):
    """``"width": np.power(2, trial.suggest_int("log_width", 2, 4))`` is an np.int64, which
    json.dumps refuses: the sweep then recorded no params of space()'s, and best.json gave
    trial.params, without the derived values model(best["params"]) needs."""
    import json

    import numpy as np

    def space(trial):
        return {"q": trial.suggest_float("q", 0.0, 1.0), "lr": np.float32(0.0),
                "width": np.power(2, trial.suggest_int("log_width", 2, 4)),
                "scale": torch.tensor(0.5, dtype=torch.float64)}

    result = hs.run(_const_spec("none", 2).replace(space=space), out=tmp_path / "s",
                    progress=False, estimate=False)
    best = json.loads((tmp_path / "s" / "best.json").read_text())
    trial = result.study.best_trial
    assert best["params"] == {"q": trial.params["q"], "lr": 0.0, "scale": 0.5,
                              "width": 2 ** trial.params["log_width"]}


def test_the_benchs_one_at_a_time_side_names_its_study_as_the_fused_one(tmp_path, monkeypatch):
    """``hftc bench --sweep --same-trials``: the one-at-a-time study was ``<name>-serial``
    and the fused one ``<name>``; a HyperbandPruner's bracket of trial k is hash(study
    name, k), so the same trials were pruned in other brackets on the two sides."""
    import hftc.sweep.serial as serial
    from hftc.bench.sweep import _side

    spec_file = tmp_path / "hb.py"
    spec_file.write_text(
        "import torch\nfrom torch import nn\n"
        "pruner = 'hyperband'\nepochs = 3\nn_trials = 3\n"
        "def space(trial):\n    return {'lr': trial.suggest_float('lr', 1e-3, 1e-1)}\n"
        "def model(params):\n    return nn.Linear(2, 2)\n"
        "def data():\n    x = torch.randn(16, 2)\n    y = torch.zeros(16, dtype=torch.long)\n"
        "    return (x, y), (x, y)\n")
    names = []
    real = serial.run_serial

    def recording(spec, out, **kw):
        result = real(spec, out, **kw)
        names.append(result.study.study_name)
        return result

    monkeypatch.setattr(serial, "run_serial", recording)
    side = _side("serial", str(spec_file), str(tmp_path / "out"), 1,
                 [{"lr": 0.01}, {"lr": 0.05}, {"lr": 0.09}])
    assert side["trials"] == 3 and names == ["hb"]
