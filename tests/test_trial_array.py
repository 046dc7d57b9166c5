"""hftc.sweep.optimize / TrialArray: a plain PyTorch + Optuna loop (DataLoader,
augmentation, a scheduler) made a fused sweep by array.fuse and array.report; pruned
trials leave the array in place, survivors equal the same trials trained alone."""

from __future__ import annotations

import math

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("sklearn")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from optim_helpers import single_thread  # noqa: E402, F401  (one intra-op thread)
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hftc  # noqa: E402
import hftc.sweep  # noqa: E402
from hftc.errors import SweepError  # noqa: E402

EPOCHS = 4
BATCH = 64


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float64) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return TensorDataset(x[:384], y[:384]), (x[1200:1456], y[1200:1456])


def make_model(trial_number: int) -> nn.Module:
    torch.manual_seed(1000 + trial_number)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).double()


def loader(train):  # the same order for the array and for every trial alone
    return DataLoader(train, batch_size=BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(5))


def augment(x):
    return x + 0.02 * torch.randn_like(x)


def val_losses(fused, val):
    with torch.no_grad():
        out = fused(val[0])  # [N, B, 10]
        n = out.shape[0]
        return F.cross_entropy(out.reshape(-1, 10), val[1].repeat(n),
                               reduction="none").view(n, -1).mean(1)


def train_step(fused, opt, xb, yb):
    opt.zero_grad()
    out = fused(augment(xb))
    n = out.shape[0]
    F.cross_entropy(out.reshape(-1, 10), yb.repeat(n), reduction="none").view(n, -1) \
        .mean(1).sum().backward()  # the sum: each model gets exactly its own gradient
    opt.step()


def make_objective(digits, sizes: list[int], highest_lr: float = 0.5):
    train, val = digits

    def objective(array):
        lrs = [t.suggest_float("lr", 1e-3, highest_lr, log=True) for t in array.trials]
        fused = array.fuse([make_model(t.number) for t in array.trials], strategy="fused")
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        # (no array.track: opt and sched are found and cut with fused when trials leave)
        data = loader(train)
        torch.manual_seed(77)  # the augmentation's draws
        for epoch in range(EPOCHS):
            for xb, yb in data:
                train_step(fused, opt, xb, yb)
            sched.step()
            array.report(val_losses(fused, val), epoch)
            sizes.append(len(array))
        return val_losses(fused, val)

    return objective


def alone(digits, number: int, lr: float, epochs: int) -> list[float]:
    """The trial's loop with plain torch: its own model, stock SGD and StepLR."""
    train, val = digits
    model = make_model(number)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = loader(train)
    torch.manual_seed(77)
    history = []
    for _ in range(epochs):
        for xb, yb in data:
            opt.zero_grad()
            F.cross_entropy(model(augment(xb)), yb).backward()
            opt.step()
        sched.step()
        with torch.no_grad():
            history.append(F.cross_entropy(model(val[0]), val[1]).item())
    return history


def test_pruned_trials_leave_the_array_and_survivors_equal_their_runs_alone(digits, tmp_path):
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 'study.db'}", direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=3),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0))
    sizes: list[int] = []
    hftc.sweep.optimize(study, make_objective(digits, sizes), n_trials=8, array_size=4)
    trials = study.get_trials()
    states = [t.state for t in trials]
    assert len(trials) == 8
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert pruned and complete, states  # the test must see both
    # ... and a survivor of an array that shrank (a trial of the second array completed)
    assert any(t.number >= 4 for t in complete), states
    # The second array shrank in place while its loop went on.
    assert sizes[:EPOCHS] == [4] * EPOCHS and min(sizes[EPOCHS:]) < 4, sizes
    for t in trials:
        steps = sorted(t.intermediate_values)
        history = alone(digits, t.number, t.params["lr"], len(steps))
        for step, value in zip(steps, history):
            assert t.intermediate_values[step] == pytest.approx(value, rel=1e-9, abs=1e-12), \
                (t.number, step)
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert len(steps) == EPOCHS
            assert t.value == pytest.approx(history[-1], rel=1e-9, abs=1e-12)


def test_a_diverging_model_fails_only_its_own_trial(digits, tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}",
                                direction="minimize")
    for lr in (0.05, 1e12, 0.1):  # the middle one blows up
        study.enqueue_trial({"lr": lr}, skip_if_exists=False)
    sizes: list[int] = []
    hftc.sweep.optimize(study, make_objective(digits, sizes, highest_lr=1e13), n_trials=3,
                        array_size=3)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert "diverged" in trials[1].user_attrs["hftc_fail_reason"]
    assert sizes[-1] == 2
    for t in (trials[0], trials[2]):
        history = alone(digits, t.number, t.params["lr"], EPOCHS)
        assert math.isfinite(t.value)
        assert t.value == pytest.approx(history[-1], rel=1e-9, abs=1e-12)


def test_errors_fail_the_arrays_trials_and_say_what_to_do(digits, tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}")

    def crashes(array):
        array.fuse([make_model(t.number) for t in array.trials])
        raise RuntimeError("boom in the user's loop")

    with pytest.raises(RuntimeError, match="boom"):
        hftc.sweep.optimize(study, crashes, n_trials=2, array_size=2)
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "FAIL"]
    assert study.get_trials()[0].user_attrs["hftc_fail_reason"] == \
        "RuntimeError: boom in the user's loop"

    def wrong_count(array):
        array.fuse([make_model(0)])

    with pytest.raises(SweepError, match=r"TrialArray.fuse got 1 models for 2 trials"):
        hftc.sweep.optimize(study, wrong_count, n_trials=2, array_size=2)

    def returns_none(array):
        array.fuse([make_model(t.number) for t in array.trials])

    with pytest.raises(SweepError, match=r"the objective returns_none \(.*test_trial_array"
                                         r"\.py:\d+\) returned None for trials \[4, 5\]"):
        hftc.sweep.optimize(study, returns_none, n_trials=2, array_size=2)
    assert all(t.state.name == "FAIL" for t in study.get_trials())


def test_the_contract_example_runs_as_written(digits, tmp_path):
    """shared/API.md's example, word for word inside objective (no array.track)."""
    train, val = digits
    E = 3  # noqa: N806  (the example's name)
    state = {}

    def build(t):
        return make_model(t.number)

    def train_one_epoch(fused, opt):
        if "data" not in state:  # one loader and augmentation stream per array
            state["data"] = loader(train)
            torch.manual_seed(77)
        for xb, yb in state["data"]:
            train_step(fused, opt, xb, yb)

    def objective(array):                       # array: hftc.sweep.TrialArray, N live optuna.Trials
        state.clear()
        lrs = [t.suggest_float("lr", 1e-3, 1, log=True) for t in array.trials]
        fused = array.fuse([build(t) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
        for epoch in range(E):
            train_one_epoch(fused, opt)         # the user's own loop
            per_model_metric = val_losses(fused, val)
            array.report(per_model_metric, step=epoch)   # [N]; prunes, shrinks fused/opt/schedulers in place
        final_per_model_metric = val_losses(fused, val)
        return final_per_model_metric           # [N]: tells each live trial its value

    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 'study.db'}", direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=2),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    hftc.sweep.optimize(study, objective, n_trials=6, array_size=3)
    trials = study.get_trials()
    assert len(trials) == 6
    states = {t.state.name for t in trials}
    assert states == {"COMPLETE", "PRUNED"}, states
    # the second array lost a trial before its last epoch, and its loop went on
    assert any(t.state.name == "PRUNED" and len(t.intermediate_values) < E for t in trials[3:])
    assert any(t.state.name == "COMPLETE" for t in trials[3:]), \
        [(t.state.name, len(t.intermediate_values)) for t in trials]
    for t in trials:
        model = make_model(t.number)
        opt = torch.optim.SGD(model.parameters(), lr=t.params["lr"], momentum=0.9)
        data = loader(train)
        torch.manual_seed(77)
        for step in sorted(t.intermediate_values):
            for xb, yb in data:
                opt.zero_grad()
                F.cross_entropy(model(augment(xb)), yb).backward()
                opt.step()
            with torch.no_grad():
                value = F.cross_entropy(model(val[0]), val[1]).item()
            assert t.intermediate_values[step] == pytest.approx(value, rel=1e-9, abs=1e-12)
        if t.state.name == "COMPLETE":
            assert t.value == pytest.approx(value, rel=1e-9, abs=1e-12)


def test_track_is_optional_and_refuses_a_stock_optimizer(digits, tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}")

    def objective(array):
        fused = array.fuse([make_model(t.number) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
        assert array.track(opt) is opt  # accepted: a check, the array finds it anyway
        array.track(torch.optim.SGD(fused.parameters(), lr=0.1))

    with pytest.raises(SweepError, match=r"track: objects\[0\] is a stock torch.optim.SGD, .*"
                                         r"build it as hftc.optim.SGD\(fused.parameters\(\)"):
        hftc.sweep.optimize(study, objective, n_trials=2, array_size=2)


def test_the_last_reports_values_returned_complete_the_live_trials(tmp_path):
    # `return val` after the loop, where the last report pruned a trial: val still has
    # the pruned model's entry (it was a SweepError "got 3 values for 2 live trials").
    class PruneTrialOneAtTheEnd(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 1 and trial.last_step == 1

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}",
                                pruner=PruneTrialOneAtTheEnd())

    def objective(array):
        fused = array.fuse([make_model(t.number) for t in array.trials])
        x = torch.linspace(0, 1, 128, dtype=torch.float64).reshape(2, 64)
        for step in range(2):
            with torch.no_grad():
                val = fused(x).sum((1, 2)) + step  # [N]
            array.report(val, step)
        return val

    hftc.sweep.optimize(study, objective, n_trials=3, array_size=3)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    for t in (trials[0], trials[2]):
        assert t.value == t.intermediate_values[1]
