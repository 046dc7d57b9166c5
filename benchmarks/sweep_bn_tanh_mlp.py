"""A sweep spec written as a user would (issue 45, not tuned for hftc): an MLP with batch
norm, tanh and dropout on scikit-learn's digits, SGD with Nesterov momentum and a cosine
schedule, the validation loss minimized (lr, dropout p; 30 trials, 10 per array, 6
epochs, batch 64; measured in docs/BENCHMARKS.md:
``hftc bench --sweep benchmarks/sweep_bn_tanh_mlp.py``)."""
import torch
from torch import nn

name = "bn-tanh"
metric = "loss"
direction = "minimize"
epochs = 6
batch_size = 64
n_trials = 30
per_array = 10
pruner = "median"


class Net(nn.Module):
    def __init__(self, width, p):
        super().__init__()
        self.fc1 = nn.Linear(64, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(width, 10)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc2(self.drop(torch.tanh(self.bn(self.fc1(x)))))


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 0.3, log=True),
            "p": trial.suggest_float("p", 0.0, 0.4)}


def model(params):
    return Net(96, params["p"])


def optimizer(params, module):
    return torch.optim.SGD(module.parameters(), lr=params["lr"], momentum=0.9, nesterov=True)


def scheduler(optimizer, params):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)


def data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x / 16.0, y, test_size=0.2,
                                                      random_state=1)
    return ((torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train)),
            (torch.tensor(x_val, dtype=torch.float32), torch.tensor(y_val)))
