"""Fused Adagrad: torch's Adagrad update for N stacked models, each with its own settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .optimizer import FusedOptimizer, _Coefficients, addcdiv_

__all__ = ["Adagrad"]


class Adagrad(FusedOptimizer):
    """Adagrad for N fused models: ``torch.optim.Adagrad``'s arguments, each shared or per model.

    ::

        opt = hftc.optim.Adagrad(fused.parameters(), lr=[1e-2, 1e-1], lr_decay=[0.0, 1e-3],
                                 initial_accumulator_value=[0.0, 0.1])

    Model i's learning rate at its step t is ``lr_i / (1 + (t - 1) * lr_decay_i)``.
    State (created at construction, as in torch): ``step`` ``[N]`` and ``sum``
    ``[N, *shape]``, model i's slice starting at ``initial_accumulator_value[i]``.
    """

    _hyperparameters = {
        "lr": "float", "lr_decay": "float", "weight_decay": "float",
        "initial_accumulator_value": "float", "eps": "float", "maximize": "flag",
    }

    def __init__(self, params, num_models: int | None = None, lr=1e-2, lr_decay=0.0,
                 weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10, *,
                 maximize=False):
        super().__init__(params, num_models, {
            "lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value, "eps": eps,
            "maximize": maximize,
        })
        hp = self.hyperparameters()
        for p in self.param_groups[0]["params"]:
            self._init_state(p, hp)

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        state = self.state[p]
        state["step"] = self._new_steps(p)
        init = _Coefficients({"value": hp["initial_accumulator_value"]})
        state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["sum"].add_(init("value", p))

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        lr, lr_decay = hp["lr"], hp["lr_decay"]
        any_decay = any(w != 0 for w in hp["weight_decay"])
        coef = self._coefficients({
            "sign": [-1.0 if m else 1.0 for m in hp["maximize"]],
            "weight_decay": hp["weight_decay"],
            "eps": hp["eps"],
        })
        by_steps: dict[tuple[float, ...], _Coefficients] = {}
        for p, step in zip(params, self._count_steps(params)):
            state = self.state[p]
            steps = tuple(step.tolist())
            if steps not in by_steps:
                by_steps[steps] = _Coefficients({
                    "neg_clr": [-(r / (1 + (s - 1) * d)) for r, d, s in zip(lr, lr_decay, steps)],
                })
            grad = p.grad
            if any(hp["maximize"]):
                grad = grad * coef("sign", p)
            if any_decay:
                grad = torch.addcmul(grad, p, coef("weight_decay", p))
            state_sum = state["sum"]
            state_sum.addcmul_(grad, grad, value=1)
            std = state_sum.sqrt().add_(coef("eps", p))
            addcdiv_(p, grad, std, by_steps[steps], "neg_clr")  # stock: value=-clr
