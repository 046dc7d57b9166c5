"""Bugs found hunting through fused Optuna sweeps end to end (specs, the command line,
kill and resume, the Python API)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

import hftc.sweep as hs
from hftc.errors import SweepError, SweepWarning

SPEC = '''
import torch
import torch.nn.functional as F
from torch import nn

name = "edited"
epochs = 1
batch_size = 16
n_trials = 2
per_array = 2
pruner = "none"
dtype = torch.float64
HIDDEN = 8
ACTS = {"relu": nn.ReLU, "tanh": nn.Tanh}


class Net(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1 = nn.Linear(6, HIDDEN)
        self.act = ACTS[act]()
        self.fc2 = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def space(trial):
    return {"lr": trial.suggest_float("lr", 0.01, 0.5, log=True),
            "act": trial.suggest_categorical("act", ["relu", "tanh"])}


def model(params):
    return Net(params["act"])


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return (x[:48], y[:48]), (x[48:], y[48:])
'''


def _run(tmp_path: Path, source: str, **kwargs):
    path = tmp_path / "spec.py"
    path.write_text(source)
    return hs.run(str(path), out=tmp_path / "out", estimate=False, **kwargs)


@pytest.mark.parametrize("edit, said", [
    (("0.01, 0.5, log=True", "0.001, 0.05, log=True"), "spec.space"),   # another range
    (("self.fc2(self.act(", "self.fc2(0.5 * self.act("), "spec.model"),   # the class it builds
    (('"tanh": nn.Tanh}', '"tanh": nn.GELU}'), "spec.model"),             # a class it picks
    (("epochs = 1", "epochs = 2"), "epochs was 1, now 2"),
    (("batch_size = 16", "batch_size = 8"), "batch_size was 16, now 8"),
    # a module constant the model reads, its line edited: other trials, not a knob
    (("HIDDEN = 8", "HIDDEN = 12"), "HIDDEN was 8, now 12 (its line in the spec edited)"),
])
def test_a_sweep_continued_with_an_edited_spec_is_refused(tmp_path: Path, edit, said):
    """Before: a sweep extended (--trials) or resumed (--resume) after an edit of its spec
    trained the new trials with the edited spec, silently, in the same study: trials of
    another search space, model, or number of epochs ranked side by side (Optuna only
    warned of 'inconsistent parameter values' for an edited range)."""
    first = _run(tmp_path, SPEC)
    assert len(first.study.trials) == 2
    with pytest.raises(SweepError, match="started with another spec") as info:
        _run(tmp_path, SPEC.replace(*edit), n_trials=4)
    assert said in str(info.value) and "another --out, or --study" in str(info.value)
    study = optuna.load_study(study_name="edited",
                              storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    assert len(study.trials) == 2  # nothing asked with the edited spec


def test_a_sweep_continued_with_the_same_spec_goes_on(tmp_path: Path, monkeypatch):
    """What does not change a trial is no edit: comments, moved lines, n_trials,
    per_array; a module constant the spec reads from the environment (its line the same,
    its value another) is said."""
    knob = SPEC.replace("HIDDEN = 8", "import os\nHIDDEN = int(os.environ.get('HFTC_TEST_HIDDEN', '8'))")
    _run(tmp_path, knob)
    moved = "\n\n# the same spec, commented\n" + knob.replace("    return Net(", "    # here\n    return Net(")
    result = _run(tmp_path, moved, n_trials=3, per_array=3)
    assert len(result.study.trials) == 3
    monkeypatch.setenv("HFTC_TEST_HIDDEN", "12")
    with pytest.warns(SweepWarning, match="HIDDEN was 8, now 12"):
        result = _run(tmp_path, knob, n_trials=4)
    assert len(result.study.trials) == 4


def test_numpy_values_for_an_array_of_one_trial():
    """``array.report(losses.numpy(), step)`` once the array was down to one trial (the
    others pruned) raised NumPy 2's "TypeError: only 0-dimensional arrays can be converted
    to Python scalars" from inside hftc: a NumPy array of shape [1] is that trial's value,
    as a tensor of shape [1] is."""
    import numpy as np

    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    array = hs.TrialArray(study, [study.ask()])
    assert array.report(np.array([0.5]), step=0) == []
    array.finish(np.array([0.25]))
    assert study.trials[0].intermediate_values == {0: 0.5} and study.trials[0].value == 0.25


def test_values_with_their_graph_are_taken_without_a_warning():
    """``array.report([loss_j for loss_j in losses], step)`` with the losses still
    attached to their graph made torch warn, from inside hftc, that a tensor requiring
    grad was converted to a scalar: the values are read detached."""
    import warnings

    import torch

    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    array = hs.TrialArray(study, [study.ask(), study.ask()])
    w = torch.ones(2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        array.report([w[0] * 0.5, w[1] * 0.25], step=0)
    assert [t.intermediate_values for t in study.trials] == [{0: 0.5}, {0: 0.25}]


def test_an_optimizer_on_another_modules_parameters_is_a_spec_error(tmp_path: Path):
    """``optimizer(params, module)`` building its optimizer on ``model(params)`` (a new
    module, not the one given) was refused from inside the fusing, as a FusionArgumentError
    about ``optimizers[0]`` and ``models[i]`` passed to ``hftc.fuse``, which the spec never
    calls; alone (``train_alone``) it trained weights the model does not use. Now a
    SpecError names spec.optimizer and its line, fused and alone alike."""
    from hftc.errors import SpecError

    source = SPEC + '''

def optimizer(params, module):
    return torch.optim.SGD(model(params).parameters(), lr=params["lr"])
'''
    with pytest.raises(SpecError, match=r"spec\.optimizer \(.*spec\.py:\d+\) returned the "
                                        r"optimizer on a tensor .* not a parameter of the "
                                        r"module it was given"):
        _run(tmp_path, source)
    spec = hs.load_spec(tmp_path / "spec.py")
    with pytest.raises(SpecError, match="not a parameter of the module it was given"):
        hs.train_alone(spec, {"lr": 0.1, "act": "relu"}, 0, [0])


def test_the_same_spec_object_run_again_in_one_process_is_the_same_spec(tmp_path: Path):
    """A notebook's habit: run(spec), interrupted or done, then run(spec, ...) again with
    the same objects; a pruner that sets its own attributes as it runs (hyperband's
    brackets, made at its first call) or a loss object are no edit of the spec."""
    import torch

    path = tmp_path / "spec.py"
    path.write_text(SPEC)
    spec = hs.load_spec(path).replace(
        pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=2), epochs=2,
        loss=torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    hs.run(spec, out=tmp_path / "out", estimate=False)
    result = hs.run(spec, out=tmp_path / "out", estimate=False, n_trials=4)
    assert len(result.study.trials) == 4


INTERRUPTED = SPEC + '''
import os


def space(trial):
    if os.environ.get("HFTC_TEST_INTERRUPT") == "space":
        raise KeyboardInterrupt  # Ctrl-C while the first trial is sampled
    return {"lr": trial.suggest_float("lr", 0.01, 0.5, log=True),
            "act": trial.suggest_categorical("act", ["relu", "tanh"])}


def data():
    if os.environ.get("HFTC_TEST_INTERRUPT") == "data":
        raise KeyboardInterrupt  # Ctrl-C while the data loads, before the study is made
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return (x[:48], y[:48]), (x[48:], y[48:])
'''


@pytest.mark.parametrize("where, extra, said, resumes", [
    ("data", (), "nothing to resume: rerun the same command, without --resume", False),
    ("space", (), "rerun the same command with --resume to continue", True),
    ("data", ("--serial",), "--serial keeps no checkpoints: rerun the same command", None),
])
def test_ctrl_c_says_what_to_run_next(tmp_path: Path, capsys, monkeypatch, where, extra, said,
                                      resumes):
    """Ctrl-C always said "rerun the same command with --resume to continue": before the
    study was made (the data loading) that --resume was then refused as "no sweep to
    resume", and --serial refuses --resume always."""
    from hftc.__main__ import main

    path = tmp_path / "spec.py"
    path.write_text(INTERRUPTED)
    args = ["sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress",
            "--no-estimate", *extra]
    monkeypatch.setenv("HFTC_TEST_INTERRUPT", where)
    assert main(args) == 130
    assert said in capsys.readouterr().err
    if resumes is None:
        return
    monkeypatch.delenv("HFTC_TEST_INTERRUPT")
    assert main([*args, "--resume"]) == (0 if resumes else 2)


REGRESSION = SPEC.replace('name = "edited"', 'name = "regression"\nloss = F.mse_loss').replace(
    "nn.Linear(HIDDEN, 3)", "nn.Linear(HIDDEN, 1)").replace(
    "return self.fc2(self.act(self.fc1(x)))", "return self.fc2(self.act(self.fc1(x))).squeeze(-1)"
).replace("y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()", "y = 2 * x[:, 0] + x[:, 1]")


def test_accuracy_on_regression_targets_is_a_spec_error(tmp_path: Path):
    """A regression spec (loss = F.mse_loss, float targets, one output per sample) that
    kept the default metric "accuracy" scored every trial 0.0 (argmax over a size-1 dim
    against float targets) and the sweep maximized that: a leaderboard of zeros and an
    arbitrary best trial. Now a SpecError says to set metric = 'loss'."""
    from hftc.errors import SpecError

    with pytest.raises(SpecError, match=r"spec\.metric is 'accuracy' .* output \(16,\) for "
                                        r"validation targets \(16,\) \(torch\.float64\); "
                                        r"for a regression set metric = 'loss'"):
        _run(tmp_path, REGRESSION)
    (tmp_path / "loss").mkdir()
    result = _run(tmp_path / "loss", REGRESSION + "\nmetric = 'loss'\n")
    assert result.study.direction == optuna.study.StudyDirection.MINIMIZE
    assert all(t.value > 0 for t in result.study.trials)


OUT_OF_MEMORY = SPEC.replace("n_trials = 2\nper_array = 2", "n_trials = 4\nper_array = 4").replace(
    "epochs = 1", "epochs = 2") + '''
import os


def on_epoch(logs):
    if os.environ.get("HFTC_TEST_OOM") == "1":  # as a GPU would, for an array this size
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
'''


def test_out_of_memory_keeps_the_trials_for_a_resume_with_smaller_arrays(tmp_path: Path,
                                                                          monkeypatch):
    """An out-of-memory error in a round (an array too big for the GPU) failed every live
    trial for good ("error: OutOfMemoryError"), their epochs lost, and hftc sweep printed a
    raw traceback; and a resume could not have helped: it fused all the trials it
    re-attached into one array, whatever --per-array said. Now the trials stay RUNNING,
    the error says to resume with a smaller --per-array, and the resumed arrays hold at
    most that many, each trial as if alone."""
    import torch

    from hftc.sweep.training import train_alone

    monkeypatch.setenv("HFTC_TEST_OOM", "1")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _run(tmp_path, OUT_OF_MEMORY)
    note = "".join(raised.value.__notes__)
    assert "trials [0, 1, 2, 3] are not failed: rerun with --resume and a smaller" in note
    storage = f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    study = optuna.load_study(study_name="edited", storage=storage)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.RUNNING] * 4
    monkeypatch.delenv("HFTC_TEST_OOM")
    result = _run(tmp_path, OUT_OF_MEMORY, resume=True, per_array=2)
    assert max(max(f) for f in result.formations) == 2, result.formations
    spec = hs.load_spec(tmp_path / "spec.py")
    for t in result.study.trials:
        assert t.state == optuna.trial.TrialState.COMPLETE
        _, alone = train_alone(spec, t.params, t.user_attrs["hftc_seed"],
                               t.user_attrs["hftc_orders"])
        fused = [t.intermediate_values[k] for k in sorted(t.intermediate_values)]
        assert len(fused) == 2 and max(abs(a - b) / abs(b) for a, b in zip(alone, fused)) < 1e-12


def test_where_and_in_which_arrays_trials_run_is_no_edit(tmp_path: Path):
    """Another machine's device, a smaller eval batch or other padding choose where and
    in which arrays the trials run, not what one trains: a worker with them joins."""
    _run(tmp_path, SPEC)
    edited = SPEC.replace("pruner = \"none\"", "pruner = \"none\"\neval_batch_size = 7\n"
                          "pad_widths = True\nmax_padding = 2.0")
    assert len(_run(tmp_path, edited, n_trials=3).study.trials) == 3


def test_an_on_epoch_error_keeps_the_trials_for_a_resume(tmp_path: Path, monkeypatch):
    """A logging hook that raised (a full TensorBoard disk, a typo in on_epoch) failed
    every live trial for good, their epochs lost, though the epoch was checkpointed and
    on_epoch changes nothing a trial trains. Now they stay RUNNING and --resume, with
    on_epoch fixed, ends with the uninterrupted sweep's trials."""
    source = OUT_OF_MEMORY.replace('raise torch.OutOfMemoryError("CUDA out of memory. Tried '
                                   'to allocate 20.00 GiB")', 'raise OSError("disk full")')
    monkeypatch.setenv("HFTC_TEST_OOM", "1")
    with pytest.raises(OSError, match="disk full") as raised:
        _run(tmp_path, source)
    assert "trials [0, 1, 2, 3] are not failed" in "".join(raised.value.__notes__)
    monkeypatch.delenv("HFTC_TEST_OOM")
    resumed = _run(tmp_path, source, resume=True).study.trials
    (tmp_path / "whole").mkdir()
    whole = _run(tmp_path / "whole", source).study.trials  # never interrupted

    def key(t):
        return t.number, t.state, t.params, t.intermediate_values, t.value

    assert [key(t) for t in resumed] == [key(t) for t in whole]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in resumed)
