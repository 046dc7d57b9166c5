"""pytorch/examples' MNIST script (mnist/main.py) as a fused Optuna sweep, on digits.

    python examples/trial_array_mnist.py      # 12 trials, 4 per fused array, then a check

The training code is mnist/main.py's: its ``Net`` (two convs, dropout, two linears,
log-softmax; sized for scikit-learn's 8x8 digits, no download), ``Adadelta``,
``StepLR(step_size=1, gamma=0.7)``, a ``DataLoader``, an augmentation (a random shift)
and its own logging.  ``objective_alone(trial)`` is that script as a plain Optuna
objective; ``objective(array)`` is the same loop as a fused sweep.  What changes:

    model = build(trial)                  ->  fused = array.fuse([build(t) for t in array.trials])
    torch.optim.Adadelta(..., lr=lr)      ->  hftc.optim.Adadelta(fused.parameters(), lr=lrs)
    F.nll_loss(output, target)            ->  hftc.per_model(F.nll_loss)(output, target)  # [N]
    trial.report(loss, epoch); prune      ->  array.report(losses, epoch)  # shrinks in place

Pruned trials leave the fused module, its optimizer and its scheduler in place, and the
loop goes on with the others.  At the end, each trial's reported values are compared
with the same trial trained alone by ``objective_alone`` (float64, 1e-9 relative).

Dropout is off here (``--dropout 0.25 0.5`` turns mnist/main.py's on): fused dropout
draws each model's own masks, never the ones a model alone would draw (docs/API.md,
"Fused dropout"), so with it a survivor trains the same way in distribution, not bit
for bit, and the check is skipped.
"""

from __future__ import annotations

import argparse
import math

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import hftc
import hftc.sweep
from hftc.sweep import digits

DTYPE = torch.float64


class Net(nn.Module):
    """mnist/main.py's Net, for 1x8x8 inputs (8x8 -> 6x6 -> 4x4 -> pooled 2x2)."""

    def __init__(self, dropout: tuple[float, float] = (0.0, 0.0)):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(dropout[0])
        self.dropout2 = nn.Dropout(dropout[1])
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


class Setup:
    """The script's settings and data (what mnist/main.py takes from argparse)."""

    def __init__(self, epochs=4, batch_size=64, n_train=None, n_val=None, dropout=(0.0, 0.0),
                 log_interval=10, log=print):
        (x, y), (vx, vy) = digits.data(n_train, n_val)
        self.train = TensorDataset(x.to(DTYPE), y)
        self.val = (vx.to(DTYPE), vy)
        self.epochs, self.batch_size, self.dropout = epochs, batch_size, tuple(dropout)
        self.log_interval, self.log = log_interval, log

    def build(self, seed: int) -> Net:
        torch.manual_seed(seed)  # each trial's own initial weights (its number), fused or alone
        return Net(self.dropout).to(DTYPE)

    def loaders(self):
        """The DataLoader and the augmentation's generator, seeded: every trial sees the
        same batches and shifts, fused or alone."""
        loader = DataLoader(self.train, batch_size=self.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(1))
        return loader, torch.Generator().manual_seed(2)


def augment(x, generator):
    """A random shift of up to one pixel, one per batch."""
    dx, dy = torch.randint(-1, 2, (2,), generator=generator).tolist()
    return torch.roll(x, shifts=(dx, dy), dims=(2, 3))


def train(setup, model, loader, generator, optimizer, epoch, nll, who):
    """mnist/main.py's train(): one epoch.  ``nll`` gives one loss per model ([N] fused)."""
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        optimizer.zero_grad()
        output = model(augment(data, generator))
        loss = nll(output, target)
        loss.sum().backward()  # fused: the sum of the models' losses, each its own gradient
        optimizer.step()
        if batch_idx % setup.log_interval == 0:
            setup.log(f"{who} epoch {epoch} [{batch_idx * len(data)}/{len(loader.dataset)}] "
                      f"loss {[round(v, 4) for v in loss.reshape(-1).tolist()]}")


def test(model, val, nll_sum):
    """mnist/main.py's test(): the validation loss (one per model, fused) and accuracy."""
    model.eval()
    data, target = val
    with torch.no_grad():
        output = model(data)
        loss = nll_sum(output, target) / len(target)
        correct = (output.argmax(-1) == target).double().mean(-1)
    return loss, correct


def run_alone(setup: Setup, seed: int, lr: float, report) -> float:
    """The plain PyTorch script: one model; ``report(loss, epoch)`` after each epoch
    (Optuna's report and pruning, in ``objective_alone``)."""
    model = setup.build(seed)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    loader, generator = setup.loaders()
    for epoch in range(setup.epochs):
        train(setup, model, loader, generator, optimizer, epoch, F.nll_loss, f"seed {seed}")
        loss, _ = test(model, setup.val, lambda o, t: F.nll_loss(o, t, reduction="sum"))
        scheduler.step()
        report(loss.item(), epoch)
    return loss.item()


def objective_alone(setup: Setup, trial: optuna.Trial) -> float:
    """The plain Optuna objective (``study.optimize(objective_alone)``): one trial."""
    def report(loss, epoch):
        trial.report(loss, epoch)
        if trial.should_prune():
            raise optuna.TrialPruned()

    lr = trial.suggest_float("lr", 0.3, 30.0, log=True)
    return run_alone(setup, trial.number, lr, report)


def objective(setup: Setup, array: hftc.sweep.TrialArray) -> torch.Tensor:
    """The same script, fused: the N trials of ``array`` at once."""
    lrs = [t.suggest_float("lr", 0.3, 30.0, log=True) for t in array.trials]
    fused = array.fuse([setup.build(t.number) for t in array.trials])
    optimizer = hftc.optim.Adadelta(fused.parameters(), lr=lrs)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)  # found and cut with fused
    loader, generator = setup.loaders()
    nll, nll_sum = hftc.per_model(F.nll_loss), hftc.per_model(F.nll_loss, reduction="sum")
    for epoch in range(setup.epochs):
        train(setup, fused, loader, generator, optimizer, epoch, nll, f"trials {array.numbers}")
        loss, correct = test(fused, setup.val, nll_sum)
        scheduler.step()
        setup.log(f"epoch {epoch}: trials {array.numbers} val loss "
                  f"{[round(v, 4) for v in loss.tolist()]} accuracy "
                  f"{[round(v, 3) for v in correct.tolist()]}")
        dropped = array.report(loss, epoch)
        if dropped:
            setup.log(f"  models {dropped} pruned; {len(array)} go on")
    return test(fused, setup.val, nll_sum)[0]  # the live trials' (loss has the dropped too)


def alone_history(setup: Setup, frozen: optuna.trial.FrozenTrial) -> list[float]:
    """``frozen``'s value per epoch when trained by itself, for as many epochs."""
    history: list[float] = []
    epochs, setup.epochs = setup.epochs, len(frozen.intermediate_values)
    try:
        run_alone(setup, frozen.number, frozen.params["lr"], lambda v, e: history.append(v))
    finally:
        setup.epochs = epochs
    return history


def check(setup: Setup, study: optuna.Study) -> float:
    """Each trial's reported values against its run alone; the largest relative error."""
    worst = 0.0
    for frozen in study.get_trials():
        fused_values = [frozen.intermediate_values[s] for s in sorted(frozen.intermediate_values)]
        for a, b in zip(fused_values, alone_history(setup, frozen), strict=True):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-300))
    return worst


def main(n_trials=12, array_size=4, pruner=None, storage=None,
         **setup_kwargs) -> tuple[optuna.Study, float]:
    setup = Setup(**setup_kwargs)
    study = optuna.create_study(
        direction="minimize", storage=storage, sampler=optuna.samplers.TPESampler(seed=0),
        pruner=pruner or optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    hftc.sweep.optimize(study, lambda array: objective(setup, array), n_trials=n_trials,
                        array_size=array_size)
    states = [t.state.name for t in study.get_trials()]
    setup.log(f"best: trial {study.best_trial.number}, val loss {study.best_value:.4f}; "
              f"{states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned")
    if any(setup.dropout):
        return study, math.nan
    worst = check(setup, study)
    setup.log(f"each trial against its run alone: largest relative difference {worst:.1e}")
    return study, worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--array-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--dropout", type=float, nargs=2, default=(0.0, 0.0))
    args = parser.parse_args()
    _, worst = main(args.trials, args.array_size, epochs=args.epochs, dropout=args.dropout)
    assert math.isnan(worst) or worst <= 1e-9, worst
