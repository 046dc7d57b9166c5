"""A fused sweep whose arrays stay full: new trials take the places of pruned and
finished ones.

    python examples/trial_array_refill.py          # 24 trials through arrays of 6

``array.refill_with(build)`` gives a freed place to a new trial of the study;
``array.epochs(E)`` trains each trial its own E epochs. Every trial starts from its own
step 0 in its place (``hftc.replace_models``), so the data order must not depend on
when it joined: here each epoch walks the data in the same seeded order. ``main``
returns the study and the largest relative difference between each trial's reported
validation losses and the same trial trained alone (float64).
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


def net(number: int) -> nn.Module:
    torch.manual_seed(number)  # each trial its own initial weights, whichever array
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).double()


def build(trial: optuna.Trial):
    """A trial's model and its optimizer hyper-parameters (also for newcomers)."""
    return net(trial.number), {"lr": trial.suggest_float("lr", 1e-3, 0.3, log=True)}


def batches(train: TensorDataset) -> DataLoader:
    """The same order in every epoch (a generator seeded anew)."""
    return DataLoader(train, batch_size=64, shuffle=True,
                      generator=torch.Generator().manual_seed(0))


def val_loss(model, val) -> torch.Tensor:
    with torch.no_grad():
        out = model(val[0])
        if out.dim() == 2:
            return F.cross_entropy(out, val[1])
        return torch.stack([F.cross_entropy(o, val[1]) for o in out])


def main(n_trials: int = 24, array_size: int = 6, epochs: int = 4, pruner=None,
         log=print):
    (x, y), val = digits.data()
    train = TensorDataset(x.double()[:512], y[:512])
    val = (val[0].double()[:256], val[1][:256])
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=pruner or optuna.pruners.MedianPruner(n_startup_trials=4))

    def objective(array: hftc.sweep.TrialArray):
        built = [build(t) for t in array.trials]
        fused = array.fuse([model for model, _ in built])
        opt = hftc.optim.SGD(fused.parameters(), lr=[h["lr"] for _, h in built],
                             momentum=0.9)
        array.refill_with(build)
        for round_ in array.epochs(epochs):
            for xb, yb in batches(train):
                opt.zero_grad()
                hftc.per_model(F.cross_entropy)(fused(xb), yb).sum().backward()
                opt.step()
            losses = val_loss(fused, val)
            log(f"round {round_}: trials {array.numbers} at epochs "
                f"{[array.epoch_of(j) for j in range(len(array))]}")
            array.report(losses)
            if array.replaced:
                log(f"  new trials in places {array.replaced}: {array.numbers}")

    hftc.sweep.optimize(study, objective, n_trials=n_trials, array_size=array_size)

    worst = 0.0
    for t in study.trials:  # each trial again, alone
        model = net(t.number)
        opt = torch.optim.SGD(model.parameters(), lr=t.params["lr"], momentum=0.9)
        for epoch in sorted(t.intermediate_values):
            for xb, yb in batches(train):
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
            want = val_loss(model, val).item()
            worst = max(worst, abs(t.intermediate_values[epoch] - want) / abs(want))
    log(f"{len(study.trials)} trials; best {study.best_value:.4f} {study.best_params}; "
        f"largest difference from the trials alone: {worst:.1e}")
    return study, worst


if __name__ == "__main__":
    main()
