"""Fused L-BFGS: one stock ``torch.optim.LBFGS`` per model, their closure calls shared.

L-BFGS is not elementwise: its direction, step size, line search and stopping tests
reduce over all of a model's parameters, and each model's line search asks for the
loss at points of its own, a different number of times.  So each model gets its own
stock ``torch.optim.LBFGS`` over its slices of the stacked parameters (views, so its
steps write into them), stepped in its own thread; whenever each model still stepping
waits in its closure (or has finished), one call of the user's closure evaluates all
N models at once and hands each its own loss and gradient::

    round 1:   model 0 asks f(x0)      model 1 asks f(x1)      -> one closure call
    round 2:   model 0 asks f(x0+t d)  model 1 done            -> one closure call
    ...                                                           (model 1 left as it was)

The arithmetic is stock's own code on each model's own numbers, so model i trains as
``torch.optim.LBFGS(model_i.parameters())`` does, given equal gradients.  A model that
is not evaluating in a round (done) is evaluated anyway, at its unchanged parameters:
its stacked buffers (batch-norm statistics) are put back after that call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..errors import FusionArgumentError, FusionNotImplementedError, FusionTypeError, user_line
from ..lowering.runtime.modules import FUSED_MODULES

__all__ = ["LBFGS"]

_HYPERPARAMETERS = ("lr", "max_iter", "max_eval", "tolerance_grad", "tolerance_change",
                    "history_size", "line_search_fn")


class _Failed:
    """Sent to a waiting model's closure when the shared closure call raised."""


class LBFGS(Optimizer):
    """L-BFGS for N fused models: ``torch.optim.LBFGS``'s arguments, in its order, each
    one shared value or a sequence of N (``param_groups[i]`` is model i's, as in every
    ``hftc.optim`` class)::

        opt = hftc.optim.LBFGS(fused.parameters(), lr=1, line_search_fn="strong_wolfe")
        loss_fn = hftc.per_model(F.cross_entropy)

        def closure():
            opt.zero_grad()
            losses = loss_fn(fused(x), y)        # [N]: one loss per model
            losses.sum().backward()
            return losses

        opt.step(closure)                        # -> the N losses of the first call

    The closure must return the N per-model losses (a scalar sum would give every
    model the others' losses in its line search and stopping tests, and is refused).
    Each model runs stock ``torch.optim.LBFGS`` on its own slices (see the module's
    docstring), with one line search, history and stopping test per model, and trains
    as it would alone; a step calls the closure as often as the model that needs most
    evaluations calls it alone.
    """

    def __init__(self, params, lr=1, max_iter=20, max_eval=None, tolerance_grad=1e-7,
                 tolerance_change=1e-9, history_size=100, line_search_fn=None, *,
                 num_models: int | None = None):
        if isinstance(params, torch.nn.Module):
            num_models = num_models if num_models is not None else getattr(
                params, "num_models", None)
            params = params.parameters()
        if isinstance(params, Tensor):
            raise FusionTypeError(
                "LBFGS takes an iterable of stacked parameters "
                "(fused.parameters()), got a single Tensor")
        tensors = list(params)
        if not tensors or not all(isinstance(p, Tensor) for p in tensors):
            raise FusionArgumentError(
                "hftc.optim.LBFGS takes the stacked parameters of a fused module "
                "(fused.parameters()); got no tensors, or param-group dicts (one group "
                "per model, as torch.optim.LBFGS takes one group)")
        leading = {p.shape[0] if p.dim() else None for p in tensors}
        if None in leading or len(leading) != 1:
            raise FusionArgumentError(
                f"hftc.optim.LBFGS: fused parameters are stacked [N, *shape] with one N; got "
                f"shapes {[list(p.shape) for p in tensors]}")
        n = leading.pop()
        if num_models is not None and num_models != n:
            raise FusionArgumentError(
                f"hftc.optim.LBFGS: num_models={num_models}, but the parameters are stacked "
                f"for {n} models (their leading dim)")
        given = dict(lr=lr, max_iter=max_iter, max_eval=max_eval,
                     tolerance_grad=tolerance_grad, tolerance_change=tolerance_change,
                     history_size=history_size, line_search_fn=line_search_fn)
        per_model = {key: self._expand(key, value, n) for key, value in given.items()}
        groups = []
        for i in range(n):
            # Stock's checks and its max_eval default, one by one.
            probe = torch.optim.LBFGS([torch.zeros(1, dtype=tensors[0].dtype)],
                                      **{k: v[i] for k, v in per_model.items()})
            values = {k: probe.param_groups[0][k] for k in _HYPERPARAMETERS}
            groups.append({"params": tensors if i == 0 else [], **values})
        super().__init__(groups, {k: groups[0][k] for k in _HYPERPARAMETERS})
        self._models: list[torch.optim.LBFGS] = []
        self._views: list[list[Tensor]] = []

    @staticmethod
    def _expand(key: str, value: Any, n: int) -> list[Any]:
        if isinstance(value, (list, tuple)) or (isinstance(value, Tensor) and value.dim() == 1):
            if len(value) != n:
                raise FusionArgumentError(
                    f"hftc.optim.LBFGS: {key} has {len(value)} values but there are {n} "
                    f"models; give one value per model or one shared value")
            return list(value)
        return [value] * n

    @property
    def num_models(self) -> int:
        """N, the number of fused models (one param group each)."""
        return len(self.param_groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_models", None) is not None:
            raise FusionNotImplementedError(
                f"hftc.optim.LBFGS.add_param_group{user_line()}: param_groups[i] is model "
                f"i's hyper-parameters, so groups cannot be added; make a new one over all "
                f"the stacked parameters (hftc.optim.LBFGS(fused.parameters(), ...))")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ per-model optimizers

    def _model_optimizers(self) -> list[torch.optim.LBFGS]:
        """The N stock optimizers over views ``p[i]`` of the stacked parameters, rebuilt
        around the same state where a parameter's storage moved (``.to()``, ``.data =``)."""
        params = self.param_groups[0]["params"]
        views = [[p.detach()[i] for p in params] for i in range(self.num_models)]
        if not self._models:
            for i, model_views in enumerate(views):
                hp = {k: self.param_groups[i][k] for k in _HYPERPARAMETERS}
                self._models.append(torch.optim.LBFGS(model_views, **hp))
        elif any(not _same_view(a, b) for old, new in zip(self._views, views)
                 for a, b in zip(old, new)):
            for opt, old, new in zip(self._models, self._views, views):
                old = list(old)
                state = opt.state.pop(old[0], None)
                opt.param_groups[0]["params"][:] = new
                if state is not None:
                    opt.state[new[0]] = state
        # The views the stock optimizers hold: step hands each model's gradients to these.
        self._views = [opt.param_groups[0]["params"] for opt in self._models]
        for i, opt in enumerate(self._models):  # a scheduler may have set model i's group
            opt.param_groups[0].update({k: self.param_groups[i][k] for k in _HYPERPARAMETERS})
        return self._models

    def _stacked_buffers(self) -> list[Tensor]:
        """The buffers of the fused modules these parameters belong to."""
        mine = {id(p) for p in self.param_groups[0]["params"]}
        return [b for module in list(FUSED_MODULES)
                if any(id(p) in mine for p in module.parameters())
                for b in module.buffers()]

    # ------------------------------------------------------------------ step

    def step(self, closure: Callable[[], Tensor]) -> Tensor:  # type: ignore[override]
        """One stock L-BFGS step per model; returns the N losses of the closure's first call."""
        if closure is None:
            raise FusionArgumentError(
                "hftc.optim.LBFGS.step needs a closure that returns "
                "the N per-model losses, as torch.optim.LBFGS needs one")
        n = self.num_models
        models = self._model_optimizers()
        params = self.param_groups[0]["params"]
        views = self._views
        inbox: queue.Queue = queue.Queue()
        replies = [queue.Queue() for _ in range(n)]

        def model_closure(i: int) -> Callable[[], float]:
            def evaluate() -> float:
                inbox.put(("evaluate", i, None))
                reply = replies[i].get()
                if reply is _Failed:
                    raise _Abort
                return reply
            return evaluate

        def run(i: int) -> None:
            try:
                models[i].step(model_closure(i))
                inbox.put(("done", i, None))
            except _Abort:
                inbox.put(("done", i, None))
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                inbox.put(("failed", i, error))

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        active, first, failure = set(range(n)), None, None
        buffers = self._stacked_buffers()
        try:
            while active:
                asking = []
                for _ in range(len(active)):
                    what, i, error = inbox.get()
                    if what == "evaluate":
                        asking.append(i)
                    else:
                        active.discard(i)
                        if what == "failed" and failure is None:
                            failure = error
                if not asking:
                    continue
                if failure is not None:
                    for i in asking:
                        replies[i].put(_Failed)
                    continue
                try:
                    losses = self._evaluate(closure, n, params, buffers, asking)
                except BaseException as error:  # noqa: BLE001 - re-raised below, threads ended
                    failure = error
                    for i in asking:
                        replies[i].put(_Failed)
                    continue
                if first is None:
                    first = losses
                for i in asking:
                    for view, p in zip(views[i], params):
                        view.grad = None if p.grad is None else p.grad[i]
                    replies[i].put(float(losses[i]))
        finally:
            # Interrupted while models wait (KeyboardInterrupt): end their steps, not hang.
            for i in active:
                replies[i].put(_Failed)
            for t in threads:
                t.join()
        if failure is not None:
            raise failure
        return first

    def _evaluate(self, closure: Callable[[], Tensor], n: int, params: list[Tensor],
                  buffers: list[Tensor], asking: list[int]) -> Tensor:
        """One call of the user's closure, the models not ``asking`` kept as they were."""
        idle = [i for i in range(n) if i not in asking]
        saved = [(b, b.detach().clone()) for b in buffers] if idle else []
        with torch.enable_grad():
            losses = closure()
        if not isinstance(losses, Tensor) or losses.numel() != n:
            got = (f"a tensor of shape {list(losses.shape)}" if isinstance(losses, Tensor)
                   else type(losses).__name__)
            raise FusionArgumentError(
                f"hftc.optim.LBFGS: the closure returned {got}; it must return the {n} "
                f"per-model losses (hftc.per_model(loss_fn)(out, target), whose .sum() it "
                f"backpropagates): each model's line search and stopping tests read its own "
                f"loss")
        for b, before in saved:
            if b.dim() > 0 and b.shape[0] == n:
                b.data[idle] = before[idle]
            elif not torch.equal(b, before):
                raise FusionArgumentError(
                    f"hftc.optim.LBFGS: the closure changed a buffer of shape "
                    f"{list(b.shape)} that is not stacked per model, while model(s) {idle} "
                    f"had finished their step; run torch.optim.LBFGS on each of "
                    f"fused.unfuse()'s models")
        return losses.detach().reshape(n)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """torch's (hyper-parameters per model), and under ``"hftc"`` each model's stock
        LBFGS state (history, direction, counters)."""
        saved = super().state_dict()
        saved["hftc"] = {"num_models": self.num_models,
                         "models": [opt.state_dict()["state"] for opt in self._models]}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get("hftc")
        if extra is None or extra.get("num_models") != self.num_models:
            raise FusionArgumentError(
                f"hftc.optim.LBFGS.load_state_dict: not the state dict of an "
                f"hftc.optim.LBFGS over {self.num_models} models")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "hftc"})
        self._models, self._views = [], []
        models = self._model_optimizers()
        for opt, state in zip(models, extra["models"]):
            opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


class _Abort(Exception):
    """Ends a model's stock step when the shared closure call failed."""


def _same_view(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()

