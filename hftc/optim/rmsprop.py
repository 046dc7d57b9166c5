"""Fused RMSprop: torch's RMSprop update for N stacked models, each with its own settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .coefficients import addcdiv_
from .optimizer import FusedOptimizer

__all__ = ["RMSprop"]


class RMSprop(FusedOptimizer):
    """RMSprop for N fused models: ``torch.optim.RMSprop``'s arguments, each shared or per model.

    ::

        opt = hftc.optim.RMSprop(fused.parameters(), lr=[1e-2, 1e-3],
                                 momentum=[0.0, 0.9], centered=[False, True])

    State per stacked parameter: ``step`` ``[N]``, ``square_avg``, and
    ``momentum_buffer`` / ``grad_avg`` if some model uses momentum / centering.

    ``foreach`` is accepted and kept in ``param_groups`` but changes nothing: on the
    CPU stock's foreach and for-loop updates give the same values bit for bit (torch
    2.13), which hftc's equal.  ``capturable=True`` and ``differentiable=True`` raise
    ``FusionArgumentError`` (step counts stay on the CPU; the step runs under
    ``torch.no_grad()``).
    """

    _stock = torch.optim.RMSprop
    _hyperparameters = {
        "lr": "float", "alpha": "float", "eps": "float", "weight_decay": "float",
        "momentum": "float", "centered": "flag", "maximize": "flag",
    }
    _flags = {"foreach": None, "capturable": False, "differentiable": False}

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0,
                 momentum=0.0, centered=False, capturable: bool = False,
                 foreach: bool | None = None, maximize=False, differentiable: bool = False,
                 *, num_models: int | None = None):
        super().__init__(params, num_models, {
            "lr": lr, "alpha": alpha, "eps": eps, "weight_decay": weight_decay,
            "momentum": momentum, "centered": centered, "maximize": maximize,
        }, {"foreach": foreach, "capturable": capturable, "differentiable": differentiable})

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        state = self.state[p]
        state["step"] = self._new_steps(p)
        state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self._add_missing_buffers(p, hp)

    def _add_missing_buffers(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        # Stock creates these at a parameter's first step; here also later, should
        # a schedule switch momentum on (they start at zero either way).
        state = self.state[p]
        if any(m > 0 for m in hp["momentum"]) and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if any(hp["centered"]) and "grad_avg" not in state:
            state["grad_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        centered = hp["centered"]
        active = [m > 0 for m in hp["momentum"]]
        any_decay = any(w != 0 for w in hp["weight_decay"])
        coef = self._coefficients({
            "sign": [-1.0 if m else 1.0 for m in hp["maximize"]],
            "weight_decay": hp["weight_decay"],
            "alpha": hp["alpha"],
            "one_minus_alpha": [1 - a for a in hp["alpha"]],
            "eps": hp["eps"],
            "momentum": hp["momentum"],
            "neg_lr": [-lr for lr in hp["lr"]],
            "active": active,
            "centered": centered,
        })
        self._count_steps(params)
        for p in params:
            state = self.state[p]
            self._add_missing_buffers(p, hp)
            grad = p.grad
            if any(hp["maximize"]):
                grad = grad * coef("sign", p)
            if any_decay:
                grad = torch.addcmul(grad, p, coef("weight_decay", p))
            square_avg = state["square_avg"]
            square_avg.mul_(coef("alpha", p)).addcmul_(grad * coef("one_minus_alpha", p), grad)
            if any(centered):
                grad_avg = state["grad_avg"]
                grad_avg.lerp_(grad, coef("one_minus_alpha", p))
                avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
                if not all(centered):
                    avg = torch.where(coef.mask("centered", p), avg, square_avg.sqrt())
            else:
                avg = square_avg.sqrt()
            avg = avg.add_(coef("eps", p))
            neg_lr = coef("neg_lr", p)
            if all(active):
                buf = state["momentum_buffer"]
                buf.mul_(coef("momentum", p)).addcdiv_(grad, avg)
                p.addcmul_(buf, neg_lr)
            elif not any(active):
                addcdiv_(p, grad, avg, coef, "neg_lr")  # stock: value=-lr
            else:
                # Stock rounds the two forms differently, so each model gets its own form.
                act = coef.mask("active", p)
                buf = state["momentum_buffer"]
                buf.copy_(torch.where(act, (buf * coef("momentum", p)).addcdiv_(grad, avg), buf))
                p.copy_(torch.where(act, p.addcmul(buf, neg_lr), p.addcdiv(grad * neg_lr, avg)))
