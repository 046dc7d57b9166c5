"""A sweep spec written as a user would (issue 45, not tuned for hftc): an MLP with LayerNorm,
GELU and dropout on scikit-learn's digits, Adam (lr, beta1, weight decay, dropout p), 40
trials, 10 per array, 6 epochs, TPE and the median pruner (measured in docs/BENCHMARKS.md:
``hftc bench --sweep benchmarks/sweep_adam_mlp.py``)."""
import torch
import torch.nn.functional as F
from torch import nn

name = "adam-mlp"
metric = "accuracy"
direction = "maximize"
epochs = 6
batch_size = 64
n_trials = 40
per_array = 10
pruner = "median"


class Net(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc1 = nn.Linear(64, 96)
        self.norm = nn.LayerNorm(96)
        self.fc2 = nn.Linear(96, 96)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(96, 10)

    def forward(self, x):
        x = x.flatten(1)
        x = F.gelu(self.norm(self.fc1(x)))
        x = self.drop(F.gelu(self.fc2(x)))
        return self.head(x)


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
            "beta1": trial.suggest_float("beta1", 0.8, 0.95),
            "wd": trial.suggest_float("wd", 1e-6, 1e-3, log=True),
            "p": trial.suggest_float("p", 0.0, 0.4)}


def model(params):
    return Net(params["p"])


def optimizer(params, module):
    return torch.optim.Adam(module.parameters(), lr=params["lr"], betas=(params["beta1"], 0.999),
                            weight_decay=params["wd"])


def data():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])
