"""Stock ``torch.optim`` optimizers whose update couples a fused module's N models: refused.

An elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, NAdam,
RAdam, ASGD, Rprop) updates each element of a stacked ``[N, ...]`` parameter from that
element's gradient and state alone, so on ``fused.parameters()`` each model trains as it
would alone.  These do not: they reduce over a whole parameter, or over all of them::

    LBFGS:      d = -H g,  t from g . d, line search on sum_i loss_i   (all N models' g)
    Adafactor:  step * max(eps, rms(P)) / max(1, rms(update))          (P: all N models)
                a bias [d] stacked to [N, d] is factored as a matrix across the models
    Muon:       orthogonalize(P) for a 2-d P: a stacked bias [N, d] across the models

so one model's step would depend on the others' and no error would say so.  ``import
hftc`` wraps their ``add_param_group`` (which their constructors call for every group;
installed by :mod:`hftc.patches`): a fused module's stacked parameter raises
``FusionArgumentError`` naming the parameter and what to use instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError
from ..lowering.runtime.modules import FUSED_MODULES, stacked_counts

__all__: list[str] = []


def _why_lbfgs(name: str) -> str:
    return (
        f"its search direction, step size, line search and stopping tests take dot products "
        f"and norms over all its parameters, so each model's step would depend on the other "
        f"models' gradients and losses. Use hftc.optim.LBFGS(fused.parameters(), ...) (one "
        f"L-BFGS with its own line search per model; the closure returns the N per-model "
        f"losses), or run torch.optim.{name} on each of fused.unfuse()'s models")


def _why_adafactor(name: str) -> str:
    return (
        f"it scales each step by the root mean square of the whole parameter and of its "
        f"update (all N models'), and factors the second moment of a parameter with two or "
        f"more dims over its last two (a fused bias [N, d] across the models). Use an "
        f"elementwise optimizer on the fused parameters (hftc.optim.Adam / AdamW / ..., one "
        f"value or N values per hyper-parameter), or run torch.optim.{name} on each of "
        f"fused.unfuse()'s models")


def _why_muon(name: str) -> str:
    return (
        f"it orthogonalizes each 2-d parameter as one matrix: a fused weight is "
        f"[N, out, in] (3-d, which Muon refuses) and a fused bias [N, d] would be "
        f"orthogonalized across the N models. Run torch.optim.{name} on each of "
        f"fused.unfuse()'s models (their 2-d weights), or use an elementwise optimizer "
        f"(hftc.optim.AdamW, ...) on the fused parameters")


#: The stock classes refused on stacked parameters, and why (a message's tail).
_COUPLING: dict[type, Any] = {torch.optim.LBFGS: _why_lbfgs}
for _name, _why in (("Adafactor", _why_adafactor), ("Muon", _why_muon)):
    if hasattr(torch.optim, _name):  # newer torch releases than hftc requires
        _COUPLING[getattr(torch.optim, _name)] = _why


def _stacked_name(p: Tensor, given: str | None) -> str:
    """``p``'s name in its fused module (``'0.weight'``), or ``given``, or a placeholder."""
    if given is not None:
        return given
    for module in list(FUSED_MODULES):
        for name, q in module.named_parameters():
            if q is p:
                return name
    return "(unnamed)"


def _refuse_stacked(optimizer: torch.optim.Optimizer, base: type,
                    param_group: dict[str, Any]) -> None:
    params = param_group.get("params")
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, (set, dict)) or params is None:
        return  # torch's own add_param_group says what is wrong
    else:
        params = list(params)
        param_group["params"] = params  # a generator, read once here
    names: list[str | None] = []
    tensors = []
    for item in params:
        if isinstance(item, tuple) and len(item) == 2:
            names.append(str(item[0]))
            tensors.append(item[1])
        else:
            names.append(None)
            tensors.append(item)
    tensors_only = [t for t in tensors if isinstance(t, Tensor)]
    counts = iter(stacked_counts(tensors_only))
    for given, t in zip(names, tensors):
        n = next(counts) if isinstance(t, Tensor) else None
        if n is None:
            continue
        cls = type(optimizer).__name__
        stock = f"torch.optim.{base.__name__}"
        shown = stock if cls == base.__name__ else f"{cls} (a {stock})"
        raise FusionArgumentError(
            f"{shown} cannot optimize a fused module's stacked parameter "
            f"{_stacked_name(t, given)!r} (shape {list(t.shape)}: {n} models stacked on dim "
            f"0): {_COUPLING[base](base.__name__)}")


#: torch's own ``add_param_group`` of each class, kept before any is replaced.
_STOCK_ADD_PARAM_GROUP = {base: base.add_param_group for base in _COUPLING}


def refusing_add_param_group(base: type) -> Any:
    """``base.add_param_group`` that refuses stacked parameters (:mod:`hftc.patches`
    installs it on each class of ``_COUPLING``)."""
    stock_add_param_group = _STOCK_ADD_PARAM_GROUP[base]

    @functools.wraps(stock_add_param_group)
    def add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            _refuse_stacked(self, base, param_group)
        stock_add_param_group(self, param_group)

    add_param_group.__doc__ = (
        f"``{base.__name__}.add_param_group`` as installed by ``import hftc``: a fused "
        f"module's stacked parameters raise ``FusionArgumentError`` (the update would "
        f"couple the models; see ``hftc/optim/coupled.py``); others: torch's own.")
    return add_param_group
