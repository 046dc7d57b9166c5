"""Fused RAdam: torch's RAdam update for N stacked models, each with its own settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .coefficients import Coefficients
from .moments import AdamMoments
from .optimizer import FusedOptimizer

__all__ = ["RAdam"]


def _rectification(beta2: float, step: float) -> tuple[float, float | None]:
    """``(rho_t, r_t)`` as stock computes them: the length of the approximated SMA and the
    variance rectification term, ``None`` where ``rho_t <= 5`` (stock's unrectified step)."""
    rho_inf = 2 / (1 - beta2) - 1
    bias_correction2 = 1 - beta2 ** step
    rho_t = rho_inf - 2 * step * (beta2 ** step) / bias_correction2
    if not rho_t > 5.0:
        return rho_t, None
    return rho_t, ((rho_t - 4) * (rho_t - 2) * rho_inf
                   / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5


class RAdam(FusedOptimizer):
    """RAdam for N fused models: ``torch.optim.RAdam``'s arguments, each shared or per model
    (``betas``: one pair, or N pairs)::

        opt = hftc.optim.RAdam(fused.parameters(), lr=[1e-3, 3e-3],
                               decoupled_weight_decay=[False, True], weight_decay=0.01)

    State per stacked parameter: ``step`` ``[N]`` (per-model step counts, on the CPU),
    ``exp_avg`` and ``exp_avg_sq`` ``[N, *shape]``.  Each model's rectification (and
    whether its step is rectified at all, ``rho_t > 5``) follows its own step count
    and ``beta2``; models on either side of that threshold take stock's two forms of
    the step, selected per model.

    Stock has two updates that round differently: its for-loop one (the CPU's
    default) ``p -= exp_avg / bc1 * lr * sqrt(bc2) / (sqrt(exp_avg_sq) + eps) * r_t``,
    its ``foreach`` one (the default on CUDA, or ``foreach=True``) ``p += exp_avg *
    1 / ((sqrt(exp_avg_sq) + eps) / (-sqrt(bc2) lr r_t / bc1))``.  Each model gets
    the one its ``param_groups[i]["foreach"]`` picks, as stock's would, so that every
    model matches stock with the same ``foreach`` bit for bit on the CPU
    (``fuse_optimizers`` copies each stock optimizer's ``foreach``).
    ``capturable=True`` and ``differentiable=True`` raise ``FusionArgumentError`` (step
    counts stay on the CPU; the step runs under ``torch.no_grad()``).
    """

    _stock = torch.optim.RAdam
    _hyperparameters = {
        "lr": "float", "betas": "pair", "eps": "float", "weight_decay": "float",
        "decoupled_weight_decay": "flag", "maximize": "flag",
    }
    _flags = {"foreach": None, "capturable": False, "differentiable": False}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 decoupled_weight_decay=False, *, foreach: bool | None = None, maximize=False,
                 capturable: bool = False, differentiable: bool = False,
                 num_models: int | None = None):
        super().__init__(params, num_models, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay, "maximize": maximize,
        }, {"foreach": foreach, "capturable": capturable, "differentiable": differentiable})

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        state = self.state[p]
        state["step"] = self._new_steps(p)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @staticmethod
    def _step_coefficients(lr: list[float], beta1: list[float], beta2: list[float],
                           steps: tuple[float, ...]) -> Coefficients:
        """Each model's step scalars, Python doubles computed as stock computes them from
        its ``step.item()`` (for-loop update: ``bc1``, ``bc2_sqrt``, ``rect``; foreach
        update: ``bc2_step``, ``unrect_step``)."""
        bc1 = [1 - b ** s for b, s in zip(beta1, steps)]
        rects = [_rectification(b, s)[1] for b, s in zip(beta2, steps)]
        return Coefficients({
            "bc1": bc1,
            "bc2_sqrt": [(1 - b ** s) ** 0.5 for b, s in zip(beta2, steps)],
            "rectified": [r is not None for r in rects],
            "rect": [1.0 if r is None else r for r in rects],  # 1.0: not used (unrectified)
            "bc2_step": [((1 - b ** s) ** 0.5) * (r * (0 if t is None else t) / c) * -1
                         for b, s, r, t, c in zip(beta2, steps, lr, rects, bc1)],
            "unrect_step": [(r * (1.0 if t is None else 0) / c) * -1
                            for r, t, c in zip(lr, rects, bc1)],
        })

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        """Stock's, per parameter (its scalars as per-model coefficients)::

            grad = -grad if maximize
            p = (1 - lr * wd) * p  (decoupled)  or  grad = grad + wd * p
            exp_avg = lerp(exp_avg, grad, 1 - beta1)
            exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
            p -= exp_avg / bc1 * lr * (1 / (sqrt(exp_avg_sq) + eps) * sqrt(bc2)) * r_t
                                                  (rho_t > 5; else p -= exp_avg / bc1 * lr)
        """
        lr = hp["lr"]
        moments = AdamMoments.of(self, params, hp, lr=lr)
        beta1, beta2, foreach, coef = moments.beta1, moments.beta2, moments.foreach, moments.coef
        step_coefs: dict[tuple[float, ...], Coefficients] = {}
        for p, step in zip(params, self._count_steps(params)):
            steps = tuple(step.tolist())
            if steps not in step_coefs:
                step_coefs[steps] = self._step_coefficients(lr, beta1, beta2, steps)
            step_coef = step_coefs[steps]
            state = self.state[p]
            _, exp_avg, exp_avg_sq = moments.update(p, state)
            if all(foreach):
                p.addcmul_(exp_avg, self._foreach_factor(exp_avg_sq, coef, step_coef, p))
            elif not any(foreach):
                p.add_(self._for_loop_step(exp_avg, exp_avg_sq, coef, step_coef, p), alpha=-1.0)
            else:  # models with either of stock's updates: each model's own, selected
                p.copy_(torch.where(
                    coef.mask("foreach", p),
                    p.addcmul(exp_avg, self._foreach_factor(exp_avg_sq, coef, step_coef, p)),
                    p.add(self._for_loop_step(exp_avg, exp_avg_sq, coef, step_coef, p),
                          alpha=-1.0)))

    @staticmethod
    def _for_loop_step(exp_avg: Tensor, exp_avg_sq: Tensor, coef: Coefficients,
                       step_coef: Coefficients, p: Tensor) -> Tensor:
        """Stock's for-loop update, ``p.add_(step, alpha=-1.0)``: ``step`` is
        ``exp_avg / bc1 * lr * adaptive * rect`` (``rho_t > 5``), else ``exp_avg / bc1 * lr``,
        where stock's ``adaptive = sqrt(bc2) / (sqrt(exp_avg_sq) + eps)`` is Tensor's
        ``__rtruediv__``: ``reciprocal() * sqrt(bc2)``."""
        rectified = step_coef.row("rectified")
        step = (exp_avg / step_coef.get("bc1", p)) * coef.get("lr", p)
        if not any(rectified):
            return step
        adaptive = exp_avg_sq.sqrt().add_(coef.get("eps", p)).reciprocal_()
        adaptive.mul_(step_coef.get("bc2_sqrt", p))
        rect_step = step * adaptive * step_coef.get("rect", p)
        if all(rectified):
            return rect_step
        return torch.where(step_coef.mask("rectified", p), rect_step, step)

    @staticmethod
    def _foreach_factor(exp_avg_sq: Tensor, coef: Coefficients, step_coef: Coefficients,
                        p: Tensor) -> Tensor:
        """Stock's foreach update, ``p.addcmul_(exp_avg, factor)``: ``factor`` is
        ``1 / ((sqrt(exp_avg_sq) + eps) / bc2_step) + unrect_step`` (``bc2_step`` is 0 for
        an unrectified model, ``unrect_step`` for a rectified one)."""
        factor = exp_avg_sq.sqrt().add_(coef.get("eps", p))
        factor.div_(step_coef.get("bc2_step", p)).reciprocal_()
        return factor.add_(step_coef.get("unrect_step", p))
