"""Fused Adagrad: torch's Adagrad update for N stacked models, each with its own settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError
from .coefficients import Coefficients, addcdiv_
from .optimizer import FusedOptimizer

__all__ = ["Adagrad"]


class Adagrad(FusedOptimizer):
    """Adagrad for N fused models: ``torch.optim.Adagrad``'s arguments, each shared or per model.

    ::

        opt = hftc.optim.Adagrad(fused.parameters(), lr=[1e-2, 1e-1], lr_decay=[0.0, 1e-3],
                                 initial_accumulator_value=[0.0, 0.1])

    Model i's learning rate at its step t is ``lr_i / (1 + (t - 1) * lr_decay_i)``.
    State (created at construction, as in torch): ``step`` ``[N]`` and ``sum``
    ``[N, *shape]``, model i's slice starting at ``initial_accumulator_value[i]``.

    ``fused=True`` takes torch's fused Adagrad kernel (CPU only, as in torch), one call
    per model over that model's slices of every parameter: ``torch.optim.Adagrad(
    fused=True)`` for each model bit for bit, which differs from the default update by
    a rounding.  The default (``fused=None`` or ``False``) repeats stock's default
    update, one op for all N models, and matches it bit for bit on the CPU.
    ``foreach`` is accepted and kept in ``param_groups`` but changes nothing: on the
    CPU stock's foreach and for-loop updates give the same values bit for bit (torch
    2.13), which hftc's equal.  ``differentiable=True`` raises ``FusionArgumentError``
    (the step runs under ``torch.no_grad()``), as does ``fused=True`` with
    ``foreach=True`` (torch refuses it too).
    """

    _stock = torch.optim.Adagrad
    _hyperparameters = {
        "lr": "float", "lr_decay": "float", "weight_decay": "float",
        "initial_accumulator_value": "float", "eps": "float", "maximize": "flag",
    }
    _flags = {"foreach": None, "differentiable": False, "fused": False}

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach: bool | None = None, *,
                 maximize=False, differentiable: bool = False, fused: bool | None = None,
                 num_models: int | None = None):
        super().__init__(params, num_models, {
            "lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value, "eps": eps,
            "maximize": maximize,
        }, {"foreach": foreach, "differentiable": differentiable, "fused": fused})
        if self.defaults["fused"]:
            for p in self.param_groups[0]["params"]:
                self._check_fused_device(p)
        hp = self.hyperparameters()
        for p in self.param_groups[0]["params"]:
            self._init_state(p, hp)

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        state = self.state[p]
        state["step"] = self._new_steps(p)
        init = Coefficients({"value": hp["initial_accumulator_value"]})
        state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # Stock starts a complex parameter's sum at value + value*1j (its real view's
        # two components alike).
        value = init("value", p.real if p.is_complex() else p)
        state["sum"].add_(torch.complex(value, value) if p.is_complex() else value)

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        params = self._fused_kernel_first(params, hp)
        if not params:
            return
        lr, lr_decay = hp["lr"], hp["lr_decay"]
        any_decay = any(w != 0 for w in hp["weight_decay"])
        coef = self._coefficients({
            "sign": [-1.0 if m else 1.0 for m in hp["maximize"]],
            "weight_decay": hp["weight_decay"],
            "eps": hp["eps"],
        })
        by_steps: dict[tuple[float, ...], Coefficients] = {}
        for p, step in zip(params, self._count_steps(params)):
            state = self.state[p]
            steps = tuple(step.tolist())
            if steps not in by_steps:
                by_steps[steps] = Coefficients({
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

    # ------------------------------------------------------------------ fused=True

    def _check_fused_device(self, p: Tensor) -> None:
        if p.device.type != "cpu":
            raise FusionArgumentError(
                f"Adagrad: fused=True takes torch's fused Adagrad kernel, which exists for "
                f"CPU tensors only (torch.optim.Adagrad(fused=True) refuses {p.device.type} "
                f"parameters too); a parameter is on {p.device}. Pass fused=False (the "
                f"default): its update already runs each op once for all N models")

    def _dense(self, p: Tensor) -> bool:
        return all(t.is_contiguous() for t in (p, p.grad, self.state[p]["sum"]))

    def _update_fused(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        """torch's fused Adagrad kernel, one call per model over its slices of ``params``:
        what ``torch.optim.Adagrad(fused=True)`` runs for that model alone (steps counted
        first, as there)."""
        if not params:
            return
        for p in params:
            self._check_fused_device(p)
        self._count_steps(params)
        states = [self.state[p] for p in params]
        for i in range(self.num_models):
            torch._fused_adagrad_(
                [p[i] for p in params], [p.grad[i] for p in params],
                [s["sum"][i] for s in states], [s["step"][i] for s in states],
                lr=hp["lr"][i], lr_decay=hp["lr_decay"][i],
                weight_decay=hp["weight_decay"][i], eps=hp["eps"][i],
                maximize=hp["maximize"][i])
