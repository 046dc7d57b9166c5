"""A sweep spec written as a user would (issue 45, not tuned for hftc): an MLP on
scikit-learn's digits whose trials pick the hidden width (64 or 128), batch norm or not and
SGD or Adam: up to four structures, so the arrays hold about four trials each (32 trials,
16 per array, 6 epochs; measured in docs/BENCHMARKS.md:
``hftc bench --sweep benchmarks/sweep_choices_mlp.py``)."""
import torch
from torch import nn

name = "choices-mlp"
metric = "accuracy"
direction = "maximize"
epochs = 6
batch_size = 32
n_trials = 32
per_array = 16
pruner = "median"


def space(trial):
    return {"hidden": trial.suggest_categorical("hidden", [64, 128]),
            "opt": trial.suggest_categorical("opt", ["sgd", "adam"]),
            "lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
            "bn": trial.suggest_categorical("bn", [True, False])}


def model(params):
    h = params["hidden"]
    layers = [nn.Flatten(), nn.Linear(64, h)]
    if params["bn"]:
        layers.append(nn.BatchNorm1d(h))
    layers += [nn.ReLU(), nn.Linear(h, 10)]
    return nn.Sequential(*layers)


def optimizer(params, module):
    if params["opt"] == "sgd":
        return torch.optim.SGD(module.parameters(), lr=params["lr"], momentum=0.9)
    return torch.optim.Adam(module.parameters(), lr=params["lr"] / 10)


def data():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])
