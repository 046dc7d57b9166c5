"""Your own PyTorch + Optuna training loop, as a fused sweep: N trials per fused module.

    python examples/trial_array_digits.py                 # 16 trials, 8 per fused array

The loop is a plain one (a DataLoader, augmentation, a scheduler, its own logging);
what makes it a fused sweep is ``array.fuse`` (build the N trials' models as one
module) and ``array.report`` (each model's value to its trial; pruned trials leave the
array, and the fused module, optimizer and scheduler in place: the loop goes on with
the others). With plain Optuna the same loop would be
``objective(trial)`` with one model, run 16 times.
"""

from __future__ import annotations

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hftc
import hftc.sweep
from hftc.sweep import digits

EPOCHS = 6


def load_digits_split():
    """scikit-learn's digits, the sweep demo's fixed 80/20 split (hftc.sweep.digits.data)."""
    (x, y), val = digits.data()
    return TensorDataset(x, y), val


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(torch.flatten(F.max_pool2d(F.relu(self.conv(x)), 2), 1))


def augment(x):
    """A random shift of up to one pixel, the same for the whole batch (every model sees
    the batch it would see alone)."""
    dx, dy = torch.randint(-1, 2, (2,)).tolist()
    return torch.roll(x, shifts=(dx, dy), dims=(2, 3))


def make_objective(train, val):
    per_model_loss = hftc.per_model(F.cross_entropy)

    def objective(array: hftc.sweep.TrialArray):
        lrs = [t.suggest_float("lr", 1e-3, 0.3, log=True) for t in array.trials]
        decays = [t.suggest_float("weight_decay", 1e-6, 1e-2, log=True) for t in array.trials]
        fused = array.fuse([Net() for _ in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9, weight_decay=decays)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS)
        loader = DataLoader(train, batch_size=32, shuffle=True)
        for epoch in range(EPOCHS):
            fused.train()
            for xb, yb in loader:
                opt.zero_grad()
                per_model_loss(fused(augment(xb)), yb).sum().backward()
                opt.step()
            sched.step()
            fused.eval()
            with torch.no_grad():
                accuracy = (fused(val[0]).argmax(-1) == val[1]).double().mean(1)  # [N]
            print(f"epoch {epoch}: trials {array.numbers} accuracy "
                  f"{[round(a, 3) for a in accuracy.tolist()]}")
            dropped = array.report(accuracy, epoch)
            if dropped:
                print(f"  pruned or failed: models {dropped}; {len(array)} go on")
        with torch.no_grad():
            return (fused(val[0]).argmax(-1) == val[1]).double().mean(1)

    return objective


def main(n_trials: int = 16, array_size: int = 8) -> optuna.Study:
    train, val = load_digits_split()
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=4))
    hftc.sweep.optimize(study, make_objective(train, val), n_trials=n_trials,
                        array_size=array_size)
    print(f"best: trial {study.best_trial.number}, accuracy {study.best_value:.3f}, "
          f"{study.best_params}")
    return study


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
