"""Fused Adadelta: torch's Adadelta update for N stacked models, each with its own settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError
from .coefficients import addcmul_
from .optimizer import FusedOptimizer

__all__ = ["Adadelta"]


class Adadelta(FusedOptimizer):
    """Adadelta for N fused models: ``torch.optim.Adadelta``'s arguments, each shared or per model.

    ::

        opt = hftc.optim.Adadelta(fused.parameters(), lr=[1.0, 0.5, 0.1], rho=[0.9, 0.9, 0.95])
        # pytorch/examples' MNIST schedule, each model its own learning rate:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    State per stacked parameter: ``step`` ``[N]`` (per-model step counts, on the CPU;
    Adadelta counts but does not read them, as stock), ``square_avg`` and
    ``acc_delta`` ``[N, *shape]``.

    Stock's single-tensor update, op for op, one op for all N models: bit for bit on
    the CPU.  ``foreach`` is accepted and kept in ``param_groups`` but changes nothing:
    stock's foreach and for-loop updates run the same ops (equal bit for bit on the
    CPU, torch 2.13).  ``capturable=True`` and ``differentiable=True`` raise
    ``FusionArgumentError`` (step counts stay on the CPU; the step runs under
    ``torch.no_grad()``).
    """

    _stock = torch.optim.Adadelta
    _hyperparameters = {
        "lr": "float", "rho": "float", "eps": "float", "weight_decay": "float",
        "maximize": "flag",
    }
    _flags = {"foreach": None, "capturable": False, "differentiable": False}

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0,
                 foreach: bool | None = None, *, capturable: bool = False, maximize=False,
                 differentiable: bool = False, num_models: int | None = None):
        super().__init__(params, num_models, {
            "lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay,
            "maximize": maximize,
        }, {"foreach": foreach, "capturable": capturable, "differentiable": differentiable})

    def _check_hyperparameters(self, hp: dict[str, Any], model: int) -> None:
        super()._check_hyperparameters(hp, model)
        if not 0.0 <= hp["rho"] <= 1.0:
            raise FusionArgumentError(
                f"Invalid rho value for model {model}: {hp['rho']} "
                f"(must be in [0, 1])")

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        state = self.state[p]
        state["step"] = self._new_steps(p)
        state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["acc_delta"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        """Stock's, per parameter (its scalars as per-model coefficients)::

            grad = -grad if maximize;  grad = grad + wd * p
            square_avg = rho * square_avg + (1 - rho) * grad * grad
            delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * grad
            acc_delta = rho * acc_delta + (1 - rho) * delta * delta
            p = p - lr * delta
        """
        rho = hp["rho"]
        any_decay = any(w != 0 for w in hp["weight_decay"])
        coef = self._coefficients({
            "sign": [-1.0 if m else 1.0 for m in hp["maximize"]],
            "weight_decay": hp["weight_decay"],
            "rho": rho,
            "one_minus_rho": [1 - r for r in rho],
            "eps": hp["eps"],
            "neg_lr": [-lr for lr in hp["lr"]],
        })
        self._count_steps(params)
        for p in params:
            state = self.state[p]
            grad = p.grad
            if any(hp["maximize"]):
                grad = grad * coef("sign", p)
            if any_decay:
                grad = torch.addcmul(grad, p, coef("weight_decay", p))  # stock: add(alpha=wd)
            square_avg, acc_delta = state["square_avg"], state["acc_delta"]
            addcmul_(square_avg.mul_(coef.get("rho", p)), grad, grad,
                     coef.get("one_minus_rho", p))
            std = square_avg.add(coef.get("eps", p)).sqrt_()
            delta = acc_delta.add(coef.get("eps", p)).sqrt_()
            delta.div_(std).mul_(grad)
            addcmul_(acc_delta.mul_(coef.get("rho", p)), delta, delta,
                     coef.get("one_minus_rho", p))
            neg_lr = coef.get("neg_lr", p)
            if isinstance(neg_lr, Tensor):
                p.addcmul_(delta, neg_lr)  # stock: add_(delta, alpha=-lr), one FMA either way
            else:
                p.add_(delta, alpha=neg_lr)
