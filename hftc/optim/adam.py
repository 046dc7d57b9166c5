"""Fused Adam and AdamW: torch's Adam update for N stacked models, each with its own settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .coefficients import Coefficients, addcdiv_, addcmul_
from .optimizer import FusedOptimizer

__all__ = ["Adam", "AdamW"]

#: On the CPU, parameters up to this many elements (all N models) are updated together
#: by ``_foreach`` ops; larger ones one by one into reused scratch space, where the
#: temporaries ``_foreach`` ops allocate cost more than the update.  On a GPU every
#: parameter takes the ``_foreach`` ops, as stock Adam's CUDA default does: each op is a
#: kernel launch there and the caching allocator makes the temporaries free
#: (docs/DESIGN_NOTES.md, "Measurements behind the code").
_FOREACH_MAX_NUMEL = 1 << 16


#: On the CPU, a parameter of more elements than this (all N models: 8 MB and more in
#: fp32, its update's five or six tensors past a 32 MB cache) is updated in blocks of
#: about ``_BLOCK_NUMEL`` elements (:meth:`Adam._update_one`).
_BLOCK_ABOVE = 1 << 21
_BLOCK_NUMEL = 1 << 18

#: On the CPU, a parameter of at least this many elements per model is updated model by
#: model in contiguous chunks of ``_ROW_CHUNK_NUMEL`` elements (:meth:`Adam._update_rows`):
#: stock's very calls with model i's values, each chunk in cache across the update's ops.
#: Column blocks of such wide rows (N strips far apart in memory) stay in cache far worse;
#: narrower rows take the whole-tensor ops (measured: docs/DESIGN_NOTES.md, "Adam's rows").
_ROW_CHUNKS_MIN_WIDTH = 1 << 15
_ROW_CHUNK_NUMEL = 1 << 16


#: Real dtypes whose kernels stock runs on the tensor as it is (complex ones it views as
#: real first).
_ROW_CHUNK_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _takes_foreach(p: Tensor) -> bool:
    return p.is_cuda or p.numel() <= _FOREACH_MAX_NUMEL


class Adam(FusedOptimizer):
    """Adam (and, with ``decoupled_weight_decay=True``, AdamW) for N fused models.

    The arguments are ``torch.optim.Adam``'s; each is one shared value or a
    sequence of N values, one per model (``betas``: one pair, or N pairs)::

        opt = hftc.optim.Adam(fused.parameters(), lr=[1e-3, 3e-3, 1e-2],
                              betas=[(0.9, 0.999), (0.8, 0.99), (0.9, 0.999)],
                              amsgrad=[False, True, False])

    State per stacked parameter: ``step`` ``[N]`` (per-model step counts, on the
    CPU; with ``capturable=True`` on the parameter's device), ``exp_avg`` and
    ``exp_avg_sq`` ``[N, *shape]``, and ``max_exp_avg_sq`` if some model uses amsgrad.
    Bias corrections use each model's own step.

    ``fused=True`` takes torch's fused Adam kernel (one pass over each tensor, as
    ``torch.optim.Adam(fused=True)``) instead of stock's default op-by-op update:

    * models that share every hyper-parameter but the learning rate (a learning-rate
      sweep) and their step count: one kernel call over the stacked tensors computes
      the unit step ``-m_hat / (sqrt(v_hat) + eps)`` once into scratch space, and
      ``p += lr_i * step`` applies it per model (one call with ``lr`` itself when the
      learning rates are shared too). Within a rounding of stock ``Adam(fused=True)``,
      not bit for bit: the CPU kernel rounds its vector body and its scalar tail
      differently, and over the stacked tensor a model's last elements can fall in
      the body where stock's call over that model alone ends in the tail (seen in
      ``exp_avg_sq``, 1 ulp, with 4 or 12 elements per model on AVX2);
    * anything else: one kernel call per model over its slices, which is stock
      ``Adam(fused=True)`` for that model bit for bit.

    The default (``fused=None`` or ``False``) repeats stock's default update and
    matches it bit for bit on the CPU.

    ``foreach`` is accepted and kept in ``param_groups`` but changes nothing: hftc picks
    its own ops (``_foreach`` ops for small parameters, see ``_FOREACH_MAX_NUMEL``),
    and on the CPU stock's foreach and for-loop updates give the same values bit for
    bit (torch 2.13), which hftc's equal.  ``capturable=True`` runs stock's capturable
    update (:meth:`_update_capturable`: step counts and every per-model value as device
    tensors, no host sync; ``refresh_hyperparameters`` before a graph replay).
    ``differentiable=True`` raises ``FusionArgumentError`` (the step runs under
    ``torch.no_grad()``), as does ``fused=True`` with ``foreach=True``, which torch
    refuses too, or with ``capturable=True``.
    """

    _stock = torch.optim.Adam
    _hyperparameters = {
        "lr": "float", "betas": "pair", "eps": "float", "weight_decay": "float",
        "amsgrad": "flag", "maximize": "flag", "decoupled_weight_decay": "flag",
    }
    _flags = {"foreach": None, "capturable": False, "differentiable": False, "fused": False}
    _capturable_supported = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach: bool | None = None, maximize=False,
                 capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay=False,
                 num_models: int | None = None):
        super().__init__(params, num_models, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "amsgrad": amsgrad, "maximize": maximize,
            "decoupled_weight_decay": decoupled_weight_decay,
        }, {"foreach": foreach, "capturable": capturable, "differentiable": differentiable,
            "fused": fused})

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        state = self.state[p]
        state["step"] = self._new_steps(p)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if any(hp["amsgrad"]):
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        params = self._fused_kernel_first(params, hp)
        if not params:
            return
        lr, wd, amsgrad = hp["lr"], hp["weight_decay"], hp["amsgrad"]
        beta1 = [b[0] for b in hp["betas"]]
        beta2 = [b[1] for b in hp["betas"]]
        decoupled = hp["decoupled_weight_decay"]
        any_coupled = any(w != 0 and not d for w, d in zip(wd, decoupled))
        any_decoupled = any(d and w != 0 for w, d in zip(wd, decoupled))
        coef = self._coefficients(self._coefficient_rows(hp))
        if self._capturable():
            self._update_capturable(params, hp, coef, any_coupled, any_decoupled)
            return
        # Parameters grouped by their models' step counts (one group unless some model
        # skipped steps), each group with its bias corrections.
        by_steps: dict[tuple[float, ...], list[Tensor]] = {}
        for p, steps in zip(params, self._count_steps(params)):
            state = self.state[p]
            if any(amsgrad) and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            by_steps.setdefault(tuple(steps.tolist()), []).append(p)
        simple = not any(amsgrad) and not any(hp["maximize"])
        for steps, group in by_steps.items():
            # Python doubles, as stock computes them from step.item().
            step_coef = Coefficients({
                "neg_step_size": [-(r / (1 - b ** s)) for r, b, s in zip(lr, beta1, steps)],
                "bc2_sqrt": [(1 - b ** s) ** 0.5 for b, s in zip(beta2, steps)],
            })
            together = [p for p in group if simple and _takes_foreach(p)]
            if together:
                self._update_foreach(together, coef, step_coef, any_coupled, any_decoupled)
            for p in group:
                if not (simple and _takes_foreach(p)):
                    self._update_one(p, hp, coef, step_coef, any_coupled, any_decoupled)

    def _coefficient_rows(self, hp: dict[str, list[Any]]) -> dict[str, list[float]]:
        lr, wd, decoupled = hp["lr"], hp["weight_decay"], hp["decoupled_weight_decay"]
        beta1 = [b[0] for b in hp["betas"]]
        beta2 = [b[1] for b in hp["betas"]]
        # Adam adds wd*p to the gradient; AdamW multiplies p by 1 - lr*wd. Per model,
        # the other one's coefficient is the identity (0 added, times 1.0).
        rows = {
            "sign": [-1.0 if m else 1.0 for m in hp["maximize"]],
            "coupled_wd": [0.0 if d else w for w, d in zip(wd, decoupled)],
            "decay": [1 - r * w if d else 1.0 for r, w, d in zip(lr, wd, decoupled)],
            "one_minus_beta1": [1 - b for b in beta1],
            "beta2": beta2,
            "one_minus_beta2": [1 - b for b in beta2],
            "eps": hp["eps"],
            "amsgrad": hp["amsgrad"],
        }
        if self._capturable():  # the bias corrections, computed on the device
            rows.update(lr=lr, beta1=beta1)
        return rows

    def _update_capturable(self, params: list[Tensor], hp: dict[str, list[Any]],
                           coef: Coefficients, any_coupled: bool, any_decoupled: bool) -> None:
        """Stock's ``capturable=True`` single-tensor update, each model's values a row of
        ``coef`` (tensors made once, :meth:`refresh_hyperparameters`) and each model's
        bias corrections computed on the device from its step count::

            step += 1;  (the moments as in the default update)
            bc1 = 1 - beta1 ** step;  bc2 = 1 - beta2 ** step        ([N], step's dtype)
            step_size_neg = -(lr / bc1)
            denom = sqrt(v) / (sqrt(bc2) * step_size_neg) + eps / step_size_neg
            p += m / denom

        No host sync and no coefficient tensor made after the first step, so a CUDA graph
        can capture it; every per-model value is read from its tensor on each replay."""
        amsgrad = hp["amsgrad"]
        for p, step in zip(params, self._count_steps(params)):
            state = self.state[p]
            if any(amsgrad) and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grad = p.grad
            if any(hp["maximize"]):
                grad = grad * coef("sign", p)
            if any_decoupled:
                p.mul_(coef("decay", p))
            if any_coupled:
                grad = torch.addcmul(grad, p, coef("coupled_wd", p))
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(grad, coef("one_minus_beta1", p))
            addcmul_(exp_avg_sq.mul_(coef("beta2", p)), grad, grad, coef("one_minus_beta2", p))
            second = exp_avg_sq
            if any(amsgrad):
                max_sq = state["max_exp_avg_sq"]
                torch.maximum(max_sq, exp_avg_sq, out=max_sq)
                second = max_sq if all(amsgrad) else torch.where(
                    coef.mask("amsgrad", p), max_sq, exp_avg_sq)
            bias_correction1 = 1 - torch.pow(coef("beta1", step), step)
            bias_correction2 = 1 - torch.pow(coef("beta2", step), step)
            # Stock divides a Python float by a tensor: float.__truediv__ -> torch's
            # Tensor.__rtruediv__, which multiplies by the reciprocal (rounding so).
            step_size_neg = (bias_correction1.reciprocal() * coef("lr", step)).neg()
            per_model = (-1,) + (1,) * (p.dim() - 1)
            denom = (second.sqrt() / (bias_correction2.sqrt() * step_size_neg).view(per_model)
                     ).add_((step_size_neg.reciprocal() * coef("eps", step)).view(per_model))
            p.addcdiv_(exp_avg, denom)

    def _update_one(self, p: Tensor, hp: dict[str, list[Any]], coef: Coefficients,
                    step_coef: Coefficients, any_coupled: bool, any_decoupled: bool) -> None:
        """Stock's single-tensor update of one stacked parameter, op for op.

        On the CPU, a dense parameter with wide rows takes :meth:`_update_rows`.  One
        too large for the cache (more than ``_BLOCK_ABOVE``
        elements, all N models) is updated in column blocks of its ``[N, numel / N]``
        view, every op of the update on one block before the next::

            whole tensor:   op1 over P, op2 over P, ... op9 over P    (each pass from DRAM)
            in blocks:      op1..op9 over P[:, 0:c], then P[:, c:2c], ...  (in cache)

        Each element sees the same ops in the same order, so the results do not change;
        only the memory traffic does (docs/DESIGN_NOTES.md).
        """
        state, amsgrad = self.state[p], hp["amsgrad"]
        tensors = [p, p.grad, state["exp_avg"], state["exp_avg_sq"]]
        if any(amsgrad):
            tensors.append(state["max_exp_avg_sq"])
        on_cpu_dense = p.device.type == "cpu" and all(t.is_contiguous() for t in tensors)
        if on_cpu_dense and p.numel() // self.num_models >= _ROW_CHUNKS_MIN_WIDTH \
                and p.dtype in _ROW_CHUNK_DTYPES:
            self._update_rows(tensors, hp, coef, step_coef)
            return
        if not on_cpu_dense or p.numel() <= _BLOCK_ABOVE:
            self._adam_math(tensors, (self._scratch(p, 0), self._scratch(p, 1)), hp, coef,
                            step_coef, any_coupled, any_decoupled)
            return
        # A block's per-model slices are small: its last addcdiv_ takes the product
        # y * c (two calls), not N calls with their own values (and 3N slicing ops).
        for block, scratch in self._column_blocks(tensors, 2, _BLOCK_NUMEL):
            self._adam_math(block, scratch, hp, coef, step_coef, any_coupled, any_decoupled,
                            one_by_one=False)

    def _update_rows(self, tensors: list[Tensor], hp: dict[str, list[Any]],
                     coef: Coefficients, step_coef: Coefficients) -> None:
        """Stock's single-tensor update on ``[p, grad, exp_avg, exp_avg_sq(, max_exp_avg_sq)]``
        (contiguous, on the CPU), one by one in chunks of each model's row::

            for i in models:  for chunk in row i (64-element multiples, the last ragged):
                stock's ops on the chunk with model i's values as Python floats

        Every chunk but a row's last is a whole number of the kernels' vector steps, so
        each element meets the vectorised or the scalar-tail code exactly as in stock's
        call over model i's tensor: the same ops, the same rounding.  The chunk's
        temporaries (the denominator; the gradient under maximize or coupled decay) live
        in one small scratch buffer that stays in cache.
        """
        n = self.num_models
        row_sizes, chunks = self._row_chunks(tensors, _ROW_CHUNK_NUMEL)
        sizes, per_model, chunk = row_sizes * n, len(row_sizes), row_sizes[0]
        denoms, grad_scratch = self._row_scratch(tensors[0], chunk, 2)
        amsgrad = hp["amsgrad"]
        rows = {name: coef.row(name) for name in (
            "sign", "coupled_wd", "decay", "one_minus_beta1", "beta2", "one_minus_beta2",
            "eps")}
        bc2_sqrt, neg_step_size = step_coef.row("bc2_sqrt"), step_coef.row("neg_step_size")
        scalars = self._row_scalars(tensors[0].dtype, [
            rows["decay"], rows["beta2"], rows["eps"], bc2_sqrt])
        for i in range(n):
            maximize, wd = rows["sign"][i] < 0, rows["coupled_wd"][i]
            one_minus_beta1 = rows["one_minus_beta1"][i]
            one_minus_beta2 = rows["one_minus_beta2"][i]
            decays, value = rows["decay"][i] != 1.0, neg_step_size[i]
            decay, beta2, eps, bc2 = scalars[i]
            for k in range(i * per_model, (i + 1) * per_model):
                p, grad, exp_avg, exp_avg_sq = (c[k] for c in chunks[:4])
                size = sizes[k]
                denom = denoms if size == chunk else denoms[:size]
                if maximize:
                    grad = torch.neg(grad, out=grad_scratch[:size])
                if decays:
                    p.mul_(decay)
                if wd != 0:
                    grad = torch.add(grad, p, alpha=wd, out=grad_scratch[:size])
                exp_avg.lerp_(grad, one_minus_beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=one_minus_beta2)
                second = exp_avg_sq
                if len(chunks) > 4:
                    max_sq = chunks[4][k]
                    torch.maximum(max_sq, exp_avg_sq, out=max_sq)
                    if amsgrad[i]:
                        second = max_sq
                torch.sqrt(second, out=denom).div_(bc2).add_(eps)
                p.addcdiv_(exp_avg, denom, value=value)

    @staticmethod
    def _adam_math(tensors: list[Tensor], scratch: Sequence[Tensor], hp: dict[str, list[Any]],
                   coef: Coefficients, step_coef: Coefficients, any_coupled: bool,
                   any_decoupled: bool, one_by_one: bool = True) -> None:
        """The update on ``[p, grad, exp_avg, exp_avg_sq(, max_exp_avg_sq)]`` (a whole
        stacked parameter or a block of it), with two scratch tensors shaped like ``p``."""
        p, grad, exp_avg, exp_avg_sq = tensors[:4]
        amsgrad = hp["amsgrad"]
        if any(hp["maximize"]):
            grad = grad * coef("sign", p)
        if any_decoupled:
            p.mul_(coef.get("decay", p))
        if any_coupled:
            grad = torch.addcmul(grad, p, coef("coupled_wd", p))
        exp_avg.lerp_(grad, coef.get("one_minus_beta1", p))
        addcmul_(exp_avg_sq.mul_(coef.get("beta2", p)), grad, grad,
                 coef.get("one_minus_beta2", p))
        if any(amsgrad):
            max_sq = tensors[4]
            torch.maximum(max_sq, exp_avg_sq, out=max_sq)
            second = max_sq if all(amsgrad) else torch.where(
                coef.mask("amsgrad", p), max_sq, exp_avg_sq)
        else:
            second = exp_avg_sq
        # Stock: denom = (second.sqrt() / bc2_sqrt).add_(eps), written into scratch space.
        denom = torch.sqrt(second, out=scratch[0])
        denom.div_(step_coef.get("bc2_sqrt", p)).add_(coef.get("eps", p))
        addcdiv_(p, exp_avg, denom, step_coef, "neg_step_size", scratch[1],  # value=-step_size
                 one_by_one=one_by_one)

    def _update_foreach(self, params: list[Tensor], coef: Coefficients,
                        step_coef: Coefficients, any_coupled: bool,
                        any_decoupled: bool) -> None:
        """:meth:`_update_one` for many parameters at once, with ``torch._foreach_*`` ops.

        The same ops in the same order on each tensor (on the CPU, ``_foreach_*`` runs
        the per-tensor kernel on each), so the results are stock's bit for bit; one call
        per op instead of one per op and parameter: at small N the per-call cost, not the
        arithmetic, is the update's time.
        Without maximize or amsgrad (those take :meth:`_update_one`).
        """
        state = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [s["exp_avg"] for s in state]
        exp_avg_sqs = [s["exp_avg_sq"] for s in state]

        def each(c: Coefficients, name: str) -> float | list[Tensor]:
            value = c.get(name, params[0])
            return value if not isinstance(value, Tensor) else [c(name, p) for p in params]

        if any_decoupled:
            torch._foreach_mul_(params, each(coef, "decay"))
        if any_coupled:
            grads = torch._foreach_addcmul(grads, params, [coef("coupled_wd", p) for p in params])
        torch._foreach_lerp_(exp_avgs, grads, each(coef, "one_minus_beta1"))
        torch._foreach_mul_(exp_avg_sqs, each(coef, "beta2"))
        one_minus_beta2 = each(coef, "one_minus_beta2")
        if isinstance(one_minus_beta2, list):  # addcmul_ with a per-model value
            torch._foreach_addcmul_(exp_avg_sqs, torch._foreach_mul(grads, one_minus_beta2),
                                    grads)
        else:
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=one_minus_beta2)
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, each(step_coef, "bc2_sqrt"))
        torch._foreach_add_(denoms, each(coef, "eps"))
        neg_step_size = each(step_coef, "neg_step_size")
        if isinstance(neg_step_size, list):
            torch._foreach_addcdiv_(params, torch._foreach_mul(exp_avgs, neg_step_size), denoms)
        else:
            torch._foreach_addcdiv_(params, exp_avgs, denoms, value=neg_step_size)

    # ------------------------------------------------------------------ fused=True

    def _dense(self, p: Tensor) -> bool:
        state = self.state[p]
        tensors = [p, p.grad, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")]
        return all(t is None or t.is_contiguous() for t in tensors)

    def _update_fused(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        n = self.num_models
        shared = all(all(v == hp[k][0] for v in hp[k]) for k in hp if k != "lr")
        self._count_steps(params)
        for p in params:
            state = self.state[p]
            if any(hp["amsgrad"]) and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if shared:
                self._fused_all_models(p, hp)
            else:
                for i in range(n):
                    self._fused_call([p[i]], [p.grad[i]], p, [i], hp, lr=hp["lr"][i])

    def _fused_call(self, targets: list[Tensor], grads: list[Tensor], p: Tensor,
                    models: list[int] | None, hp: dict[str, list[Any]], *, lr: float,
                    weight_decay: float | None = None, maximize: bool | None = None) -> None:
        """torch's fused Adam(W) kernel on ``targets``, one launch: model ``models[j]``'s
        slice of a tensor like ``p`` each, with its own step count (the kernel takes one
        per tensor) and moments; or, ``models`` None, whole ``[N, ...]`` tensors whose
        models all counted the same steps.  ``models[0]``'s (model 0's) settings."""
        state, k = self.state[p], 0 if models is None else models[0]

        def pick(t: Tensor) -> list[Tensor]:
            if models is None:
                return [t]
            if len(models) == self.num_models:
                return list(t.unbind(0))  # one op for N views, not N indexing ops
            return [t[i] for i in models]

        decoupled = hp["decoupled_weight_decay"][k]
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        amsgrad = hp["amsgrad"][k]
        steps = [state["step"][0]] if models is None else pick(state["step"])
        kernel(
            targets, grads, pick(state["exp_avg"]), pick(state["exp_avg_sq"]),
            pick(state["max_exp_avg_sq"]) if amsgrad else [], steps,
            amsgrad=amsgrad, lr=lr, beta1=hp["betas"][k][0], beta2=hp["betas"][k][1],
            weight_decay=hp["weight_decay"][k] if weight_decay is None else weight_decay,
            eps=hp["eps"][k], maximize=hp["maximize"][k] if maximize is None else maximize,
        )

    def _fused_all_models(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        """One kernel call for N models that differ at most in their learning rates (and
        step counts: a model skipped by ``skip_models`` counts fewer)."""
        lr, steps = hp["lr"], self.state[p]["step"]
        # Whole tensors where the models counted alike, which only the CPU can tell
        # without a sync (one tensor a launch costs less than N views); else per model.
        whole = steps.device.type == "cpu" and bool((steps == steps[0]).all())
        models = None if whole else list(range(self.num_models))

        def split(t: Tensor) -> list[Tensor]:
            return [t] if whole else list(t.unbind(0))

        if all(r == lr[0] for r in lr):
            self._fused_call(split(p), split(p.grad), p, models, hp, lr=lr[0])
            return
        # The update is linear in lr: compute the unit step (lr = 1) into scratch space,
        # then p += lr_i * step per model.  Decays that read p are applied here, to p.
        wd, maximize = hp["weight_decay"][0], hp["maximize"][0]
        coef = self._coefficients({"lr": lr, "decay": [1 - r * wd for r in lr]})
        grad = p.grad
        if wd != 0 and hp["decoupled_weight_decay"][0]:
            p.mul_(coef("decay", p))
        elif wd != 0:
            grad = torch.add(grad.neg() if maximize else grad, p, alpha=wd)
            maximize = False
        unit = self._scratch(p, 0).zero_()
        self._fused_call(split(unit), split(grad), p, models, hp, lr=1.0, weight_decay=0.0,
                         maximize=maximize)
        p.addcmul_(unit, coef("lr", p))


class AdamW(Adam):
    """AdamW (decoupled weight decay) for N fused models: ``torch.optim.AdamW``'s arguments.

    ``hftc.optim.Adam`` with ``decoupled_weight_decay=True`` and a default
    ``weight_decay`` of 1e-2, as in torch (``foreach``, ``capturable``,
    ``differentiable`` and ``fused`` as there).
    """

    _stock = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, num_models: int | None = None):
        super().__init__(params, num_models=num_models, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)
