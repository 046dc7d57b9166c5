"""The whole training step of N fused models as one callable: ``hftc.compile_step``.

::

    step = hftc.compile_step(fused, F.cross_entropy, opt)    # loss_fn(out_i, y) per model
    losses = step(x, y)                                       # [N], detached

One call does what this eager loop does, for all N models at once::

    opt.zero_grad(set_to_none=True)
    losses = hftc.per_model(loss_fn)(fused(x), y)      # [N]: model i's loss
    losses.sum().backward()                            # model i's gradient, its own only
    hftc.utils.clip_grad_norm_(fused, max_norm)        # if clip_grad_norm= is given
    opt.step()
    return losses.detach()

and runs it one of three ways (``mode``):

- ``"eager"``: the loop above (the CPU default: :data:`CPU_DEFAULT`, measured in
  docs/BENCHMARKS.md), or the same step with the models one by one (forward, loss and
  backward each), where the fused module runs them one by one
  (:meth:`CompiledStep._step_way`; ``step.order`` says which, and why)::

      for i in range(N):   loss_fn(model_i(x), y).backward()     (the serial loop's order)
      clip_grad_norm_;  optimizer.step()                          (one fused step)

  The loop above runs every forward before any backward, as any module called from a
  training loop must (the loss exists only after the forward); one by one, each
  model's activations are still in the cache when its backward reads them, and each
  model's gradient is the serial loop's, bit for bit;
- ``"compile"``: forward and loss under ``torch.compile`` (backward through AOTAutograd's
  compiled graph), clipping and the optimizer step eager (they already run one kernel per
  op for all N models, and compiling them cannot match stock bit for bit on the CPU: see
  ``FusedOptimizer.step``);
- ``"cuda_graph"`` (the CUDA default): forward, loss and backward captured in one CUDA graph
  per input signature and replayed; the inputs are copied into the graph's static buffers
  first.  The optimizer step (with the clipping) is captured too when the optimizer says it
  can be (``optimizer.is_capturable``: an ``hftc.optim`` optimizer made with
  ``capturable=True``; its ``refresh_hyperparameters()``, called before every replay, writes
  its per-model hyper-parameters and step counts into the device tensors the graph reads);
  otherwise it runs eagerly after the replay, reading ``param_groups`` as always, so every
  ``lr_scheduler`` and per-model value applies either way.

Each new input signature (shapes, dtypes, the non-tensor arguments, train/eval mode) first
runs ``warmup`` eager steps (more while the fused module's default strategy is still timing
its first calls; real steps: the fused module compiles its program on the first,
the optimizer creates its state; on CUDA they run on a side stream, as capture needs), the
second of them watched for what a graph cannot hold (:class:`_CaptureHazards`); the next
call captures (or compiles).  A step that cannot be captured is refused with a
:class:`~hftc.errors.StepCaptureError` that names the op and the line, never run wrong.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import FusionArgumentError, StepCaptureError
from ..lowering.runtime.memory import keep_freed_memory_for_tuning
from ..lowering.strategy import ONE_BY_ONE, StepOrder

__all__ = ["CompiledStep", "compile_step", "CPU_DEFAULT", "MODES"]

MODES = ("auto", "eager", "compile", "cuda_graph")

#: What ``mode="auto"`` runs on the CPU.  Eager: torch.compile of forward + loss lost to
#: the eager step on lenet5 and the transformer and tied on the MLP (docs/BENCHMARKS.md,
#: "hftc.compile_step on the CPU"), and costs seconds of compiling per input shape.
CPU_DEFAULT = "eager"

#: At most this many input signatures get a graph (or a compiled program) each; a step
#: whose inputs keep changing shape is refused past it (pad them, or drop the last batch).
MAX_SIGNATURES = 8


def compile_step(fused: nn.Module, loss_fn: Callable[..., Tensor],
                 optimizer: torch.optim.Optimizer, *, mode: str = "auto",
                 per_model_loss: bool = True, clip_grad_norm: float | Sequence[float] | None = None,
                 scaler: Any = None, autocast_dtype: torch.dtype | None = None,
                 warmup: int = 2) -> CompiledStep:
    """One training step of N fused models (forward, per-model loss, backward, optimizer
    step) as one callable: ``losses = step(x, y)``, the N losses ``[N]``, detached.

    Same numbers as the eager loop (see the module docstring): bit for bit in ``"eager"``
    and ``"cuda_graph"`` mode (the same kernels run), within float tolerance in
    ``"compile"`` mode (inductor reorders sums); and so the same as N separate models with
    N stock optimizers, as the eager fused step is.

    Args:
        fused: the fused module (``hftc.fuse(models)``).
        loss_fn: ``loss_fn(out_i, target)``, one model's loss (``F.cross_entropy``); with
            ``per_model_loss=False``, ``loss_fn(fused_out, target)`` returning the ``[N]``
            losses itself (an ``hftc.per_model(...)`` with its own ``in_dims``). An
            ``hftc.per_model(loss)`` given with ``per_model_loss=True`` is taken as it is.
        optimizer: the optimizer of ``fused``'s parameters (``hftc.optim.Adam(fused.
            parameters(), lr=[...])``, one param group per model).
        mode: ``"auto"`` (``"cuda_graph"`` on CUDA, :data:`CPU_DEFAULT` on the CPU),
            ``"eager"``, ``"compile"`` or ``"cuda_graph"``.
        clip_grad_norm: clip each model's gradients by its own norm before the step
            (one max norm, or one per model), as ``hftc.utils.clip_grad_norm_``.
        scaler: an ``hftc.amp.GradScaler`` (per-model loss scales).  In
            ``"cuda_graph"`` mode only with a capturable optimizer
            (``optimizer.is_capturable``): the graph then holds the scaled backward,
            unscaling, the step that skips the models that overflowed (``torch.where``,
            no host read) and the scales' update.
        autocast_dtype: run forward and loss under ``torch.autocast`` in this dtype
            (``torch.bfloat16``); the way to use autocast in ``"cuda_graph"`` mode.
        warmup: eager steps per new input signature before capturing or compiling (>= 2).

    Returns:
        A :class:`CompiledStep`; ``step(inputs, target)`` calls ``fused(inputs)`` (or
        ``fused(*inputs)`` for a tuple) and ``loss_fn(..., target)``.

    Raises:
        FusionArgumentError: a bad argument (unknown mode, ``"cuda_graph"`` on the CPU, a
            scaler with ``"cuda_graph"`` and an optimizer that is not capturable, a loss
            that is not ``[N]``).
        StepCaptureError: (on a call) the step cannot be captured or compiled: a host sync
            (``.item()``), a shape that depends on the data, a copy from host memory.
    """
    return CompiledStep(fused, loss_fn, optimizer, mode=mode, per_model_loss=per_model_loss,
                        clip_grad_norm=clip_grad_norm, scaler=scaler,
                        autocast_dtype=autocast_dtype, warmup=warmup)


def _device_of(fused: nn.Module) -> torch.device:
    tensor = next(iter(fused.parameters()), None)
    if tensor is None:
        tensor = next(iter(fused.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class CompiledStep:
    """``step(inputs, target) -> losses [N]``: see :func:`compile_step`.

    ``mode`` is the mode it runs (``"auto"`` resolved); ``graphs`` the number of CUDA graphs
    captured (one per input signature).  After a call, each parameter's ``.grad`` holds
    that step's gradients (clipped, if asked), as after the eager loop.
    """

    def __init__(self, fused: nn.Module, loss_fn: Callable[..., Tensor],
                 optimizer: torch.optim.Optimizer, *, mode: str = "auto",
                 per_model_loss: bool = True, clip_grad_norm: Any = None, scaler: Any = None,
                 autocast_dtype: torch.dtype | None = None, warmup: int = 2):
        from ..lowering.runtime.losses import PER_MODEL_MARK, per_model

        if mode not in MODES:
            raise FusionArgumentError(f"compile_step: mode must be one of {MODES}, got {mode!r}")
        num_models = getattr(fused, "num_models", None)
        if num_models is None:
            raise FusionArgumentError(
                f"compile_step takes a fused module (hftc.fuse(models)), got "
                f"{type(fused).__name__}")
        if not callable(loss_fn):
            raise FusionArgumentError(f"compile_step: loss_fn must be callable, got {loss_fn!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise FusionArgumentError(
                f"compile_step: optimizer must be a torch.optim.Optimizer over the fused "
                f"module's parameters (hftc.optim.Adam(fused.parameters(), lr=[...])), got "
                f"{type(optimizer).__name__}")
        if warmup < 2:
            raise FusionArgumentError(
                f"compile_step: warmup must be at least 2 (the first step compiles the fused "
                f"program and creates the optimizer's state; the second is checked for what "
                f"a graph cannot hold), got {warmup}")
        device = _device_of(fused)
        if mode == "auto":
            mode = "cuda_graph" if device.type == "cuda" else CPU_DEFAULT
        if mode == "cuda_graph" and device.type != "cuda":
            raise FusionArgumentError(
                f"compile_step: mode='cuda_graph' needs the fused module on a CUDA device; its "
                f"parameters are on {device}. Move it (fused.to('cuda')) or use mode='eager' "
                f"or 'compile'")
        if mode == "cuda_graph" and scaler is not None and scaler.is_enabled() \
                and not getattr(optimizer, "is_capturable", False):
            raise FusionArgumentError(
                f"compile_step: hftc.amp.GradScaler runs inside a CUDA graph only with a "
                f"capturable optimizer, and {type(optimizer).__name__} is not one: its step "
                f"would read on the host which models' gradients overflowed, every step. "
                f"Construct it with capturable=True (hftc.optim.Adam/AdamW(..., "
                f"capturable=True); hftc.optim.SGD is capturable on CUDA), train in bfloat16 "
                f"(autocast_dtype=torch.bfloat16, which needs no loss scaling), or pass "
                f"mode='eager' to keep the scaler")
        self.fused, self.optimizer, self.scaler = fused, optimizer, scaler
        self.num_models, self.device, self.mode = num_models, device, mode
        #: the models it was made for (hftc.keep_models cutting the array leaves it stale)
        self._model_ids = list(getattr(fused, "model_ids", range(num_models)))
        self.loss_fn = loss_fn
        # (compile_step(fused, hftc.per_model(loss), opt): the N losses already, as given)
        wrapped = per_model_loss and PER_MODEL_MARK not in getattr(loss_fn, "__dict__", {})
        self._losses_of = per_model(loss_fn) if wrapped else loss_fn
        self.clip_grad_norm = clip_grad_norm
        self.autocast_dtype = autocast_dtype
        self.warmup = warmup
        self._calls: dict[tuple, int] = {}  # input signature -> eager steps run
        self._graphs: dict[tuple, _CapturedStep] = {}
        self._graphed_params: list[tuple[Tensor, int]] | None = None
        self._compiled: Callable[..., Tensor] | None = None
        self._side_stream = None
        self._max_norm_tensor: Tensor | None = None
        #: input signature -> the eager step's choice between the fused step and the
        #: models one by one (:meth:`_step_way`)
        self._orders: dict[tuple, Any] = {}
        self._last_key: tuple | None = None
        #: input signature -> the fused module's program its last fused step ran
        self._fused_programs: dict[tuple | None, Any] = {}

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    @property
    def order(self) -> StepOrder | None:
        """How eager steps with the last call's inputs run, and why: a
        :class:`~hftc.lowering.strategy.StepOrder` (``order.chosen``: ``"fused"`` or
        ``"in_order"``, one by one's public spelling); ``None`` before the fused module has
        chosen, in the other modes, and where only the fused step can run (see
        :meth:`_step_way`)."""
        return self._orders.get(self._last_key)

    @property
    def captures_optimizer(self) -> bool:
        """Whether the CUDA graph holds the optimizer step too (``optimizer.is_capturable``:
        it refreshes its device-side values with ``refresh_hyperparameters()``), not only
        forward, loss and backward."""
        return bool(getattr(self.optimizer, "is_capturable", False)) and callable(
            getattr(self.optimizer, "refresh_hyperparameters", None))

    # ------------------------------------------------------------------ one step

    def __call__(self, inputs: Any, target: Any) -> Tensor:
        if not torch.is_grad_enabled():
            raise FusionArgumentError(
                "compile_step: the step was called under torch.no_grad(); it runs backward. "
                "Call it with gradients enabled (evaluate with fused(x) instead)")
        if getattr(self.fused, "num_models", self.num_models) != self.num_models:
            self._refuse_cut_array()
        key = self._signature(inputs, target)
        done = self._calls.get(key, 0)
        if done < self.warmup or self.mode == "eager" or self._still_choosing():
            if key not in self._calls and len(self._calls) >= MAX_SIGNATURES \
                    and self.mode != "eager":
                raise StepCaptureError(
                    f"compile_step: the step's inputs have had {len(self._calls)} different "
                    f"shapes (or dtypes, or non-tensor arguments), each of which needs its own "
                    f"{'CUDA graph' if self.mode == 'cuda_graph' else 'compiled program'}; "
                    f"this call brings another: {_describe(key)}. Give the step inputs of "
                    f"fixed shape (pad them; DataLoader(drop_last=True) for a smaller last "
                    f"batch), or use mode='eager'")
            self._calls[key] = done + 1
            watched = self.mode != "eager" and done == 1
            return self._eager_step(inputs, target, watched=watched, key=key)
        if self.mode == "compile":
            return self._compiled_step(inputs, target)
        return self._graph_step(key, inputs, target)

    def _refuse_cut_array(self) -> None:
        """The fused module lost models since (``hftc.keep_models``, ``hftc.EarlyStopping``):
        the step's per-model values, programs and graphs are the N models'."""
        raise FusionArgumentError(
            f"compile_step: this step was made for models {self._model_ids} of the fused "
            f"module, which now holds models {self.fused.model_ids} (hftc.keep_models or "
            f"hftc.EarlyStopping cut it); its per-model values, programs and graphs are "
            f"the old array's. Make the step again for the models kept: "
            f"step = hftc.compile_step(fused, loss_fn, optimizer, ...) (a clip_grad_norm "
            f"or GradScaler per model, for the models kept)")

    def _still_choosing(self) -> bool:
        """Whether the fused module is still timing its first calls (``strategy="timed"``
        alternates the fused program and the models one by one): a graph captured now
        would replay whichever way ran at capture, so the real steps stay eager until the
        choice is made (:mod:`hftc.lowering.strategy`)."""
        if self.mode != "cuda_graph":
            return False
        try:
            return getattr(self.fused.last_program(), "trial", None) is not None
        except Exception:  # noqa: BLE001 - not called yet: nothing is being timed
            return False

    def _signature(self, inputs: Any, target: Any) -> tuple:
        """What a graph or compiled program is specific to: each tensor's shape, dtype,
        device; each other argument's value; train or eval mode; autocast."""
        if isinstance(inputs, Tensor) and isinstance(target, Tensor):  # (most steps: no
            spec, leaves = _TENSOR_PAIR, (inputs, target)             # pytree flatten)
        else:
            flat, tree = pytree.tree_flatten((inputs, target))
            spec, leaves = repr(tree), flat
        return (spec, tuple(_leaf_signature(x) for x in leaves), self.fused.training,
                torch.is_autocast_enabled(self.device.type))

    def _autocast(self, cache_enabled: bool = True) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype,
                              cache_enabled=cache_enabled)

    def _forward_losses(self, inputs: Any, target: Any) -> Tensor:
        """The N losses ``[N]`` of the fused forward on ``inputs``."""
        out = self.fused(*inputs) if isinstance(inputs, (tuple, list)) else self.fused(inputs)
        return self._losses_of(out, target)

    def _check_losses(self, losses: Any) -> Tensor:
        if not isinstance(losses, Tensor) or losses.shape != (self.num_models,):
            self._refuse_losses(f"shape {list(losses.shape)}" if isinstance(losses, Tensor)
                                else type(losses).__name__)
        return losses

    def _refuse_losses(self, got: str) -> None:
        name = getattr(self.loss_fn, "__name__", repr(self.loss_fn))
        fix = ("a loss of one model's output, reduced to a scalar (reduction='mean' or "
               "'sum')" if self._losses_of is not self.loss_fn else
               "the N losses [N] (hftc.per_model(loss)), or pass per_model_loss=True "
               "with a loss of one model's output")
        raise FusionArgumentError(
            f"compile_step: the loss {name} gave {got} for the {self.num_models} fused "
            f"models, not one loss per model ([{self.num_models}]); give {fix}")

    def _backward_and_update(self, losses: Tensor) -> None:
        """Backward of the N losses' sum (each model its own gradient), clipping, step."""
        scaler = self.scaler if self.scaler is not None and self.scaler.is_enabled() else None
        if scaler is not None:
            scaler.scale(losses).sum().backward()
            if self.clip_grad_norm is not None:
                scaler.unscale_(self.optimizer)
        else:
            losses.sum().backward()
        self._clip_and_step(scaler)

    def _clip_and_step(self, scaler: Any = None) -> None:
        from ..utils import clip_grad_norm_

        if self.clip_grad_norm is not None:
            clip_grad_norm_(self.fused, self._max_norms())
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()

    def _step_way(self, key: tuple) -> str:
        """How an eager step with input signature ``key`` runs: ``"fused"`` (the fused
        module's forward of all N models, then one backward) or ``"in_order"`` (each
        model's forward, loss and backward in turn).

        The step runs the models one by one in ``"eager"`` mode exactly where the fused
        module runs them one by one (its strategy chose it, or forces it: the step's is the
        same one by one, in the serial loop's order); nothing is timed here (the fused
        module's choice is the one choice).  Only the fused step with ``strategy="fused"``,
        a loss of the N outputs (``per_model_loss=False``), a grad scaler, padded widths,
        checkpointing or hooks on the fused parameters: what the models one by one cannot
        run."""
        fused = self.fused
        if self.mode != "eager" or self._losses_of is self.loss_fn \
                or (self.scaler is not None and self.scaler.is_enabled()) \
                or getattr(fused, "strategy", "fused") == "fused" \
                or getattr(fused, "padding", None) is not None \
                or getattr(fused, "checkpoint", False):
            return "fused"
        choice = self._orders.get(key)
        if choice is None:  # the fused module has not run (or not chosen) for these inputs
            program = self._fused_programs.get(key)
            if program is None or getattr(program, "trial", None) is not None:
                return "fused"
            how, plan = getattr(program, "how", None), getattr(program, "plan", None)
            if any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
                   for p in fused.parameters()):
                # (each model's own leaves would take the gradients: the hooks never fire)
                choice = StepOrder("fused", "hooks on the fused parameters")
            elif fused.strategy == "model_loop" or (how is not None
                                                    and how.one_by_one is not None):
                choice = StepOrder(ONE_BY_ONE, "the fused module runs the models one by one")
            else:
                choice = StepOrder("fused", f"the fused module's choice: {plan}")
            self._orders[key] = choice
            if self.device.type == "cpu" and choice.chosen == ONE_BY_ONE:
                # each step one by one makes the N models' stacked gradients anew, which
                # glibc faulted in page by page every step (docs/DESIGN_NOTES.md)
                keep_freed_memory_for_tuning()
        return choice.chosen

    def _losses_one_by_one(self, inputs: Any, target: Any) -> Tensor:
        """Each model's forward, loss and backward in turn (:meth:`OneByOne.forward_backward
        <hftc.lowering.runtime.one_by_one.OneByOne.forward_backward>`), the forward and loss under
        the step's autocast; the N losses ``[N]``."""
        fused = self.fused
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        values, batched = fused._inputs(args, {})

        def loss_of(out: Any) -> Tensor:
            loss = self.loss_fn(out, target)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                self._refuse_losses(f"shape {list(loss.shape)} for one model"
                                    if isinstance(loss, Tensor) else type(loss).__name__)
            return loss

        return fused._models_one_by_one().forward_backward(fused, values, batched, loss_of,
                                                             context=self._autocast)

    def _eager_step(self, inputs: Any, target: Any, *, watched: bool,
                    key: tuple | None = None) -> Tensor:
        """One eager step: the fused step (:meth:`_fused_eager_step`) or, in ``"eager"``
        mode, the models one by one (:meth:`_step_way`)."""
        way = self._step_way(key) if key is not None else "fused"
        self._last_key = key
        if way == "fused":
            losses = self._fused_eager_step(inputs, target, watched=watched)
            self._fused_programs[key] = self.fused.__dict__.get("_last_call_program")
        else:
            self.optimizer.zero_grad(set_to_none=True)
            losses = self._losses_one_by_one(inputs, target)
            self._clip_and_step()
        return losses

    def _fused_eager_step(self, inputs: Any, target: Any, *, watched: bool) -> Tensor:
        stream = contextlib.nullcontext()
        if self.device.type == "cuda" and self.mode == "cuda_graph":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
            stream = torch.cuda.stream(self._side_stream)
        self._release_graph_gradients()
        with stream:
            self.optimizer.zero_grad(set_to_none=True)
            hazards = (_CaptureHazards(self.mode, self.device) if watched
                       else contextlib.nullcontext())
            with self._autocast(), hazards:
                losses = self._check_losses(self._forward_losses(inputs, target))
            self._backward_and_update(losses)
            losses = losses.detach()
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        return losses

    def _compiled_step(self, inputs: Any, target: Any) -> Tensor:
        if self._compiled is None:
            def forward_losses(inputs, target):
                with self._autocast():
                    return self._forward_losses(inputs, target)

            # fallback_random: random ops (a model's own F.dropout, run one by one) draw
            # from torch's generator as the eager step does, not inductor's own RNG.
            self._compiled = torch.compile(forward_losses, dynamic=False,
                                           options={"fallback_random": True})
        self.optimizer.zero_grad(set_to_none=True)
        losses = self._compiled(inputs, target)
        self._backward_and_update(losses)
        return losses.detach()

    def _max_norms(self) -> Any:
        """``clip_grad_norm`` as given; in a CUDA graph as a ``[N]`` tensor on the device,
        made once outside the capture (a Python value would be copied from host memory
        inside it)."""
        if self.mode != "cuda_graph":
            return self.clip_grad_norm
        if self._max_norm_tensor is None:
            values = torch.as_tensor(self.clip_grad_norm, dtype=torch.float64).reshape(-1)
            if values.numel() not in (1, self.num_models):
                raise FusionArgumentError(
                    f"compile_step: clip_grad_norm has {values.numel()} values but there are "
                    f"{self.num_models} models; give one, or one per model")
            self._max_norm_tensor = values.expand(self.num_models).to(self.device)
        return self._max_norm_tensor

    # ------------------------------------------------------------------ CUDA graphs

    def _parameters(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _release_graph_gradients(self) -> None:
        """Before an eager step: the parameters' ``.grad`` back to ``None`` if they are a
        graph's static tensors, so the eager backward does not add into them."""
        if self._graphs:
            for p in self._parameters():
                p.grad = None

    def _graph_step(self, key: tuple, inputs: Any, target: Any) -> Tensor:
        if torch.is_autocast_enabled(self.device.type):
            raise StepCaptureError(
                "compile_step: called inside torch.autocast; in mode='cuda_graph' the step "
                "runs autocast itself: pass autocast_dtype=torch.bfloat16 (or float16) to "
                "compile_step and call the step outside autocast")
        params = self._parameters()
        where = [(p, p.data_ptr()) for p in params]
        if self._graphed_params is not None and (
                len(where) != len(self._graphed_params)
                or any(p is not q or ptr != qptr
                       for (p, ptr), (q, qptr) in zip(where, self._graphed_params))):
            # A parameter was replaced (p.data = ..., load_state_dict(assign=True)): the
            # graphs read the old memory. Capture again.
            self._graphs.clear()
        self._graphed_params = where
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(inputs, target)
        for static, value in zip(graph.static_leaves, pytree.tree_leaves((inputs, target))):
            if isinstance(static, Tensor):
                static.copy_(value, non_blocking=True)
        if self.captures_optimizer:
            self.optimizer.refresh_hyperparameters()
        graph.graph.replay()
        # The graph writes its gradients into its own static tensors; the optimizer (and
        # the user, after the step) read .grad.
        for p, g in zip(params, graph.grads):
            p.grad = g
        if not self.captures_optimizer:
            self._clip_and_step()
        return graph.losses.clone()

    def _capture(self, inputs: Any, target: Any) -> _CapturedStep:
        leaves, spec = pytree.tree_flatten((inputs, target))
        static_leaves = [x.detach().clone() if isinstance(x, Tensor) else x for x in leaves]
        static_inputs, static_target = pytree.tree_unflatten(static_leaves, spec)
        params = self._parameters()
        torch.cuda.synchronize(self.device)
        self.optimizer.zero_grad(set_to_none=True)  # backward allocates .grad in the graph
        if self.captures_optimizer:  # outside the capture: the replays must not redo it
            self.optimizer.refresh_hyperparameters()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph), self._autocast(cache_enabled=False):
                losses = self._check_losses(self._forward_losses(static_inputs, static_target))
                if self.captures_optimizer:  # and the scaler's steps: its scales stay on the GPU
                    self._backward_and_update(losses)
                else:
                    losses.sum().backward()
        except StepCaptureError:
            raise
        except RuntimeError as exc:
            from ..errors import plain_message

            for p in params:
                p.grad = None
            raise StepCaptureError(
                f"compile_step: the training step could not be captured in a CUDA graph: "
                f"{plain_message(exc)}. Something in the fused forward, the loss "
                f"{getattr(self.loss_fn, '__name__', '')} or the optimizer waits for the GPU "
                f"or copies from host memory (.item(), a shape that depends on the data, "
                f"torch.tensor(...) of Python values, a CPU tensor moved to the GPU); keep "
                f"such work out of the step, or use mode='eager'") from exc
        return _CapturedStep(graph, static_leaves, losses.detach(),
                             [p.grad for p in params])


class _CapturedStep:
    """One input signature's CUDA graph and the static tensors it reads and writes."""

    def __init__(self, graph: Any, static_leaves: list[Any], losses: Tensor,
                 grads: list[Tensor | None]):
        self.graph, self.static_leaves, self.losses, self.grads = (
            graph, static_leaves, losses, grads)


#: The tree of ``(tensor, tensor)`` as :meth:`CompiledStep._signature` writes it.
_TENSOR_PAIR = repr(pytree.tree_flatten((0, 0))[1])


def _leaf_signature(x: Any) -> Any:
    if isinstance(x, Tensor):
        return ("tensor", tuple(x.shape), x.dtype, str(x.device), x.requires_grad)
    try:
        hash(x)
        return ("value", type(x).__name__, x)
    except TypeError:
        return ("value", type(x).__name__, repr(x))


def _describe(key: tuple) -> str:
    leaves = key[1]
    shapes = [list(s[1]) for s in leaves if s[0] == "tensor"]
    return f"tensor shapes {shapes}"


class _CaptureHazards(TorchDispatchMode):
    """Refuses, while one eager warm-up step's forward and loss run, the ops whose result a
    captured graph (or a compiled program without graph breaks) cannot reproduce:

    - ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``if t:``): the host reads a
      value, so a graph would keep the one it read at capture;
    - ops whose output shape depends on the data (``nonzero``, ``x[mask]``, ``unique``);
    - in ``"cuda_graph"`` mode, a copy from host memory to the GPU (``torch.tensor(...,
      device="cuda")``, ``t.cuda()``): the replay would read the host memory again, which
      by then holds something else.
    """

    def __init__(self, mode: str, device: torch.device):
        super().__init__()
        self.step_mode, self.device = mode, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self._refuse(func, "reads a tensor's value on the host (.item(), float(t), "
                               "int(t), a Python `if` on a tensor)",
                         "compute with the tensor instead (torch.where, clamp) or move the "
                         "read out of the step (log the returned losses after it)")
        if _data_dependent_shape(func, args):
            self._refuse(func, "gives a result whose shape depends on the data (nonzero, "
                               "x[mask], unique, masked_select)",
                         "keep shapes fixed: multiply by the mask or use torch.where")
        out = func(*args, **kwargs)
        if self.step_mode == "cuda_graph" and func in _COPIES:
            sources = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
            if any(s.device.type == "cpu" and s.dim() > 0 for s in sources) and any(
                    isinstance(o, Tensor) and o.device.type == "cuda"
                    for o in pytree.tree_leaves(out)):
                fix = ("create the tensor on the GPU once, outside the step (a buffer of "
                       "the model)" if _origin() not in (None, _HFTC) else
                       "give the models one value of each hyper-parameter (dropout p, a "
                       "norm's eps, an activation's slope): values that differ per model are "
                       "copied to the GPU on every call")
                self._refuse(func, "copies a tensor from host memory to the GPU", fix,
                             even_in_hftc=True)
        return out

    def _refuse(self, func: Any, what: str, fix: str, *, even_in_hftc: bool = False) -> None:
        where = _origin()
        if where == _HFTC and not even_in_hftc:
            # hftc's own eager fast paths read values on the CPU (is a target ignored, is an
            # index in range) and take a path without the read under torch.compile and on
            # CUDA; a capture that still meets one is refused by _capture.
            return
        raise StepCaptureError(
            f"compile_step: {func.name()}"
            f"{f' at {where}' if where not in (None, _HFTC) else ' in the fused forward'} "
            f"{what}, which a {'CUDA graph' if self.step_mode == 'cuda_graph' else 'compiled step'}"
            f" cannot capture: it would keep the value or shape of the step it was captured "
            f"in. To capture the step, {fix}; or pass mode='eager'")


def _data_dependent_shape(func: Any, args: tuple) -> bool:
    """Whether ``func``'s output shape depends on its inputs' values.  ``aten.index`` is
    tagged so for its boolean masks only: integer indices (a gather) keep shapes fixed."""
    if func is torch.ops.aten.index.Tensor:
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices)
    tags = getattr(func, "tags", ())
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}

_THIS_FILE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_HFTC_DIR = os.path.dirname(os.path.dirname(_THIS_FILE)) + os.sep  # the package, not training/


_HFTC = "hftc"


def _origin() -> str | None:
    """Where the op being dispatched was called from: ``file:line (code)`` of the user's
    code (the loss function's line), None for the fused forward's traced code, or
    :data:`_HFTC` for hftc's own runtime (the innermost frame that is not torch's decides;
    the frames of :class:`_CaptureHazards` itself are skipped)."""
    left_the_check = False  # past the frames of _CaptureHazards itself
    for frame in reversed(traceback.extract_stack()):
        if frame.filename == _THIS_FILE:
            if left_the_check:
                return None  # reached the step itself
            continue
        left_the_check = True
        if frame.filename.startswith(_TORCH):
            continue
        if frame.filename.startswith(_HFTC_DIR):
            return _HFTC
        if frame.filename.startswith("<"):  # the fused forward's generated code
            return None
        return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return None
