"""A sweep over widths and optimizer classes keeps its arrays full (issue "Fuse what
differs", item 4): trials of other hidden widths share an array padded to the widest
(``pad_widths = True`` in the spec), trials of other optimizer classes share one mixed
fused optimizer; every trial still equals its run alone, and a sweep killed mid-epoch
and resumed ends as the uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState
from test_sweep_faults import DRIVER, ROOT, _outcome

import hftc.sweep as hs

SPEC_SOURCE = '''
import torch
import torch.nn.functional as F
from torch import nn

name = "widths"
metric = "loss"
epochs = 3
batch_size = 40
n_trials = 6
per_array = 6
dtype = torch.float64
pruner = "none"
sampler = "random"
pad_widths = True
max_padding = 4.0


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(12, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.norm(self.fc1(x))))


def space(trial):
    return {"lr": trial.suggest_float("lr", 0.01, 0.1, log=True),
            "hidden": trial.suggest_categorical("hidden", [8, 12, 16]),
            "opt": trial.suggest_categorical("opt", ["sgd", "adam"])}


def model(params):
    return MLP(params["hidden"])


def optimizer(params, module):
    if params["opt"] == "sgd":
        return torch.optim.SGD(module.parameters(), lr=params["lr"], momentum=0.9,
                               weight_decay=1e-4)
    return torch.optim.Adam(module.parameters(), lr=params["lr"] / 10)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=g)
    y = (x @ torch.randn(12, 3, generator=g)).argmax(1)
    return (x[:160], y[:160]), (x[160:], y[160:])
'''


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "widths_spec.py"
    path.write_text(SPEC_SOURCE)
    return path


@pytest.fixture(scope="module")
def uninterrupted(spec_file: Path, tmp_path_factory) -> hs.SweepResult:
    return hs.run(spec_file, out=tmp_path_factory.mktemp("full") / "out", progress=False)


def test_widths_and_optimizer_classes_share_one_array(spec_file: Path,
                                                      uninterrupted: hs.SweepResult):
    trials = uninterrupted.study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6
    assert len({t.params["hidden"] for t in trials}) > 1
    assert len({t.params["opt"] for t in trials}) > 1
    assert uninterrupted.formations[0] == (6,), uninterrupted.formations
    spec = hs.load_spec(spec_file)
    for t in trials:
        _, history = hs.train_alone(spec, dict(t.params), t.user_attrs["hftc_seed"],
                                    t.user_attrs["hftc_orders"])
        fused = [t.intermediate_values[k] for k in sorted(t.intermediate_values)]
        assert len(history) == len(fused)
        for a, b in zip(fused, history):
            assert abs(a - b) <= 1e-9 * max(abs(b), 1.0), (t.number, t.params, fused, history)


def test_best_pt_holds_the_best_trials_own_width(spec_file: Path,
                                                 uninterrupted: hs.SweepResult):
    best = uninterrupted.study.best_trial
    state = torch.load(uninterrupted.files["best"], weights_only=True)
    model = hs.load_spec(spec_file).model(dict(best.params)).double()
    model.load_state_dict(state)  # at its own width: a padded tensor would not load
    assert model.fc1.out_features == best.params["hidden"]


def test_killed_mid_epoch_then_resumed_gives_the_uninterrupted_results(
        spec_file: Path, uninterrupted: hs.SweepResult, tmp_path: Path):
    """The padded array's checkpoint holds every model at the widest: resuming cuts each
    back to its own width (weights and optimizer state) before fusing again."""
    out = tmp_path / "out"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(driver), str(spec_file), str(out), "batch",
                           "10", "new"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    running = [t for t in optuna.load_study(study_name="widths",
                                            storage=f"sqlite:///{out / 'study.db'}").trials
               if t.state == TrialState.RUNNING]
    assert running
    logged: list[str] = []
    resumed = hs.run(spec_file, out=out, progress=False, resume=True, log=logged.append)
    assert any(m.startswith("resumed ") for m in logged), logged
    assert _outcome(resumed.study.trials) == _outcome(uninterrupted.study.trials)


def test_pad_widths_must_be_a_bool(spec_file: Path):
    with pytest.raises(hs.SpecError, match="pad_widths must be True or False"):
        hs.load_spec(spec_file).replace(pad_widths="yes")
    with pytest.raises(hs.SpecError, match="max_padding must be a number >= 1"):
        hs.load_spec(spec_file).replace(max_padding=0.5)


def _width_and_activation(trial: optuna.Trial) -> dict:
    # trial 2 alone has another width, and it has ReLU where trial 0 has GELU
    return {"lr": trial.suggest_float("lr", 0.01, 0.1, log=True),
            "hidden": 16 if trial.number == 2 else 8,
            "act": "relu" if trial.number in (2, 3) else "gelu", "opt": "sgd"}


def _model_of_activation(params):
    act = torch.nn.ReLU() if params["act"] == "relu" else torch.nn.GELU()
    return torch.nn.Sequential(torch.nn.Linear(12, params["hidden"]), act,
                               torch.nn.Linear(params["hidden"], 3))


def test_trials_apart_for_their_layers_say_so_not_different_shapes(spec_file: Path,
                                                                    tmp_path: Path):
    """With pad_widths, trials of another width and another activation are apart because
    padding joins widths only: the summary says that, not "different shapes" (which
    padding would have joined)."""
    spec = hs.load_spec(spec_file).replace(space=_width_and_activation,
                                           model=_model_of_activation, n_trials=4,
                                           epochs=1)
    result = hs.run(spec, out=tmp_path / "out", progress=False, estimate=False)
    assert result.formations[0] == (3, 1), result.formations
    apart = [line for line in result.summary.splitlines() if "not in one array" in line]
    assert apart == ["  not in one array: trials [2] vs [0, 1, 3]: pad_widths=True pads "
                     "widths only, but their modules differ from the others' at `1` (GELU "
                     "vs ReLU): the sweep's arrays join models of the same layers, in the "
                     "same order, of any widths"], result.summary
