"""Fused NAdam: torch's NAdam update for N stacked models, each with its own settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError
from .coefficients import Coefficients, addcdiv_, scalar_dtype
from .moments import AdamMoments
from .optimizer import FusedOptimizer

__all__ = ["NAdam"]


class NAdam(FusedOptimizer):
    """NAdam for N fused models: ``torch.optim.NAdam``'s arguments, each shared or per model
    (``betas``: one pair, or N pairs)::

        opt = hftc.optim.NAdam(fused.parameters(), lr=[2e-3, 1e-2], momentum_decay=[4e-3, 1e-2],
                               decoupled_weight_decay=[False, True], weight_decay=0.01)

    State per stacked parameter: ``step`` and ``mu_product`` ``[N]`` (per model, on the
    CPU in stock's scalar dtype, as stock keeps them per parameter), ``exp_avg`` and
    ``exp_avg_sq`` ``[N, *shape]``.  ``load_state_dict`` keeps ``mu_product`` as saved,
    as torch keeps ``step``, so a resumed run equals the uninterrupted one; stock's
    loading casts it to the parameters' dtype (float32 to float64 for float64
    parameters under the default float32 dtype), after which a resumed stock NAdam
    differs from its own uninterrupted run by a rounding of ``mu_product``.

    Stock has two updates that round differently: its for-loop one (the CPU's default)
    computes the denominator ``sqrt(exp_avg_sq / bc2) + eps``, its ``foreach`` one (the
    default on CUDA, or ``foreach=True``) ``sqrt(exp_avg_sq) / sqrt(bc2) + eps``.  Each
    model gets the one its ``param_groups[i]["foreach"]`` picks, as stock's would, so
    that every model matches stock with the same ``foreach`` bit for bit on the CPU
    (``fuse_optimizers`` copies each stock optimizer's ``foreach``).
    ``capturable=True`` and ``differentiable=True`` raise ``FusionArgumentError`` (step
    counts stay on the CPU; the step runs under ``torch.no_grad()``).
    """

    _stock = torch.optim.NAdam
    _hyperparameters = {
        "lr": "float", "betas": "pair", "eps": "float", "weight_decay": "float",
        "momentum_decay": "float", "decoupled_weight_decay": "flag", "maximize": "flag",
    }
    _flags = {"foreach": None, "capturable": False, "differentiable": False}
    _per_model_scalar_state = ("step", "mu_product")

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 momentum_decay=4e-3, decoupled_weight_decay=False, *,
                 foreach: bool | None = None, maximize=False, capturable: bool = False,
                 differentiable: bool = False, num_models: int | None = None):
        super().__init__(params, num_models, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "momentum_decay": momentum_decay,
            "decoupled_weight_decay": decoupled_weight_decay, "maximize": maximize,
        }, {"foreach": foreach, "capturable": capturable, "differentiable": differentiable})

    def _check_hyperparameters(self, hp: dict[str, Any], model: int) -> None:
        super()._check_hyperparameters(hp, model)
        if not hp["momentum_decay"] >= 0.0:
            raise FusionArgumentError(
                f"Invalid momentum_decay for model {model}: "
                f"{hp['momentum_decay']} (must be >= 0)")

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        state = self.state[p]
        state["step"] = self._new_steps(p)
        state["mu_product"] = torch.ones(self.num_models, dtype=scalar_dtype())
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _import_model_state(self, p: Tensor, model: int, stock_state: dict[str, Any]) -> None:
        """The base class's; a stock ``mu_product`` of a wider dtype than this one's (a
        stock NAdam loaded from a state dict holds its parameters' float64) widens it, so
        that model keeps stock's rounding (models whose stock kept float32 then multiply in
        float64: within a rounding of their stock's ``mu_product``)."""
        stock = stock_state.get("mu_product")
        mine = self.state[p].get("mu_product")
        if isinstance(stock, Tensor) and isinstance(mine, Tensor):
            dtype = torch.promote_types(stock.dtype, mine.dtype)
            if dtype != mine.dtype:
                self.state[p]["mu_product"] = mine.to(dtype)
        super()._import_model_state(p, model, stock_state)

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        """Stock's, per parameter (its scalars as per-model coefficients)::

            grad = -grad if maximize
            p = (1 - lr * wd) * p  (decoupled)  or  grad = grad + wd * p
            mu_t = beta1 * (1 - 0.96 ** (t * momentum_decay) / 2);  mu_product *= mu_t
            exp_avg = lerp(exp_avg, grad, 1 - beta1)
            exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
            denom = sqrt(exp_avg_sq / bc2) + eps    (foreach: sqrt(exp_avg_sq) / sqrt(bc2) + eps)
            p += -lr (1 - mu_t) / (1 - mu_product) * grad / denom
            p += -lr mu_{t+1} / (1 - mu_product mu_{t+1}) * exp_avg / denom
        """
        lr = hp["lr"]
        moments = AdamMoments.of(self, params, hp)
        beta1, beta2, foreach, coef = moments.beta1, moments.beta2, moments.foreach, moments.coef
        momentum_decay = hp["momentum_decay"]
        step_coefs: dict[tuple[tuple[float, ...], tuple[float, ...]], Coefficients] = {}
        for p, step in zip(params, self._count_steps(params)):
            state = self.state[p]
            steps = step.tolist()  # Python doubles, as stock's step.item()
            mus = [b * (1.0 - 0.5 * (0.96 ** (s * m)))
                   for b, s, m in zip(beta1, steps, momentum_decay)]
            mu_nexts = [b * (1.0 - 0.5 * (0.96 ** ((s + 1) * m)))
                        for b, s, m in zip(beta1, steps, momentum_decay)]
            # Stock: mu_product *= mu_t, a 0-dim tensor of its scalar dtype times a Python
            # double; the same rounding elementwise.
            mu_product = state["mu_product"]
            mu_product.mul_(torch.tensor(mus, dtype=mu_product.dtype))
            products = mu_product.tolist()
            key = (tuple(steps), tuple(products))
            step_coef = step_coefs.get(key)
            if step_coef is None:
                step_coef = step_coefs[key] = Coefficients({
                    "bc2": [1 - b ** s for b, s in zip(beta2, steps)],
                    "bc2_sqrt": [(1 - b ** s) ** 0.5 for b, s in zip(beta2, steps)],
                    "grad_step": [(-r * (1.0 - mu)) / (1.0 - mp)
                                  for r, mu, mp in zip(lr, mus, products)],
                    "exp_avg_step": [(-r * mu_next) / (1.0 - mp * mu_next)
                                     for r, mu_next, mp in zip(lr, mu_nexts, products)],
                })
            grad, exp_avg, exp_avg_sq = moments.update(p, state)
            if not all(foreach):
                denom = exp_avg_sq.div(step_coef.get("bc2", p)).sqrt()
            if any(foreach):
                denom_foreach = exp_avg_sq.sqrt().div_(step_coef.get("bc2_sqrt", p))
                denom = denom_foreach if all(foreach) else torch.where(
                    coef.mask("foreach", p), denom_foreach, denom)
            denom.add_(coef.get("eps", p))
            addcdiv_(p, grad, denom, step_coef, "grad_step")
            addcdiv_(p, exp_avg, denom, step_coef, "exp_avg_step")
