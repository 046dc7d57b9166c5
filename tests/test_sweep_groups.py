"""The sweep's arrays stay full across widths and optimizer classes (issue 34 item 4).

A digits spec whose trials pick SGD or Adam and a CNN width: with ``pad_widths = True``
trials of both classes and of near widths share one array (a MixedOptimizer over a
padded fused module), a far width goes apart with the padding cost as the reason. Every
trial equals the same trial trained alone (float64, 1e-9 relative), through pruning and
re-fusing (each survivor's weights and optimizer state at its own width), best.pt, and
SIGKILL then --resume.
"""

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

import hftc.sweep as hs
from hftc.sweep.digits import DigitsCNN

ROOT = Path(__file__).resolve().parents[1]

SPEC_SOURCE = '''
"""The digits CNN with a width and an optimizer class per trial, widths padded (float64)."""
import os
import signal

import optuna
import torch
import torch.nn.functional as F

from hftc.sweep import digits
from hftc.sweep.digits import DigitsCNN

name = "groups"
epochs = 3
batch_size = 32
n_trials = 6
per_array = 4
dtype = torch.float64
sampler = "random"
pad_widths = True        # widths 6 and 8 pad into one array (1.18x <= max_padding)
max_padding = 1.25       # width 16 with them would be 1.45x: apart
KILL = os.environ.get("HFTC_TEST_KILL", "")  # "metric:N": SIGKILL at the Nth metric call
calls = [0]

# Trials 0-3 hold both classes and both near widths (the first array); trial 4 is wide.
WIDTHS = (6, 6, 8, 8, 16, 8)
CLASSES = ("sgd", "adam", "sgd", "adam", "sgd", "adam")


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-2, 1e-1, log=True),
            "width": WIDTHS[trial.number % 6], "opt": CLASSES[trial.number % 6]}


def model(params):
    return DigitsCNN(width=params["width"])


def optimizer(params, module):
    if params["opt"] == "sgd":
        return torch.optim.SGD(module.parameters(), lr=params["lr"], momentum=0.9,
                               weight_decay=1e-3)
    return torch.optim.Adam(module.parameters(), lr=params["lr"] / 10)


class PruneTrialOneAfterOneEpoch(optuna.pruners.BasePruner):
    """Trial 1 leaves after epoch 1: the mixed, padded array is cut and re-fused."""

    def prune(self, study, trial):
        return trial.number == 1 and max(trial.intermediate_values, default=0) >= 1


pruner = PruneTrialOneAfterOneEpoch()


def metric(output, target):
    calls[0] += 1
    if KILL == f"metric:{calls[0]}":
        os.kill(os.getpid(), signal.SIGKILL)
    return F.cross_entropy(output, target).item()


def data():
    return digits.data(n_train=128, n_val=64)
'''


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "groups_spec.py"
    path.write_text(SPEC_SOURCE)
    return path


@pytest.fixture(scope="module")
def swept(spec_file: Path, tmp_path_factory) -> tuple[hs.SweepResult, Path]:
    out = tmp_path_factory.mktemp("sweep") / "out"
    return hs.run(spec_file, out=out, progress=False), out


def _alone(spec_file: Path | hs.SweepSpec, t: optuna.trial.FrozenTrial):
    params = t.user_attrs.get("hftc_params", t.params)
    return hs.train_alone(hs.load_spec(spec_file), params, t.user_attrs["hftc_seed"],
                          t.user_attrs["hftc_orders"])


def _assert_each_curve_as_alone(spec, trials) -> None:
    """Every reported epoch of every trial is the same trial's trained alone (1e-9)."""
    for t in trials:
        fused = [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
        _, alone = _alone(spec, t)
        assert len(alone) == len(fused) >= 1
        for a, b in zip(alone, fused):
            assert abs(a - b) <= 1e-9 * abs(a), (t.number, alone, fused)


def test_classes_and_widths_share_an_array_each_trial_as_alone(spec_file: Path, swept):
    result, out = swept
    trials = result.study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED] + [
        TrialState.COMPLETE] * 4
    # Round 1: trials 0-3 (SGD and Adam, widths 6 and 8) in one array of 4; then trial 1
    # pruned, trial 4 (width 16) asked: [0, 2, 3] padded and [4] apart.
    assert result.formations[0] == (4,)
    assert result.formations[1] == (3, 1)
    assert result.padded[0] == ([0, 1, 2, 3], 2, pytest.approx(1.18, abs=0.01))
    assert result.mixed[0] == ([0, 1, 2, 3], ["SGD", "Adam"])
    assert any("trials [4] vs [0, 2, 3]: widths too far apart: padded into one array they "
               "would do 1.97x the models' own arithmetic (> max_padding=1.25)" in reason
               for reason in result.apart), result.apart
    summary = result.summary
    assert "padded widths: " in summary and "optimizer classes in one array: " in summary
    assert "SGD + Adam" in summary
    _assert_each_curve_as_alone(spec_file, trials)
    # best.pt: the best trial's weights at its own width, those it ends with alone.
    best = result.study.best_trial
    model, _ = _alone(spec_file, best)
    saved = torch.load(out / "best.pt", weights_only=True)
    weights = model.state_dict()
    assert saved.keys() == weights.keys()
    for k in weights:
        assert saved[k].shape == weights[k].shape, k
        torch.testing.assert_close(saved[k], weights[k], rtol=1e-9, atol=1e-12)


def test_optimizers_that_cannot_be_fused_together_go_apart_saying_why(spec_file: Path,
                                                                      tmp_path: Path):
    """Two param groups for SGD in some trials, one in others: one class's optimizers
    need the same groups, so those trials form another array (Adam with two groups
    shares the one-group SGD trials' array: each class has its own groups)."""
    def optimizer(params, module):
        decay = [p for p in module.parameters() if p.dim() >= 2]
        rest = [p for p in module.parameters() if p.dim() < 2]
        if params["opt"] == "adam":
            return torch.optim.Adam([{"params": decay}, {"params": rest}], lr=params["lr"])
        if params["width"] == 8:
            return torch.optim.SGD([{"params": decay}, {"params": rest, "weight_decay": 0}],
                                   lr=params["lr"])
        return torch.optim.SGD(module.parameters(), lr=params["lr"])

    spec = hs.load_spec(spec_file).replace(optimizer=optimizer, n_trials=4, epochs=1,
                                           pruner="none", max_padding=2.0)
    result = hs.run(spec, out=tmp_path / "out", progress=False)
    # trials 0 (SGD, 1 group), 1 (Adam), 3 (Adam) together; 2 (SGD, 2 groups) apart
    assert result.formations == [(3, 1)]
    assert any("trials [2] vs [0, 1, 3]: optimizers SGD vs SGD (2 param groups)" in reason
               for reason in result.apart), result.apart
    for t in result.study.trials:
        _, alone = _alone(spec, t)
        assert abs(alone[-1] - t.value) <= 1e-9 * abs(alone[-1]), (t.number, alone, t.value)


def _sampled_space(trial):
    return {"lr": trial.suggest_float("lr", 1e-2, 1e-1, log=True),
            "width": trial.suggest_int("width", 6, 8),
            "opt": trial.suggest_categorical("opt", ["sgd", "adam"])}


def test_sampled_widths_and_classes_keep_the_array_full(spec_file: Path, tmp_path: Path):
    """Whatever TPE asks (suggest_int widths, a categorical optimizer class), the array
    holds every trial: without padding and mixed classes it would be split up to six
    ways."""
    spec = hs.load_spec(spec_file).replace(space=_sampled_space, sampler="tpe", n_trials=6,
                                           per_array=6, epochs=1, pruner="none",
                                           max_padding=1.5)  # any mix of 6..8: <= 1.34x
    result = hs.run(spec, out=tmp_path / "out", progress=False)
    trials = result.study.trials
    assert result.formations == [(6,)]
    assert len({(t.params["width"], t.params["opt"]) for t in trials}) > 2
    for t in trials:
        _, alone = _alone(spec, t)
        assert abs(alone[-1] - t.value) <= 1e-9 * abs(alone[-1]), (t.number, alone, t.value)


def _width_by_number(trial):
    # trials 0, 1, 4, 5 of width 6; 2, 3 of width 16 (not padded: two arrays)
    return {"lr": trial.suggest_float("lr", 1e-2, 1e-1, log=True),
            "width": 16 if trial.number in (2, 3) else 6,
            "opt": "adam" if trial.number == 3 else "sgd"}


class _PruneOneThenFour(optuna.pruners.BasePruner):
    """Trial 1 after epoch 1, trial 4 after its second: only the width-6 array changes."""

    def prune(self, study, trial):
        return trial.number in (1, 4) and trial.last_step == (1 if trial.number == 1 else 2)


# (the sweep gives each trial's own module its trained weights as the arrays change: on
# purpose, so no warning that a model given to hftc.fuse was written since)
@pytest.mark.filterwarnings("error::hftc.errors.UsageWarning")
def test_an_array_whose_trials_did_not_change_is_kept_as_it_is(spec_file: Path,
                                                               tmp_path: Path):
    """Two arrays (widths 6 and 16, not padded). The width-6 array is fused anew when
    trial 4 takes pruned trial 1's place and when 5 takes 4's, and cut in place when 0
    completes; the width-16 array of trials 2 and 3 stays one fused module all along
    (fused once, its programs kept), and every trial equals itself trained alone."""
    seen = []
    spec = hs.load_spec(spec_file).replace(space=_width_by_number, pad_widths=False,
                                           n_trials=6, per_array=4, epochs=4,
                                           pruner=_PruneOneThenFour())
    result = hs.Sweep(spec, out=tmp_path / "out", progress=False, on_round=lambda sweep: seen.append(
        {tuple(r.number for r in a.members): a.fused for a in sweep.arrays})).run()
    trials = result.study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED,
                                         TrialState.COMPLETE, TrialState.COMPLETE,
                                         TrialState.PRUNED, TrialState.COMPLETE]
    assert [sorted(arrays) for arrays in seen[:5]] == [
        [(0, 1), (2, 3)], [(0, 4), (2, 3)], [(0, 4), (2, 3)], [(0, 5), (2, 3)], [(5,)]]
    wide = [arrays[(2, 3)] for arrays in seen[:4]]
    assert all(f is wide[0] for f in wide)
    assert seen[1][(0, 4)] is not seen[0][(0, 1)] and seen[3][(0, 5)] is not seen[2][(0, 4)]
    assert seen[4][(5,)] is seen[3][(0, 5)]  # cut in place
    assert result.formations == [(2, 2), (2, 2), (2, 2), (1,)], result.formations
    _assert_each_curve_as_alone(spec, trials)


def _cli(spec_file: Path, out: Path, *extra: str, kill: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HFTC_TEST_KILL=kill)
    return subprocess.run([sys.executable, "-m", "hftc", "sweep", str(spec_file), "--out",
                           str(out), "--no-progress", "--threads", "1", *extra], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def _outcome(out: Path) -> list[tuple]:
    study = optuna.load_study(study_name="groups", storage=f"sqlite:///{out / 'study.db'}")
    return [(t.number, t.state, t.params, dict(t.intermediate_values), t.value)
            for t in study.trials]


def test_sigkill_mid_round_then_resume_gives_the_uninterrupted_results(
        spec_file: Path, tmp_path: Path):
    """Killed while the re-formed arrays evaluate round 2 (metric calls: 4 in round 1, 1
    for the epoch trained alone after it, then round 2's): --resume continues the padded,
    mixed array's trials from round 1's checkpoint at their own widths, and every trial
    ends as in the uninterrupted sweep."""
    out = tmp_path / "out"
    killed = _cli(spec_file, out, kill="metric:7")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    resumed = _cli(spec_file, out, "--resume", "-v")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed 4 trial(s): 0@epoch 1, 2@epoch 1, 3@epoch 1, 4@epoch 0" in resumed.stdout, \
        resumed.stdout
    full = tmp_path / "full"  # (one thread, as the killed and resumed runs)
    done = _cli(spec_file, full)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _outcome(out) == _outcome(full)


def test_pad_widths_and_max_padding_are_checked(spec_file: Path):
    with pytest.raises(hs.SpecError, match=r"spec.max_padding must be a number >= 1 .* got 0.5"):
        hs.load_spec(spec_file).replace(max_padding=0.5)
    with pytest.raises(hs.SpecError, match=r"spec.pad_widths must be True or False, got 'yes'"):
        hs.load_spec(spec_file).replace(pad_widths="yes")


def test_the_widths_of_the_digits_cnn_pad_as_the_spec_says():
    """The spec's comments hold: widths 6 and 8 pad within max_padding, 16 does not."""
    from hftc.module.padding import padding_ratio, weight_shapes

    shapes = {w: weight_shapes(DigitsCNN(width=w)) for w in (6, 8, 16)}
    assert padding_ratio([shapes[6], shapes[8]]) <= 1.25 < padding_ratio(
        [shapes[6], shapes[8], shapes[16]])


def test_load_model_slice_of_a_padded_mixed_optimizer_checkpoint():
    """What the sweep's checkpoints and re-fusing read: a MixedOptimizer (SGD with momentum
    and weight decay, Adam) over a padded array, its state_dict through torch.save / load;
    load_model_slice gives each model its own class's state at its own width, and the
    model trains on from there exactly as it would have alone."""
    import io

    import torch.nn.functional as F
    from torch import nn

    import hftc
    from hftc.optim.slicing import fused_param_names, load_model_slice

    def mlp(hidden):  # pytorch/examples' MNIST MLP in small
        return nn.Sequential(nn.Linear(5, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                             nn.Linear(hidden, 3)).double()

    def make_opt(i, model):
        return (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
                if i == 0 else torch.optim.Adam(model.parameters(), lr=1e-2))

    torch.manual_seed(0)
    x, y = torch.randn(4, 16, 5, dtype=torch.float64), torch.randint(0, 3, (4, 16))
    models = [mlp(6), mlp(9)]
    alone = [mlp(6), mlp(9)]
    for a, m in zip(alone, models):
        a.load_state_dict(m.state_dict())
    alone_opts = [make_opt(i, a) for i, a in enumerate(alone)]
    fused = hftc.fuse(models, pad_widths=True)
    opt = hftc.optim.fuse_optimizers(fused, [make_opt(i, m) for i, m in enumerate(models)])
    for step in range(3):
        opt.zero_grad()
        out = fused(x[step])
        sum(F.cross_entropy(out[i], y[step]) for i in range(2)).backward()
        opt.step()
        for a, o in zip(alone, alone_opts):
            o.zero_grad()
            F.cross_entropy(a(x[step]), y[step]).backward()
            o.step()
    buffer = io.BytesIO()
    torch.save({"state": opt.state_dict(), "names": fused_param_names(fused, opt)}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    for j, (want, want_opt) in enumerate(zip(alone, alone_opts)):
        model = mlp((6, 9)[j])
        model.load_state_dict(fused.model_state_dict(j))
        own_opt = load_model_slice(saved["state"], saved["names"], j, make_opt(j, model), model)
        assert type(own_opt) is type(want_opt)
        for (name, p), q in zip(model.named_parameters(), want.parameters()):
            for key, value in want_opt.state[q].items():
                assert own_opt.state[p][key].shape == value.shape, (j, name, key)
                torch.testing.assert_close(own_opt.state[p][key], value, rtol=1e-9, atol=1e-12)
        for m, o in ((model, own_opt), (want, want_opt)):  # one more step each
            o.zero_grad()
            F.cross_entropy(m(x[3]), y[3]).backward()
            o.step()
        for (name, p), q in zip(model.named_parameters(), want.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)
