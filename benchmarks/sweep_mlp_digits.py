"""A sweep spec as a user writes one, for `hftc bench --sweep benchmarks/sweep_mlp_digits.py`:
an MLP (64 -> 128 -> 128 -> 10, dropout) on scikit-learn's 8x8 digits, SGD learning rate,
momentum, weight decay and dropout p, 48 trials, 16 per array, 8 epochs, TPE and the
median pruner (the issue-45 workload; measured in docs/BENCHMARKS.md)."""
import torch
from torch import nn

name = "mlp-digits"
metric = "accuracy"
direction = "maximize"
epochs = 8
batch_size = 32
n_trials = 48
per_array = 16
pruner = "median"


class MLP(nn.Module):
    def __init__(self, hidden=128, p=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(p),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p),
                                 nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 0.5, log=True),
            "momentum": trial.suggest_float("momentum", 0.0, 0.95),
            "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
            "dropout": trial.suggest_float("dropout", 0.0, 0.5)}


def model(params):
    return MLP(p=params["dropout"])


def optimizer(params, module):
    return torch.optim.SGD(module.parameters(), lr=params["lr"], momentum=params["momentum"],
                           weight_decay=params["weight_decay"])


def data():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])
