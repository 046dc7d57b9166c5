"""Fused Adamax: torch's Adamax update for N stacked models, each with its own settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .coefficients import Coefficients, addcdiv_
from .optimizer import FusedOptimizer

__all__ = ["Adamax"]


class Adamax(FusedOptimizer):
    """Adamax for N fused models: ``torch.optim.Adamax``'s arguments, each shared or per model
    (``betas``: one pair, or N pairs)::

        opt = hftc.optim.Adamax(fused.parameters(), lr=[2e-3, 1e-2],
                                betas=[(0.9, 0.999), (0.8, 0.99)])

    State per stacked parameter: ``step`` ``[N]`` (per-model step counts, on the CPU),
    ``exp_avg`` and ``exp_inf`` ``[N, *shape]``.  Bias corrections use each model's own
    step.

    Stock's single-tensor update, op for op, one op for all N models: bit for bit on
    the CPU.  ``foreach`` is accepted and kept in ``param_groups`` but changes nothing:
    stock's foreach and for-loop updates run the same ops (equal bit for bit on the
    CPU, torch 2.13).  ``capturable=True`` and ``differentiable=True`` raise
    ``FusionArgumentError`` (step counts stay on the CPU; the step runs under
    ``torch.no_grad()``).
    """

    _stock = torch.optim.Adamax
    _hyperparameters = {
        "lr": "float", "betas": "pair", "eps": "float", "weight_decay": "float",
        "maximize": "flag",
    }
    _flags = {"foreach": None, "differentiable": False, "capturable": False}

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 foreach: bool | None = None, *, maximize=False, differentiable: bool = False,
                 capturable: bool = False, num_models: int | None = None):
        super().__init__(params, num_models, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "maximize": maximize,
        }, {"foreach": foreach, "differentiable": differentiable, "capturable": capturable})

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        state = self.state[p]
        state["step"] = self._new_steps(p)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_inf"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        """Stock's, per parameter (its scalars as per-model coefficients)::

            grad = -grad if maximize;  grad = grad + wd * p
            exp_avg = lerp(exp_avg, grad, 1 - beta1)
            exp_inf = maximum(beta2 * exp_inf, |grad| + eps)
            p = p - lr / (1 - beta1 ** step) * exp_avg / exp_inf
        """
        lr = hp["lr"]
        beta1 = [b[0] for b in hp["betas"]]
        any_decay = any(w != 0 for w in hp["weight_decay"])
        coef = self._coefficients({
            "sign": [-1.0 if m else 1.0 for m in hp["maximize"]],
            "weight_decay": hp["weight_decay"],
            "one_minus_beta1": [1 - b for b in beta1],
            "beta2": [b[1] for b in hp["betas"]],
            "eps": hp["eps"],
        })
        by_steps: dict[tuple[float, ...], Coefficients] = {}
        for p, step in zip(params, self._count_steps(params)):
            steps = tuple(step.tolist())
            if steps not in by_steps:  # Python doubles, as stock computes them from step.item()
                by_steps[steps] = Coefficients({
                    "neg_clr": [-(r / (1 - b ** s)) for r, b, s in zip(lr, beta1, steps)]})
            state = self.state[p]
            grad = p.grad
            if any(hp["maximize"]):
                grad = grad * coef("sign", p)
            if any_decay:
                grad = torch.addcmul(grad, p, coef("weight_decay", p))  # stock: add(alpha=wd)
            exp_avg, exp_inf = state["exp_avg"], state["exp_inf"]
            exp_avg.lerp_(grad, coef.get("one_minus_beta1", p))
            torch.maximum(exp_inf.mul_(coef.get("beta2", p)),
                          grad.abs().add_(coef.get("eps", p)), out=exp_inf)
            addcdiv_(p, exp_avg, exp_inf, by_steps[steps], "neg_clr")  # stock: value=-clr
