"""A sweep spec written as a user would (issue 45, not tuned for hftc): a residual MLP
(an nn.ModuleList of blocks, SiLU, dropout) on scikit-learn's digits, read through
DataLoaders, RMSprop (lr, alpha, dropout p; 48 trials, 16 per array, 8 epochs; measured in
docs/BENCHMARKS.md: ``hftc bench --sweep benchmarks/sweep_resmlp_loader.py``)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

name = "resmlp-loader"
epochs = 8
n_trials = 48
per_array = 16


class Block(nn.Module):
    def __init__(self, width, p):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = nn.SiLU()
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.act(self.lin(x)))


class ResMLP(nn.Module):
    def __init__(self, p, depth=3, width=96):
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList([Block(width, p) for _ in range(depth)])
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True),
            "alpha": trial.suggest_float("alpha", 0.9, 0.999),
            "p": trial.suggest_float("p", 0.0, 0.3)}


def model(params):
    return ResMLP(params["p"])


def optimizer(params, module):
    return torch.optim.RMSprop(module.parameters(), lr=params["lr"], alpha=params["alpha"])


def data():
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(y), generator=g)
    tr, va = idx[:1500], idx[1500:]
    train = DataLoader(TensorDataset(X[tr], y[tr]), batch_size=32, shuffle=True)
    val = DataLoader(TensorDataset(X[va], y[va]), batch_size=256)
    return train, val
