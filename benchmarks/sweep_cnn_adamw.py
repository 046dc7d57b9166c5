"""A sweep spec written as a user would (issue 45, not tuned for hftc): a small CNN with
batch norm on scikit-learn's digits as 1x8x8 images, AdamW with a StepLR schedule and a
label-smoothed loss (lr, weight decay, dropout p, the schedule's gamma; 40 trials, 16 per
array, 8 epochs, batch 32; measured in docs/BENCHMARKS.md:
``hftc bench --sweep benchmarks/sweep_cnn_adamw.py``)."""
import functools

import torch
import torch.nn.functional as F
from torch import nn

name = "cnn-adamw"
metric = "accuracy"
epochs = 8
batch_size = 32
n_trials = 40
per_array = 16


class SmallCNN(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1), nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(32, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 1e-5, 1e-1, log=True),
            "dropout": trial.suggest_float("dropout", 0.0, 0.5),
            "gamma": trial.suggest_float("gamma", 0.5, 0.99)}


def model(params):
    return SmallCNN(params["dropout"])


def optimizer(params, module):
    return torch.optim.AdamW(module.parameters(), lr=params["lr"],
                             weight_decay=params["weight_decay"])


def scheduler(opt, params):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=params["gamma"])


loss = functools.partial(F.cross_entropy, label_smoothing=0.1)


def data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    Xtr, Xva, ytr, yva = train_test_split(X, y, test_size=0.2, random_state=0)
    return (Xtr, ytr), (Xva, yva)
