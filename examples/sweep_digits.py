"""A sweep spec, as a user writes one: a CNN on scikit-learn's 8x8 digits, AdamW.

    python -m hftc sweep examples/sweep_digits.py                 # 32 trials, 16 per array
    python -m hftc sweep examples/sweep_digits.py --resume        # after Ctrl-C or a crash
    python examples/sweep_digits.py                               # the same, from Python

The search space mixes optimizer hyper-parameters (learning rate, weight decay,
Adam's beta1), a regularizer inside the model (dropout p: one fused array
trains models with different p) and an architectural choice (the width: with
``pad_widths = True`` models of widths 8 and 16 share one array, each zero-padded
to the widest and exact; without it each array splits into one fused group per
width). Nothing else here knows about fusion.
"""

import torch

from hftc.sweep.digits import DigitsCNN

name = "digits-adamw"          # the study name (and the default folder: sweeps/digits-adamw)
metric = "accuracy"            # or "loss", or a function (output, target) -> float
direction = "maximize"
epochs = 10
batch_size = 32
n_trials = 32
per_array = 16
pad_widths = True              # widths 8 and 16 in one array (padding: up to ~4x the arithmetic
max_padding = 4.0              # of a width-8 model; say 1.25 to pad only near widths)
pruner = "median"              # or "sha", "hyperband", "none", or an optuna pruner
seed = 0


# The demo's CNN (conv 3x3 -> max-pool -> conv 3x3 -> dropout -> linear); any nn.Module
# factory works here.
CNN = DigitsCNN


def space(trial):
    """One trial's hyper-parameters (Optuna's define-by-run API); the dict goes to
    model() and optimizer()."""
    return {
        "lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 1e-5, 1e-1, log=True),
        "beta1": trial.suggest_float("beta1", 0.8, 0.95),
        "dropout": trial.suggest_float("dropout", 0.0, 0.5),
        "width": trial.suggest_categorical("width", [8, 16]),
    }


def model(params):
    """Called under torch.manual_seed(the trial's seed)."""
    return CNN(dropout=params["dropout"], width=params["width"])


def optimizer(params, module):
    """A stock optimizer; hftc fuses the N of an array into one hftc.optim.AdamW."""
    return torch.optim.AdamW(module.parameters(), lr=params["lr"],
                             weight_decay=params["weight_decay"],
                             betas=(params["beta1"], 0.999))


def data():
    """((x_train, y_train), (x_val, y_val)) as tensors."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


if __name__ == "__main__":
    import hftc.sweep

    result = hftc.sweep.run(__file__)
    print(result.leaderboard)
