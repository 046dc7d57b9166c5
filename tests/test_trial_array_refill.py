"""hftc.sweep.optimize with ``array.refill_with(build)`` and ``array.epochs(E)``: places
freed by pruned and completed trials are taken by new trials, each from its own step 0
(hftc.replace_models), and every trial, survivor or newcomer, equals the same trial
trained alone (float64)."""

from __future__ import annotations

import copy

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
from hftc.errors import FusionArgumentError, SweepError  # noqa: E402

EPOCHS = 3


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float64) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    return TensorDataset(x[:256], y[:256]), (x[1200:1400], y[1200:1400])


def make_model(number: int) -> nn.Module:
    torch.manual_seed(1000 + number)
    return nn.Sequential(nn.Linear(64, 24), nn.Tanh(), nn.Linear(24, 10)).double()


def epoch_batches(train):
    """The same order in every epoch, so a trial's data does not depend on when it
    joined the array (what makes refilling exact)."""
    return DataLoader(train, batch_size=64, shuffle=True,
                      generator=torch.Generator().manual_seed(7))


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, hftc.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-3}),
    "adam": (torch.optim.Adam, hftc.optim.Adam, {"weight_decay": 1e-3}),
}


class PruneSome(optuna.pruners.BasePruner):
    """Prunes trials 1 and 2 after their second epoch: deterministic places to refill."""

    def prune(self, study, trial) -> bool:
        return trial.number in (1, 2) and trial.last_step == 1


def suggest(trial):
    return trial.suggest_float("lr", 1e-3, 1e-1, log=True)


def alone(train, val, number, lr, epochs, which):
    stock_cls, _, options = OPTIMIZERS[which]
    model = make_model(number)
    opt = stock_cls(model.parameters(), lr=lr, **options)
    values = []
    for _ in range(epochs):
        for xb, yb in epoch_batches(train):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        with torch.no_grad():
            values.append(F.cross_entropy(model(val[0]), val[1]).item())
    return values


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("which", ["sgd", "adam"])
def test_freed_places_are_refilled_and_every_trial_equals_its_run_alone(
        digits, which):
    train, val = digits
    _, fused_cls, options = OPTIMIZERS[which]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3),
                                pruner=PruneSome())
    seen_replaced = []

    def objective(array):
        def build(trial):
            return make_model(trial.number), {"lr": suggest(trial)}

        built = [build(t) for t in array.trials]
        fused = array.fuse([m for m, _ in built])
        opt = fused_cls(fused.parameters(), lr=[h["lr"] for _, h in built], **options)
        array.refill_with(build)
        for _ in array.epochs(EPOCHS):
            for xb, yb in epoch_batches(train):
                opt.zero_grad()
                out = fused(xb)
                sum(F.cross_entropy(o, yb) for o in out).backward()
                opt.step()
            with torch.no_grad():
                out = fused(val[0])
                values = [F.cross_entropy(o, val[1]).item() for o in out]
            array.report(values)
            seen_replaced.append(list(array.replaced))

    hftc.sweep.optimize(study, objective, n_trials=6, array_size=3)
    trials = study.trials
    assert len(trials) == 6  # n_trials asked, no more
    states = {t.number: t.state for t in trials}
    assert states[1] == states[2] == optuna.trial.TrialState.PRUNED
    assert all(states[n] == optuna.trial.TrialState.COMPLETE for n in (0, 3, 4, 5))
    # trials 3 and 4 took the pruned ones' places, 5 the completed trial 0's
    assert [1, 2] in seen_replaced and [0] in seen_replaced
    for t in trials:
        steps = sorted(t.intermediate_values)
        assert steps == list(range(len(steps)))
        want = alone(train, val, t.number, t.params["lr"], len(steps), which)
        got = [t.intermediate_values[s] for s in steps]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=0)
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert len(steps) == EPOCHS and t.value == got[-1]


def test_replace_models_keeps_the_others_and_starts_the_new_one_fresh():
    torch.manual_seed(0)
    xs = [torch.randn(5, 64, dtype=torch.float64) for _ in range(3)]
    ys = [torch.randint(0, 10, (5,)) for _ in range(3)]
    models = [make_model(i) for i in range(3)]
    ref = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models)
    opt = hftc.optim.Adam(fused.parameters(), lr=[0.01, 0.02, 0.03], weight_decay=0.01)
    params = list(fused.parameters())

    def steps():
        for x, y in zip(xs, ys):
            opt.zero_grad()
            sum(F.cross_entropy(o, y) for o in fused(x)).backward()
            opt.step()

    steps()
    new = make_model(7)
    hftc.replace_models(fused, {1: copy.deepcopy(new)}, hyperparameters={1: {"lr": 0.05}})
    assert list(fused.parameters()) == params  # the loop's references stay valid
    assert opt.param_groups[1]["lr"] == 0.05
    steps()

    def run_alone(model, lr, rounds):
        o = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=0.01)
        for _ in range(rounds):
            for x, y in zip(xs, ys):
                o.zero_grad()
                F.cross_entropy(model(x), y).backward()
                o.step()
        return model

    wants = [run_alone(ref[0], 0.01, 2), run_alone(new, 0.05, 1), run_alone(ref[2], 0.03, 2)]
    for i, want in enumerate(wants):
        got = fused.model_state_dict(i)
        for k, v in want.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-14)


class Scaled(nn.Module):
    """A plain Python hyper-parameter in forward (the models one by one keep it on their
    shells)."""

    def __init__(self, scale: float):
        super().__init__()
        self.fc, self.scale = nn.Linear(4, 2).double(), scale

    def forward(self, x):
        return self.fc(x) * self.scale


@pytest.mark.parametrize("strategy", ["fused", "model_loop"])
def test_a_replaced_model_runs_with_its_own_python_attributes(strategy):
    # One by one, the fused module kept the shells of its first models: the new model
    # ran with its predecessor's scale (1.0, not 5.0), forward and backward.
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64)
    first = Scaled(1.0)
    fused = hftc.fuse([copy.deepcopy(first), Scaled(2.0)], strategy=strategy)
    fused(x)
    new = Scaled(5.0)
    hftc.replace_models(fused, {1: copy.deepcopy(new)})
    out = fused(x)
    want = new(x)
    torch.testing.assert_close(out[1], want, rtol=1e-12, atol=0)
    out[1].sum().backward()
    want.sum().backward()
    torch.testing.assert_close(fused.fc.weight.grad[1], new.fc.weight.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(out[0], first(x), rtol=1e-12, atol=0)  # the other: as it was


def test_a_scheduler_or_another_width_cannot_take_a_place():
    models = [make_model(i) for i in range(2)]
    fused = hftc.fuse(models)
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2])
    wide = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).double()
    with pytest.raises(FusionArgumentError,
                       match=r"the new model\(s\) at position\(s\) \[0\] do not fuse with "
                             r"the others(.|\n)*out_features 24 vs 32"):
        hftc.replace_models(fused, {0: wide})
    # with padding, another width would change the padded tensors
    padded = hftc.fuse([make_model(0), wide], pad_widths=True)
    narrow = nn.Sequential(nn.Linear(64, 40), nn.Tanh(), nn.Linear(40, 10)).double()
    with pytest.raises(FusionArgumentError, match=r"change the fused tensor `0.weight` "
                                                  r"\(\(2, 32, 64\) -> \(2, 40, 64\)\)"):
        hftc.replace_models(padded, {0: narrow})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(FusionArgumentError, match="a StepLR scheduler is built on an optimizer"):
        hftc.replace_models(fused, {0: make_model(5)})
    del sched

    study = optuna.create_study()

    def objective(array):
        fused = array.fuse([make_model(t.number) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=[0.1] * len(array.trials))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # noqa: F841 (held)
        array.refill_with(lambda trial: (make_model(trial.number), {"lr": 0.1}))

    with pytest.raises(SweepError, match="refill_with: replace_models: a StepLR scheduler"):
        hftc.sweep.optimize(study, objective, n_trials=2, array_size=2)
    assert all(t.state == optuna.trial.TrialState.FAIL for t in study.trials)


def test_report_in_epochs_is_required_and_epochs_checks_its_argument():
    study = optuna.create_study()

    def forgets(array):
        array.fuse([make_model(t.number) for t in array.trials])
        for _ in array.epochs(2):
            pass

    with pytest.raises(SweepError, match="call array.report\\(values\\) once in each epoch"):
        hftc.sweep.optimize(study, forgets, n_trials=2, array_size=2)

    def bad(array):
        array.epochs(0).__next__()

    with pytest.raises(SweepError, match="TrialArray.epochs takes a positive int"):
        hftc.sweep.optimize(optuna.create_study(), bad, n_trials=1, array_size=1)


def test_replace_models_in_a_padded_array_with_mixed_optimizer_classes():
    """pad_widths and SGD / Adam in one array (a MixedOptimizer, found without being
    listed): the new model trains as alone, the others go on, the padding stays 0."""
    torch.manual_seed(0)

    def net(h):
        return nn.Sequential(nn.Linear(6, h), nn.Sigmoid(), nn.Linear(h, 3)).double()

    xs = [torch.randn(5, 6, dtype=torch.float64) for _ in range(3)]
    ys = [torch.randint(0, 3, (5,)) for _ in range(3)]
    models = [net(8), net(12), net(16)]
    ref = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models, pad_widths=True)
    stock = [torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
             torch.optim.Adam(models[1].parameters(), lr=0.01),
             torch.optim.SGD(models[2].parameters(), lr=0.3, momentum=0.9)]
    opt = hftc.optim.fuse_optimizers(fused, stock)
    assert isinstance(opt, hftc.optim.MixedOptimizer)

    def steps(model, optimizer):
        for x, y in zip(xs, ys):
            optimizer.zero_grad()
            out = model(x)
            (sum(F.cross_entropy(o, y) for o in out) if model is fused
             else F.cross_entropy(out, y)).backward()
            optimizer.step()

    steps(fused, opt)
    new = net(12)
    want_new = copy.deepcopy(new)
    hftc.replace_models(fused, {1: new}, hyperparameters={1: {"lr": 0.02}})
    steps(fused, opt)
    for model, o, rounds in [
            (ref[0], torch.optim.SGD(ref[0].parameters(), lr=0.1, momentum=0.9), 2),
            (want_new, torch.optim.Adam(want_new.parameters(), lr=0.02), 1),
            (ref[2], torch.optim.SGD(ref[2].parameters(), lr=0.3, momentum=0.9), 2)]:
        for _ in range(rounds):
            steps(model, o)
    for i, want in enumerate([ref[0], want_new, ref[2]]):
        got = fused.model_state_dict(i)
        for k, v in want.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-14)
    weight = dict(fused.named_parameters())["2.weight"]
    assert not weight[0, :, 8:].any() and not weight[1, :, 12:].any()


def test_an_error_taking_a_freed_place_is_raised_as_it_is_and_told_trials_stay_told():
    """build(trial) fails for the newcomer after trials 0 and 1 completed their epoch:
    its error comes out (it was hidden by Optuna's UpdateFinishedTrialError, optimize
    failing the told trials again), 0 and 1 stay COMPLETE, the newcomer FAILs."""
    def build(trial):
        raise ValueError("no model for this trial")

    def objective(array):
        fused = array.fuse([nn.Linear(2, 2) for _ in array.trials])
        hftc.optim.SGD(fused.parameters(), lr=0.1)
        array.refill_with(build)
        for _ in array.epochs(1):
            array.report([0.5] * len(array))

    study = optuna.create_study()
    with pytest.raises(ValueError, match="no model for this trial"):
        hftc.sweep.optimize(study, objective, n_trials=3, array_size=2)
    states = [t.state.name for t in study.get_trials()]
    assert states == ["COMPLETE", "COMPLETE", "FAIL"]
    assert "build(trial) failed: ValueError" in study.trials[2].user_attrs["hftc_fail_reason"]
