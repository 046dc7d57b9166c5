"""The demo sweep (``make demo``): a small CNN on scikit-learn's 8x8 digits.

A spec module like any user's (``python -m hftc sweep hftc.sweep.digits`` runs
it as is): ``space``, ``model``, ``data``, ``metric``. The data set ships inside
scikit-learn: 1,797 images, no download.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

name = "digits"
metric = "accuracy"
direction = "maximize"
epochs = 8
batch_size = 32
n_trials = 48
per_array = 16
pruner = "median"


class DigitsCNN(nn.Module):
    """conv 3x3 -> max-pool -> conv 3x3 -> dropout -> linear, for 8x8 digits (5k parameters)."""

    def __init__(self, dropout: float = 0.0, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 8x8 -> 4x4
        x = F.relu(self.conv2(x))
        return self.fc(self.drop(torch.flatten(x, 1)))


def space(trial):
    """SGD's learning rate, momentum and weight decay, and the dropout probability."""
    return {
        "lr": trial.suggest_float("lr", 1e-3, 0.3, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.95),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
        "dropout": trial.suggest_float("dropout", 0.0, 0.5),
    }


def model(params):
    return DigitsCNN(dropout=params.get("dropout", 0.0))


def optimizer(params, module):
    return torch.optim.SGD(module.parameters(), lr=params["lr"], momentum=params["momentum"],
                           weight_decay=params["weight_decay"])


def data(n_train: int | None = None, n_val: int | None = None):
    """((x_train, y_train), (x_val, y_val)): a fixed 80/20 split of load_digits, pixels 0..1."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(y))
    train = (x[:split][:n_train], y[:split][:n_train])
    val = (x[split:][:n_val], y[split:][:n_val])
    return train, val
