"""Sweep specs as a newcomer writes them from docs/SWEEP.md (models nobody on the team
wrote): what the sweep says of them, and that each trial is its run alone."""

from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path

import optuna
import pytest

import hftc.sweep as hs
from hftc.errors import SweepWarning
from hftc.sweep.training import load_data, train_alone

# A small MLP on synthetic digits-like data; `#FORWARD` and `#EXTRA` are where a test puts
# what its model does differently.
SPEC = '''
import torch
from torch import nn
import torch.nn.functional as F

name = "hunt5"
epochs = 2
batch_size = 32
n_trials = 4
per_array = 2
dtype = torch.float64
#EXTRA


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 12)
        self.fc2 = nn.Linear(12, 4)
        #INIT

    def forward(self, x):
        #FORWARD
        return self.fc2(F.relu(self.fc1(x)))


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-2, 0.3, log=True),
            "momentum": trial.suggest_float("momentum", 0.0, 0.9)}


def model(params):
    return Net()


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 16, generator=g)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    return (x[:128], y[:128]), (x[128:], y[128:])
'''


def _spec(tmp_path: Path, **parts: str) -> Path:
    source = SPEC
    for marker, text in parts.items():
        source = source.replace(f"#{marker.upper()}", textwrap.dedent(text).strip())
    path = tmp_path / "spec.py"
    path.write_text(source)
    return path


def _run(path: Path, out: Path, **kw):
    log: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = hs.run(str(path), out=str(out), estimate=False, progress=False,
                        log=log.append, **kw)
    return result, log


def _assert_alone(result, spec_path: Path) -> None:
    """Every finished trial's curve is its run alone (stock model and optimizer, float64)."""
    spec = hs.load_spec(str(spec_path))
    data = load_data(spec)
    for t in result.study.trials:
        if t.state not in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
            continue
        fused = [t.intermediate_values[k] for k in sorted(t.intermediate_values)]
        params = t.user_attrs.get("hftc_params") or t.params  # (what space() returned)
        _, alone = train_alone(spec, params, t.user_attrs["hftc_seed"],
                               t.user_attrs["hftc_orders"][:len(fused)], data)
        assert fused == pytest.approx(alone, abs=1e-9), t.number


# ---------------------------------------------------------------- model by model, said


def test_an_op_no_rule_fuses_is_said_in_the_summary_and_by_verbose(tmp_path):
    """A weight_norm'd layer (torch.nn.utils.parametrize) runs model by model inside the
    fused array: exact, but nothing saved. The summary said nothing of it (fused arrays:
    2, 2), so a sweep whose arrays fuse little looked like one that fuses all."""
    path = _spec(tmp_path, init="self.fc1 = nn.utils.parametrizations.weight_norm(self.fc1)")
    result, log = _run(path, tmp_path / "out")
    lines = [line for line in result.summary.splitlines() if "model by model" in line]
    assert len(lines) == 1, result.summary
    assert "trials [0, 1, 2, 3]" in lines[0] and "`fc1`" in lines[0]
    assert "parametrized" in lines[0]
    assert sum("run model by model" in line for line in log) == 1, log  # -v: once
    _assert_alone(result, path)


def test_a_forward_run_one_by_one_is_said_in_the_summary(tmp_path):
    """A forward whose Python takes another path when traced (``type(x) is torch.Tensor``)
    fails the first-call check, and the array runs its models one by one: said only in a
    FusionWarning per array, never in the summary."""
    path = _spec(tmp_path, forward="if type(x) is torch.Tensor:\n            x = x * 2")
    result, _ = _run(path, tmp_path / "out")
    lines = [line for line in result.summary.splitlines() if "model by model" in line]
    assert len(lines) == 1, result.summary
    assert "the whole forward runs the models one by one" in lines[0]
    assert "first-call check" in lines[0] and "trials [0, 1, 2, 3]" in lines[0]
    _assert_alone(result, path)


def test_a_fully_fused_sweep_says_nothing_of_model_by_model(tmp_path):
    path = _spec(tmp_path)
    result, log = _run(path, tmp_path / "out")
    assert "model by model" not in result.summary
    assert not any("model by model" in line for line in log)
    _assert_alone(result, path)


# ---------------------------------------------------------------- a spec fixed after its error


def test_a_spec_fixed_after_its_models_could_not_be_fused_goes_on(tmp_path, capsys):
    """The first run's model cannot be fused (a branch on a tensor's value): the sweep
    fails its first array's trials and stops, naming the line. The user fixes the line and
    reruns the same command: it was refused ("started with another spec ... its trials so
    far were sampled, trained and pruned with the first"), though nothing was trained, so
    the only way on was another --out. Now it goes on in the same study, saying so; a
    study with a trained trial is still refused (tests/test_hunt_sweep.py)."""
    from hftc.__main__ import main

    path = _spec(tmp_path, forward="if x.sum().item() > 1e9:\n            x = x * 2")
    args = ["sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress",
            "--no-estimate"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "TraceError" in err and "spec.py:" in err
    assert "the models of spec.model" in err and "trials [0, 1] are failed" in err
    path.write_text(path.read_text().replace(
        "if x.sum().item() > 1e9:\n            x = x * 2", "x = torch.where(x.sum() > 1e9, x * 2, x)"))
    with pytest.warns(SweepWarning, match=r"all failed before any epoch was trained.*"
                                             r"--trials 6 for 4 trained"):
        assert main(args) == 0
    study = optuna.load_study(study_name="hunt5", storage=f"sqlite:///{tmp_path}/out/study.db")
    states = [t.state for t in sorted(study.trials, key=lambda t: t.number)]
    assert states[:2] == [optuna.trial.TrialState.FAIL] * 2
    assert all(s != optuna.trial.TrialState.FAIL for s in states[2:]) and len(states) == 4


def test_an_edited_spec_is_still_refused_once_a_trial_trained(tmp_path):
    path = _spec(tmp_path)
    _run(path, tmp_path / "out", n_trials=2)
    path.write_text(path.read_text().replace("nn.Linear(16, 12)", "nn.Linear(16, 10)")
                    .replace("nn.Linear(12, 4)", "nn.Linear(10, 4)"))
    with pytest.raises(hs.SweepError, match="started with another spec"):
        _run(path, tmp_path / "out", n_trials=4)


# ---------------------------------------------------------------- how warnings read


def test_the_command_says_a_sweep_warning_without_hftc_s_own_file_and_line(tmp_path):
    """``hftc sweep spec.py -n 1`` printed ``.../hftc/sweep/cli.py:158: SweepWarning: this
    sweep is too small ...`` and then the line ``result = run(args.spec, n_trials=...``:
    hftc's own code, which says nothing to the user. Now ``hftc sweep: warning: ...``, as
    its errors read; the warning is still a SweepWarning (filters and pytest.warns see it)."""
    import os
    import subprocess
    import sys

    path = _spec(tmp_path)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "hftc", "sweep", str(path), "-n", "1", "--trials", "2",
         "--out", str(tmp_path / "out"), "--no-progress", "--no-estimate"],
        capture_output=True, text=True, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(root), PYTHONWARNINGS="default"))
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "hftc sweep: warning: this sweep is too small to gain from fusing" in err, err
    assert "cli.py" not in err and "result = run(" not in err


def test_other_warnings_keep_their_format_and_the_format_is_put_back():
    from hftc.sweep.cli import _sweep_warnings_said

    before = warnings.formatwarning
    with _sweep_warnings_said():
        said = warnings.formatwarning(SweepWarning("x"), SweepWarning, "f.py", 3, "")
        other = warnings.formatwarning(UserWarning("y"), UserWarning, "f.py", 3, "")
    assert said == "hftc sweep: warning: x\n"
    assert other.startswith("f.py:3: UserWarning: y")
    assert warnings.formatwarning is before


# ---------------------------------------------------------------- a batch of one sample


BATCH_NORM = dict(init="self.bn = nn.BatchNorm1d(12)",
                  forward="x = x  # (the norm below)",
                  extra="batch_size = 127  # 128 training samples: the last batch holds 1")


def _batch_norm_spec(tmp_path: Path) -> Path:
    path = _spec(tmp_path, **BATCH_NORM)
    path.write_text(path.read_text().replace("F.relu(self.fc1(x))", "F.relu(self.bn(self.fc1(x)))"))
    return path


def test_a_batch_norm_on_the_epochs_last_single_sample_is_a_spec_error(tmp_path, capsys):
    """A BatchNorm and a training set that leaves one sample after the full batches: the
    sweep stopped with torch's raw traceback (ValueError: Expected more than 1 value per
    channel when training) from inside hftc's fused forward. Now a SpecError (status 2)
    naming the batch, the sizes and a batch_size that works; the same alone."""
    from hftc.__main__ import main

    path = _batch_norm_spec(tmp_path)
    out = tmp_path / "out"
    args = ["sweep", str(path), "--out", str(out), "--no-progress", "--no-estimate"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "has a batch norm" in err and "spec.model (" in err
    assert "the epoch's last batch holds 1 sample (128 training samples, batch_size=127)" in err
    assert "batch_size = 126" in err
    spec = hs.load_spec(str(path))
    with pytest.raises(hs.SpecError, match="the epoch's last batch holds 1 sample"):
        train_alone(spec, {"lr": 0.1, "momentum": 0.0}, 0, [0])
    # the advice taken, the same command goes on (nothing was trained with the first)
    path.write_text(path.read_text().replace("batch_size = 127", "batch_size = 126"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(args) == 0
    _assert_alone(hs.run(str(path), out=str(out), estimate=False, progress=False), path)


def test_a_batch_norm_spec_run_one_at_a_time_says_it_too(tmp_path, capsys):
    from hftc.__main__ import main

    path = _batch_norm_spec(tmp_path)
    assert main(["sweep", str(path), "--serial", "--out", str(tmp_path / "out")]) == 2
    assert "the epoch's last batch holds 1 sample" in capsys.readouterr().err


# ---------------------------------------------------------------- why trials are apart


def test_trials_of_other_depths_are_said_apart_by_their_layers(tmp_path):
    """``suggest_int("n_layers", 1, 3)``: the summary said ``not in one array: trials [1,
    3, 5] vs [0, 2]: optimizers over other parameters``, true of the default SGD but not
    why (the models have other layers). Now it says how the models differ."""
    path = _spec(tmp_path)
    path.write_text(path.read_text().replace(
        '"momentum": trial.suggest_float("momentum", 0.0, 0.9)}',
        '"momentum": 0.0, "n_layers": trial.suggest_int("n_layers", 1, 2)}').replace(
        "return Net()", "return nn.Sequential(nn.Linear(16, 12), nn.ReLU(), *[nn.Linear(12, 12)"
                        " for _ in range(params['n_layers'] - 1)], nn.Linear(12, 4))"))
    result, _ = _run(path, tmp_path / "out", n_trials=6, per_array=6)
    apart = [line for line in result.summary.splitlines() if "not in one array" in line]
    assert apart, result.summary
    assert not any("optimizers over other parameters" in line for line in apart), apart
    assert any("nn.Linear" in line and "shape" in line for line in apart), apart
    _assert_alone(result, path)


# ---------------------------------------------------------------- every overhead, said


@pytest.mark.parametrize("per_array", [1, 2])
def test_the_time_line_says_what_start_up_was(tmp_path, per_array):
    """A sweep too small to gain spent most of its wall clock in "start-up and other"
    (3.8 s of 7.4 s: the spec's data() 2.0 s, torch._dynamo's import 1.8 s) without a word
    of what it was; the fused sweep's data() was unsaid too. Now the line says them."""
    path = _spec(tmp_path, extra="import time as _time")
    path.write_text(path.read_text().replace("def data():\n", "def data():\n    _time.sleep(0.3)\n"))
    result, _ = _run(path, tmp_path / "out", per_array=per_array, n_trials=2)
    line = result.summary.splitlines()[0]
    said = line.split("(of it: ")[1]
    data_s = float(re.search(r"data\(\) ([\d.]+) s", said).group(1))
    assert 0.3 <= data_s <= result.wall_s, line
    other = float(line.split("start-up and other ")[1].split(" s")[0])
    assert data_s <= other + 0.05, line
    assert ("torch._dynamo's import" in said) == (per_array == 1 and result.dynamo_import_s >= 0.05)


# ---------------------------------------------------------------- the bench's stock side


CLIP_STEP = '''
import hftc


def train_step(model, batch, optimizers, params):
    x, y = batch
    for opt in optimizers:
        opt.zero_grad()
    losses = hftc.per_model(F.cross_entropy)(model(x), y)
    losses.sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), [p["clip"] for p in params])
    torch.nn.utils.clip_grad_value_(model.parameters(), [p["clip"] for p in params])
    for opt in optimizers:
        opt.step()
    return losses.detach()
'''


def test_a_train_step_clipping_per_trial_runs_on_the_bench_s_stock_side(tmp_path):
    """``clip_grad_norm_(model.parameters(), [p["clip"] for p in params])``, one value per
    trial as the fused array needs: ``hftc bench --sweep SPEC`` failed on its stock side
    (torch unpatched, HFTC_STOCK_TORCH=1) with torch's ``float() argument must be a string
    or a real number, not 'list'``. Now the stock side trains each trial as train_alone
    does in a process with hftc's patches, to the same bits."""
    import json
    import os
    import subprocess
    import sys

    path = _spec(tmp_path, extra=CLIP_STEP)
    path.write_text(path.read_text().replace(
        '"momentum": trial.suggest_float("momentum", 0.0, 0.9)}',
        '"momentum": 0.5, "clip": trial.suggest_float("clip", 0.05, 0.5)}'))
    script = (
        "import json, sys, torch\n"
        "import hftc\n"
        "from hftc.sweep.spec import load_spec\n"
        "from hftc.sweep.training import train_alone\n"
        "assert not sys.modules['hftc.patches']._installed\n"
        f"spec = load_spec({str(path)!r})\n"
        "print(json.dumps([train_alone(spec, {'lr': 0.1, 'momentum': 0.5, 'clip': c}, 0,"
        " [0, 1])[1] for c in (0.05, 0.3)]))\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(root), HFTC_STOCK_TORCH="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = json.loads(proc.stdout.splitlines()[-1])
    spec = hs.load_spec(str(path))
    patched = [train_alone(spec, {"lr": 0.1, "momentum": 0.5, "clip": c}, 0, [0, 1])[1]
               for c in (0.05, 0.3)]
    assert stock == patched
    assert stock[0] != stock[1]  # the clip value is used
    # and the fused sweep trains each trial as that
    result, _ = _run(path, tmp_path / "out", n_trials=3, per_array=3)
    _assert_alone(result, path)
