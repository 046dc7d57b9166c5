"""One process of tests/test_trial_array_processes.py: hftc.sweep.optimize on a shared
study; prints the trial numbers this process ran, one JSON list on its last line.

    python tests/trial_array_worker.py STORAGE STUDY N_TRIALS ARRAY_SIZE
"""

from __future__ import annotations

import json
import sys

import optuna
import torch
import torch.nn.functional as F
from torch import nn

import hftc
import hftc.sweep

STEPS = 3
X = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(8, 3)
Y = X.sum(1, keepdim=True).sin()


def make_model(number: int) -> nn.Module:
    torch.manual_seed(number)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def alone(number: int, lr: float, steps: int) -> list[float]:
    """The trial trained by itself with stock SGD: its loss after each step."""
    model = make_model(number)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(X), Y).backward()
        opt.step()
        with torch.no_grad():
            history.append(F.mse_loss(model(X), Y).item())
    return history


def storage_of(url: str):
    if url.startswith("sqlite"):  # several writers: wait for the lock instead of failing
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    return url


def main(url: str, study_name: str, n_trials: int, array_size: int) -> None:
    study = optuna.load_study(study_name=study_name, storage=storage_of(url))
    ran: list[int] = []

    def objective(array):
        ran.extend(array.numbers)
        lrs = [t.suggest_float("lr", 1e-3, 1.0, log=True) for t in array.trials]
        fused = array.fuse([make_model(t.number) for t in array.trials])
        opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.5)
        per_model_mse = hftc.per_model(F.mse_loss)
        for step in range(STEPS):
            opt.zero_grad()
            per_model_mse(fused(X), Y).sum().backward()
            opt.step()
            with torch.no_grad():
                array.report(per_model_mse(fused(X), Y), step)
        with torch.no_grad():
            return per_model_mse(fused(X), Y)

    hftc.sweep.optimize(study, objective, n_trials=n_trials, array_size=array_size)
    print(json.dumps(ran))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
