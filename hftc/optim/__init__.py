"""Fused optimizers: one vectorised update for N stacked models, each with its own hyper-parameters.

::

    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-3, 3e-3, 1e-2])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [f0, f1, f2])   # per-model schedules

``opt.param_groups[i]`` is model i's hyper-parameter dict, so every stock
``torch.optim.lr_scheduler`` works unchanged and per model; the stacked
parameters themselves live in ``param_groups[0]["params"]`` (see
``hftc/optim/optimizer.py`` for why).
"""

from . import coupled  # noqa: F401  (refuses stock optimizers that couple the models)
from .adadelta import Adadelta
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .adamax import Adamax
from .convert import fuse_optimizers, unfuse_optimizers
from .lbfgs import LBFGS
from .lr_scheduler import ReduceLROnPlateau
from .mixed import MixedOptimizer
from .nadam import NAdam
from .optimizer import FusedOptimizer
from .radam import RAdam
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = [
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam",
    "LBFGS", "FusedOptimizer", "MixedOptimizer",
    "ReduceLROnPlateau", "fuse_optimizers", "unfuse_optimizers",
]
