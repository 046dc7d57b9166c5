"""Fused SGD: torch.optim.SGD's update for N stacked models, each with its own settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import FusionArgumentError
from .coefficients import Coefficients, copy_model_state
from .optimizer import FusedOptimizer

__all__ = ["SGD"]

#: On the CPU, parameters of more than this many elements (all N models) are updated in
#: blocks of about ``_BLOCK_NUMEL`` elements, every op of the step on one block before
#: the next: pieces of one model's row where a model has ``_ROW_MIN_NUMEL`` elements or
#: more (``SGD._update_rows``: stock's ops with that model's scalars), column
#: blocks of all N rows otherwise (``_column_blocks``: fewer calls for small rows);
#: smaller parameters, and all of them on a GPU, together by ``_foreach`` ops (one call
#: per op, not one per op and parameter). Up to 1M elements (4 MB in fp32) the
#: ``_foreach`` temporaries cost less than the blocks' extra calls (docs/BENCHMARKS.md).
_FOREACH_MAX_NUMEL = 1 << 20
_BLOCK_NUMEL = 1 << 16
_ROW_MIN_NUMEL = 1 << 14


class _SGDStep:
    """Stock SGD's update where every model takes the same ops (each with its own values):
    every model has a momentum buffer (nesterov for all or for none) or no model has a
    momentum::

        g = -grad if maximize;  g = g + wd * p
        buf = m * buf + (1 - dampening) * g;  d = g + m * buf if nesterov else buf
        p = p - lr * d

    ``one`` runs it on one tensor (or block) with a scratch tensor for ``g``, ``foreach``
    on many with ``torch._foreach_*`` ops (on the CPU, the per-tensor kernel on each, so
    both round as stock's single-tensor and foreach updates do)."""

    def __init__(self, coef: Coefficients, maximize: bool, decay: bool, momentum: bool,
                 nesterov: bool):
        self.coef, self.maximize, self.decay = coef, maximize, decay
        self.momentum, self.nesterov = momentum, nesterov

    def one(self, p: Tensor, grad: Tensor, buf: Tensor | None, scratch: Tensor) -> None:
        coef = self.coef
        if self.maximize:
            grad = torch.mul(grad, coef("sign", p), out=scratch)
        if self.decay:
            grad = torch.addcmul(grad, p, coef("weight_decay", p), out=scratch)
        if self.momentum:
            buf.mul_(coef.get("momentum", p))
            one_minus_dampening = coef.get("one_minus_dampening", p)
            if isinstance(one_minus_dampening, Tensor):
                buf.addcmul_(grad, one_minus_dampening)
            else:
                buf.add_(grad, alpha=one_minus_dampening)
            grad = torch.addcmul(grad, buf, coef("momentum", p), out=scratch) \
                if self.nesterov else buf
        p.addcmul_(grad, coef("neg_lr", p))

    def foreach(self, params: list[Tensor], bufs: list[Tensor | None]) -> None:
        coef = self.coef

        def each(name: str) -> list[Tensor]:
            return [coef(name, p) for p in params]

        def each_or_shared(name: str) -> float | list[Tensor]:
            value = coef.get(name, params[0])
            return each(name) if isinstance(value, Tensor) else value

        grads = [p.grad for p in params]
        if self.maximize:
            grads = torch._foreach_mul(grads, each("sign"))
        if self.decay:
            grads = torch._foreach_addcmul(grads, params, each("weight_decay"))
        if self.momentum:
            torch._foreach_mul_(bufs, each_or_shared("momentum"))
            one_minus_dampening = each_or_shared("one_minus_dampening")
            if isinstance(one_minus_dampening, list):
                torch._foreach_addcmul_(bufs, grads, one_minus_dampening)
            else:
                torch._foreach_add_(bufs, grads, alpha=one_minus_dampening)
            grads = torch._foreach_addcmul(grads, bufs, each("momentum")) \
                if self.nesterov else bufs
        torch._foreach_addcmul_(params, grads, each("neg_lr"))


class SGD(FusedOptimizer):
    """Stochastic gradient descent, optionally with momentum, for N fused models.

    The arguments are ``torch.optim.SGD``'s; each hyper-parameter is one shared
    value or a sequence of N values (one per model)::

        opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.03, 0.01],
                             momentum=[0.0, 0.9, 0.9], nesterov=[False, False, True])

    Model i then trains exactly as ``torch.optim.SGD(model_i.parameters(), lr=lr[i],
    momentum=momentum[i], nesterov=nesterov[i])`` would.

    State per stacked parameter (only if some model has a momentum):
    ``momentum_buffer`` ``[N, *shape]`` and ``has_momentum_buffer`` ``[N]`` (0/1;
    stock SGD starts a model's buffer as a copy of its first gradient).

    ``fused=True`` takes torch's fused SGD kernel, one call per model over that model's
    slices of every parameter: ``torch.optim.SGD(fused=True)`` for each model bit for
    bit, which differs from the default update by a rounding once there is a momentum.
    The default (``fused=None`` or ``False``) repeats stock's default update, one op
    for all N models, and matches it bit for bit on the CPU.  ``foreach`` is accepted
    and kept in ``param_groups`` but changes nothing: on the CPU stock's foreach and
    for-loop updates give the same values bit for bit (torch 2.13), which hftc's
    equal.  On CUDA (without ``fused=True``) the step is capturable in a CUDA graph: see
    ``_capturable`` and ``refresh_hyperparameters``.  ``differentiable=True`` raises
    ``FusionArgumentError`` (the step runs under ``torch.no_grad()``), as does
    ``fused=True`` with ``foreach=True`` (torch refuses it too).
    """

    _stock = torch.optim.SGD
    _hyperparameters = {
        "lr": "float", "momentum": "float", "dampening": "float",
        "weight_decay": "float", "nesterov": "flag", "maximize": "flag",
    }
    _flags = {"foreach": None, "differentiable": False, "fused": False}
    _capturable_supported = True

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None,
                 num_models: int | None = None):
        super().__init__(params, num_models, {
            "lr": lr, "momentum": momentum, "dampening": dampening,
            "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
        }, {"foreach": foreach, "differentiable": differentiable, "fused": fused})

    def _check_hyperparameters(self, hp: dict[str, Any], model: int) -> None:
        super()._check_hyperparameters(hp, model)
        if hp["nesterov"] and (hp["momentum"] <= 0 or hp["dampening"] != 0):
            raise FusionArgumentError(
                f"Nesterov momentum requires a momentum and zero dampening (model {model}: "
                f"momentum={hp['momentum']}, dampening={hp['dampening']})"
            )

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        if any(m != 0 for m in hp["momentum"]):
            state = self.state[p]
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["has_momentum_buffer"] = torch.zeros(
                self.num_models, dtype=p.dtype, device=p.device)

    def _import_model_state(self, p: Tensor, model: int, stock_state: dict[str, Any]) -> None:
        buf = stock_state.get("momentum_buffer")
        if buf is not None:
            if "momentum_buffer" not in self.state[p]:
                raise FusionArgumentError(
                    f"SGD: the stock optimizer of model {model} has a momentum buffer, but "
                    f"no model has a momentum"
                )
            copy_model_state(self.state[p]["momentum_buffer"][model], buf,
                             getattr(p, "_hftc_width_blocks", 1))
            self.state[p]["has_momentum_buffer"][model] = 1

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        params = self._fused_kernel_first(params, hp)
        if not params:
            return
        maximize, nesterov = hp["maximize"], hp["nesterov"]
        active = [m != 0 for m in hp["momentum"]]
        any_decay = any(w != 0 for w in hp["weight_decay"])
        coef = self._coefficients(self._coefficient_rows(hp))
        # The common step (every model with a momentum buffer, or none with a momentum;
        # nesterov for all or none) runs as stock's ops on many parameters at once or in
        # blocks; the rest (first steps, models that differ in momentum or nesterov) op
        # by op with masks (_momentum_direction).
        common = _SGDStep(coef, any(maximize), any_decay, all(active), all(nesterov))
        uniform = all(active) and (all(nesterov) or not any(nesterov)) or not any(active)
        # Parameters whose N momentum buffers all exist, known without reading
        # has_momentum_buffer on the host (a sync on CUDA, which a capturable step may
        # not make): a step with every model's momentum on sets them all, and only
        # load_state_dict and skip_models can unset them (they forget this set).
        ready = self.__dict__.setdefault("_momentum_ready", set())
        capturable = self._capturable()
        together, blocked = [], []
        for p in params:
            if any(active) and "momentum_buffer" not in self.state[p]:
                self._init_state(p, {"momentum": [1.0]})  # a scheduler turned momentum on
            if any(active) and uniform and id(p) not in ready and not capturable and bool(
                    self.state[p]["has_momentum_buffer"].all()):
                ready.add(id(p))
            if not uniform or any(active) and id(p) not in ready:
                self._update_masked(p, coef, maximize, any_decay, active, nesterov)
                if all(active):
                    ready.add(id(p))
            elif p.device.type == "cpu" and p.numel() > _FOREACH_MAX_NUMEL and \
                    self._dense(p):
                blocked.append(p)
            else:
                together.append(p)
        if together:
            common.foreach(together, [self.state[p].get("momentum_buffer") for p in together])
        for p in blocked:
            tensors = [p, p.grad] + ([self.state[p]["momentum_buffer"]] if all(active) else [])
            if p.numel() // self.num_models >= _ROW_MIN_NUMEL:
                self._update_rows(tensors, coef, common)
                continue
            for block, scratch in self._column_blocks(tensors, 1, _BLOCK_NUMEL):
                common.one(*block[:2], block[2] if len(block) > 2 else None, scratch[0])

    def _update_rows(self, tensors: list[Tensor], coef: Coefficients, common: _SGDStep
                     ) -> None:
        """Stock's single-tensor update on ``[p, grad(, momentum_buffer)]`` (contiguous, on
        the CPU), one by one in pieces of each row (:meth:`_row_chunks`)::

            for i in models:  for piece in row i:
                g = -grad if maximize_i;  g = g.add(p, alpha=wd_i) if wd_i != 0
                buf.mul_(m_i).add_(g, alpha=1 - dampening_i);  g = g.add(buf, alpha=m_i) if nesterov
                p.add_(g, alpha=-lr_i)

        (``common``'s step, each model's values as Python scalars: a model without
        weight decay adds none.)  The piece's gradient temporary lives in one small
        scratch buffer that stays in cache."""
        n = self.num_models
        row_sizes, pieces = self._row_chunks(tensors, _BLOCK_NUMEL)
        scratch = self._row_scratch(tensors[0], row_sizes[0], 1)[0]
        scratch_of = {size: scratch[:size] for size in set(row_sizes)}
        sign, weight_decay, neg_lr = (coef.row(name) for name in ("sign", "weight_decay", "neg_lr"))
        one_minus_dampening = coef.row("one_minus_dampening")
        momentum = coef.row("momentum")
        # mul_'s operand as a 0-dim tensor made once per step (alpha= takes Python floats)
        factors = self._row_scalars(tensors[0].dtype, [momentum])
        k = 0
        for i in range(n):
            maximize, wd, lr_i = sign[i] < 0, weight_decay[i], neg_lr[i]
            for size in row_sizes:
                p, grad = pieces[0][k], pieces[1][k]
                out = scratch_of[size]
                if maximize:
                    grad = torch.neg(grad, out=out)
                if wd != 0:
                    grad = torch.add(grad, p, alpha=wd, out=out)
                if common.momentum:
                    buf = pieces[2][k]
                    buf.mul_(factors[i][0]).add_(grad, alpha=one_minus_dampening[i])
                    grad = torch.add(grad, buf, alpha=momentum[i], out=out) \
                        if common.nesterov else buf
                p.add_(grad, alpha=lr_i)
                k += 1

    def _coefficient_rows(self, hp: dict[str, list[Any]]) -> dict[str, list[float]]:
        return {
            "neg_lr": [-lr for lr in hp["lr"]],
            "sign": [-1.0 if m else 1.0 for m in hp["maximize"]],
            "weight_decay": hp["weight_decay"],
            "momentum": hp["momentum"],
            "one_minus_dampening": [1 - d for d in hp["dampening"]],
            "active": [m != 0 for m in hp["momentum"]],
            "nesterov": hp["nesterov"],
        }

    def _capturable(self) -> bool:
        """Stock SGD has no ``capturable`` flag: its step keeps no step count and is
        graph-safe on CUDA as it is.  hftc's is on CUDA (without ``fused=True``): the
        per-model values are tensors refreshed in place and no step reads a device value
        on the host (the first-step test of the momentum buffers is a mask)."""
        params = self.param_groups[0]["params"]
        return bool(params) and all(p.is_cuda for p in params) and not self._flag("fused")

    def _update_masked(self, p: Tensor, coef: Coefficients, maximize: list[bool],
                       any_decay: bool, active: list[bool], nesterov: list[bool]) -> None:
        grad = p.grad
        if any(maximize):
            grad = grad * coef("sign", p)
        if any_decay:
            # grad.add(p, alpha=wd); a model with wd = 0 gets grad + p*0 == grad.
            grad = torch.addcmul(grad, p, coef("weight_decay", p))
        if any(active):
            grad = self._momentum_direction(p, grad, coef, active, nesterov)
        p.addcmul_(grad, coef("neg_lr", p))

    def _momentum_direction(self, p: Tensor, grad: Tensor, coef: Coefficients,
                            active: list[bool], nesterov: list[bool]) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:  # a scheduler turned momentum on
            self._init_state(p, {"momentum": [1.0]})
        buf, has_buf = state["momentum_buffer"], state["has_momentum_buffer"]
        momentum = coef("momentum", p)
        ready = (has_buf != 0).view(momentum.shape)
        # Stock: the first step sets buf = grad, later ones buf = m*buf + (1-d)*grad.
        # With m -> 0 and 1-d -> 1 for models without a buffer yet (theirs is all
        # zeros), one formula does both: 0*0 + grad*1 == grad exactly.
        m_eff = torch.where(ready, momentum, 0.0)
        a_eff = torch.where(ready, coef("one_minus_dampening", p), 1.0)
        if all(active):
            buf.mul_(m_eff).addcmul_(grad, a_eff)
            has_buf.fill_(1)
        else:
            # A model whose momentum is 0 leaves its buffer alone and steps along grad.
            act = coef.mask("active", p)
            buf.copy_(torch.where(act, (buf * m_eff).addcmul_(grad, a_eff), buf))
            has_buf.copy_(torch.where(act.view(-1), 1.0, has_buf))
        if all(nesterov):
            direction = torch.addcmul(grad, buf, momentum)
        elif any(nesterov):
            direction = torch.where(coef.mask("nesterov", p),
                                    torch.addcmul(grad, buf, momentum), buf)
        else:
            direction = buf
        if not all(active):
            direction = torch.where(coef.mask("active", p), direction, grad)
        return direction

    # ------------------------------------------------------------------ fused=True

    def _dense(self, p: Tensor) -> bool:
        buf = self.state[p].get("momentum_buffer")
        return all(t is None or t.is_contiguous() for t in (p, p.grad, buf))

    def _update_fused(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        """torch's fused SGD kernel, one call per model over its slices of ``params``:
        what ``torch.optim.SGD(fused=True)`` runs for that model alone."""
        if not params:
            return
        momentum = hp["momentum"]
        active = [m != 0 for m in momentum]
        if any(active):
            for p in params:
                if "momentum_buffer" not in self.state[p]:  # a scheduler turned it on
                    self._init_state(p, {"momentum": [1.0]})
            ready = [self.state[p]["has_momentum_buffer"].tolist() for p in params]
        for i in range(self.num_models):
            kwargs = dict(weight_decay=hp["weight_decay"][i], momentum=momentum[i],
                          lr=hp["lr"][i], dampening=hp["dampening"][i],
                          nesterov=hp["nesterov"][i], maximize=hp["maximize"][i])
            if not active[i]:
                torch._fused_sgd_([p[i] for p in params], [p.grad[i] for p in params], [],
                                  is_first_step=False, **kwargs)
                continue
            # Stock's first step (no buffers yet) sets buf = grad; later ones m*buf + ...
            for first in (True, False):
                group = [p for p, r in zip(params, ready) if (r[i] == 0) is first]
                if group:
                    torch._fused_sgd_([p[i] for p in group], [p.grad[i] for p in group],
                                      [self.state[p]["momentum_buffer"][i] for p in group],
                                      is_first_step=first, **kwargs)
        if any(active):
            for p in params:
                has_buf = self.state[p]["has_momentum_buffer"]
                if all(active):
                    has_buf.fill_(1)
                else:
                    has_buf[[i for i, a in enumerate(active) if a]] = 1
