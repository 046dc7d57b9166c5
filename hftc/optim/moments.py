"""The first half of an Adam-family step that NAdam and RAdam share, with each model's
own maximize, coupled or decoupled weight decay and betas::

    grad = -grad if maximize
    p = (1 - lr * wd) * p  (decoupled)  or  grad = grad + wd * p
    exp_avg = lerp(exp_avg, grad, 1 - beta1)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .coefficients import Coefficients, addcmul_
from .optimizer import FusedOptimizer


@dataclass
class AdamMoments:
    """Per-model coefficients of one step (``coef`` also holds the caller's ``extra``
    rows and each model's ``foreach`` choice), and :meth:`update` per parameter."""

    beta1: list[float]
    beta2: list[float]
    foreach: list[bool]
    coef: Coefficients
    maximize: bool
    any_coupled: bool
    any_decoupled: bool

    @classmethod
    def of(cls, optimizer: FusedOptimizer, params: list[Tensor], hp: dict[str, list[Any]],
           **extra: list[Any]) -> AdamMoments:
        lr, wd, decoupled = hp["lr"], hp["weight_decay"], hp["decoupled_weight_decay"]
        beta1 = [b[0] for b in hp["betas"]]
        beta2 = [b[1] for b in hp["betas"]]
        coupled_wd = [0.0 if d else w for w, d in zip(wd, decoupled)]
        foreach = optimizer._stock_foreach(params)
        coef = optimizer._coefficients({
            "sign": [-1.0 if m else 1.0 for m in hp["maximize"]],
            "coupled_wd": coupled_wd,
            "decay": [1 - r * w if d else 1.0 for r, w, d in zip(lr, wd, decoupled)],
            "one_minus_beta1": [1 - b for b in beta1],
            "beta2": beta2,
            "one_minus_beta2": [1 - b for b in beta2],
            "eps": hp["eps"],
            **extra,
            "foreach": foreach,
        })
        return cls(beta1, beta2, foreach, coef, maximize=any(hp["maximize"]),
                   any_coupled=any(w != 0 for w in coupled_wd),
                   any_decoupled=any(d and w != 0 for w, d in zip(wd, decoupled)))

    def update(self, p: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Weight decay into ``p`` or its gradient, then the two moments, in place:
        ``(grad, exp_avg, exp_avg_sq)``, ``grad`` as the moments took it (signed, decayed)."""
        coef = self.coef
        grad = p.grad
        if self.maximize:
            grad = grad * coef("sign", p)
        if self.any_decoupled:
            p.mul_(coef.get("decay", p))
        if self.any_coupled:
            grad = torch.addcmul(grad, p, coef("coupled_wd", p))  # stock: add(alpha=wd)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, coef.get("one_minus_beta1", p))
        addcmul_(exp_avg_sq.mul_(coef.get("beta2", p)), grad, grad, coef.get("one_minus_beta2", p))
        return grad, exp_avg, exp_avg_sq
