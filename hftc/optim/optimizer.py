"""The base of every fused optimizer: N models' hyper-parameters, one vectorised update.

A fused parameter is the stack of N models' parameters, ``[N, *shape]``. A fused
optimizer updates all N slices at once, each with its own hyper-parameters::

    stock, per model i:      p_i.add_(g_i, alpha=-lr_i)                  (N kernels)
    fused, all models:       P.addcmul_(G, (-lr).view(N, 1, ..., 1))     (1 kernel)

Layout of the ``torch.optim.Optimizer`` it subclasses:

* ``param_groups[i]`` is **model i's** hyper-parameter dict (``lr``, ``momentum``,
  ``betas``, ...). Every ``torch.optim.lr_scheduler`` class reads and writes
  ``param_groups[i]["lr"]`` etc., so each schedules its model on its own.
* ``param_groups[0]["params"]`` holds every stacked parameter; the other groups
  hold ``[]``. ``torch.optim.Optimizer`` forbids a tensor in two groups, and
  per-model views (``P[i]``) are not leaves and carry no ``.grad``; with the
  params in one group, ``zero_grad``, ``state_dict`` and anything else that walks
  ``param_groups`` sees each parameter exactly once.
* ``state[P]`` holds ``[N, *shape]`` tensors (``exp_avg``, ...) and a per-model
  ``step`` counter of shape ``[N]`` (on the CPU, like stock non-capturable
  optimizers), so models may take different numbers of steps (an AMP scaler
  skips only the models whose gradients overflowed).

Numerics: each subclass repeats stock torch's single-tensor update op for op.
A Python scalar ``s`` becomes a coefficient tensor ``c`` of shape
``[N, 1, ..., 1]`` (computed in Python double exactly as torch computes ``s``,
then cast to the parameter dtype, as torch's kernels cast ``s``), and each op is
rewritten into one that rounds the same way on every element:

    x.add_(y, alpha=s)           ->  x.addcmul_(y, c)       (both one fused multiply-add)
    x.addcmul_(y, z, value=s)    ->  x.addcmul_(y * c, z)
    x.addcdiv_(y, z, value=s)    ->  x.addcdiv_(y * c, z)   (or per model: x[i].addcdiv_(
                                     y[i], z[i], value=s_i) where the slices are large)
    x.mul_(s), x.div(s), x.lerp_(y, s), x.add_(s)  ->  the same op with c

A coefficient that all N models share (in a learning-rate sweep, every one but
the learning rate) stays a Python scalar and takes stock's own op
(``Coefficients.get``, ``addcmul_``): the update then costs what
stock's costs on the stacked tensors, with no extra multiply and no broadcast.
Except in a capturable step (``refresh_hyperparameters``): there every value is a
device tensor, made once and overwritten in place, since a CUDA graph would keep a
Python scalar as a constant.

On the CPU this reproduces stock results bit for bit (tests assert 1e-9 / 1e-4).
Hyper-parameters that switch the algorithm (``nesterov``, ``amsgrad``,
``centered``, ``maximize``, a momentum of 0) may differ across models too: the
models' results are then selected with ``torch.where``, never blended.
"""

from __future__ import annotations

import inspect
import numbers
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..errors import FusionArgumentError, FusionTypeError, user_line
from ..lowering.compile_guard import run_eagerly
from ..training import mistakes
from .capture import CapturableStep
from .coefficients import (
    HALF_DTYPES,
    Coefficients,
    addcdiv_,
    addcmul_,
    copy_model_state,
    scalar_dtype,
    takes_stock_update,
)
from .hyperparameters import HyperParameterGroups
from .memory import UpdateMemory
from .saving import OptimizerState
from .slicing import stock_keeps

# The subclasses' building blocks, importable from here as before the split.
__all__ = ["FusedOptimizer", "Coefficients", "addcdiv_", "addcmul_", "copy_model_state",
           "scalar_dtype"]


def _per_model(value: Any, n: int) -> bool:
    """Is ``value`` a state tensor with one entry per model (``[N, ...]``)?"""
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n


#: Every live ``hftc.optim`` optimizer, weakly: :func:`hftc.keep_models` given no
#: ``optimizers=`` cuts those built on the fused module it cuts (no list to keep by hand).
LIVE_OPTIMIZERS: weakref.WeakSet[FusedOptimizer] = weakref.WeakSet()


#: Every stock ``torch.optim`` optimizer that has taken a step, weakly (a global step
#: pre-hook that ``import hftc`` installs): ``hftc.keep_models`` refuses to cut a fused
#: module under one of them, whose state for N models it cannot cut.
STEPPED_STOCK_OPTIMIZERS: weakref.WeakSet[Optimizer] = weakref.WeakSet()


@run_eagerly
def _note_stock_optimizer_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """torch global optimizer step pre-hook: remember stock optimizers (weakly). Run
    eagerly under ``torch.compile(opt.step)``: traced, the set's contents were a guard,
    and the step recompiled once it held the optimizer."""
    if not isinstance(optimizer, FusedOptimizer):
        STEPPED_STOCK_OPTIMIZERS.add(optimizer)


class FusedOptimizer(HyperParameterGroups, OptimizerState, UpdateMemory, CapturableStep):
    """Base class: the bookkeeping shared by ``hftc.optim.SGD``, ``Adam``, ``AdamW``, ...

    Subclasses declare their hyper-parameters and implement ``_init_state`` and
    ``_update``; the base class expands scalar-or-list hyper-parameters into N
    param groups, checks shapes, reads the groups' current values on every step
    (schedulers change them) and implements ``skip_models``.
    """

    # Hyper-parameter name -> kind ("float", "flag" or "pair"), in constructor order.
    _hyperparameters: ClassVar[dict[str, str]] = {}

    #: The stock class's keyword arguments that pick how the update runs rather than a
    #: value per model (``foreach``, ``fused``, ``capturable``, ``differentiable``), with
    #: their defaults: one value for all N models, kept in every param group as torch
    #: keeps them (so ``state_dict`` and ``load_state_dict`` carry them).  Checked by
    #: :meth:`_check_flags`; ``fused`` is stored as a bool.
    _flags: ClassVar[dict[str, Any]] = {"differentiable": False}

    #: State keys of one scalar per model (``[N]``, on the CPU in stock's scalar dtype)
    #: that ``load_state_dict`` keeps as saved, where torch's would cast or move them.
    _per_model_scalar_state: ClassVar[tuple[str, ...]] = ("step",)

    #: Tells torch.amp.GradScaler to hand its scale and found-inf flag to ``step`` (as
    #: ``self.grad_scale`` / ``self.found_inf``) instead of skipping the whole step
    #: itself: ``step`` then refuses with a message that says to use
    #: hftc.amp.GradScaler (one scale for all models would couple them).
    _step_supports_amp_scaling = True

    #: Whether ``capturable=True`` is supported (:meth:`refresh_hyperparameters`).
    _capturable_supported: ClassVar[bool] = False

    #: The stock class whose update each model gets (``torch.optim.Adam``): what
    #: ``fuse_optimizers`` converts from and ``unfuse_optimizers`` back to, and what
    #: updates float16 / bfloat16 / complex parameters one by one
    #: (:meth:`_update_by_stock`).
    _stock: ClassVar[type[Optimizer] | None] = None

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | torch.nn.Module,
        num_models: int | None,
        hyperparameters: dict[str, Any],
        flags: dict[str, Any] | None = None,
    ):
        flags = self._check_flags({**self._flags, **(flags or {})})
        if isinstance(params, torch.nn.Module):
            if num_models is None:
                num_models = getattr(params, "num_models", None)
            params = params.named_parameters()
        if isinstance(params, Tensor):
            raise FusionTypeError(
                f"{type(self).__name__} takes an iterable of stacked parameters "
                f"(fused.parameters()), got a single Tensor"
            )
        items = list(params)
        if not items:
            raise FusionArgumentError(f"{type(self).__name__} got an empty parameter list")
        items, group_of, overrides = self._split_groups(items, flags)
        named = all(isinstance(x, tuple) and len(x) == 2 for x in items)
        if named:
            names = [str(x[0]) for x in items]
            tensors = [x[1] for x in items]
        else:
            names = [f"#{k}" for k in range(len(items))]
            tensors = items
        for name, t in zip(names, tensors):
            if not isinstance(t, Tensor):
                raise FusionTypeError(
                    f"{type(self).__name__} can only optimize Tensors, but parameter "
                    f"{name} is a {type(t).__name__}"
                )

        n = self._infer_num_models(names, tensors, num_models, hyperparameters)
        per_model = {
            key: self._expand(key, kind, hyperparameters[key], n)
            for key, kind in self._hyperparameters.items()
        }
        for i in range(n):
            self._check_hyperparameters({k: v[i] for k, v in per_model.items()}, i)
        #: Per-parameter hyper-parameters (param-group dicts, :meth:`_split_groups`): for
        #: each parameter the index of its group in ``_group_overrides``, and per group
        #: each overridden hyper-parameter's N values.
        self._group_of = group_of
        self._group_overrides = [
            {key: self._expand(key, self._hyperparameters[key], value, n)
             for key, value in extra.items()} for extra in overrides]
        for extra in self._group_overrides:
            for i in range(n):
                self._check_hyperparameters({**{k: v[i] for k, v in per_model.items()},
                                             **{k: v[i] for k, v in extra.items()}}, i)

        groups = []
        for i in range(n):
            group: dict[str, Any] = {"params": tensors if i == 0 else []}
            if named:
                group["param_names"] = names if i == 0 else []
            group.update({k: v[i] for k, v in per_model.items()})
            groups.append(group)
        defaults = {k: self._default_of(k, hyperparameters[k]) for k in self._hyperparameters}
        defaults.update(flags)
        self._groups_frozen = False
        super().__init__(groups, defaults)
        self._groups_frozen = True
        self._note_group_bases()
        LIVE_OPTIMIZERS.add(self)

    # ------------------------------------------------------------------ set-up

    @property
    def num_models(self) -> int:
        """N, the number of fused models (one param group each)."""
        return len(self.param_groups)

    def _fused_kernel_first(self, params: list[Tensor], hp: dict[str, list[Any]]
                            ) -> list[Tensor]:
        """With ``fused=True``: torch's fused kernel (``_update_fused``, per model) on the
        parameters it can take, and the others (``_dense`` false) back for the default
        update.  The kernel walks raw memory: every tensor it is given must be dense and
        laid out alike (stock relies on AccumulateGrad's layout contract too)."""
        if not self._flag("fused"):
            return params
        dense = [self._dense(p) for p in params]
        self._update_fused([p for p, d in zip(params, dense) if d], hp)
        return [p for p, d in zip(params, dense) if not d]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_groups_frozen", True)
        LIVE_OPTIMIZERS.add(self)  # a copy (deepcopy, pickle) is found by keep_models too
        self.__dict__.pop("_momentum_ready", None)  # ids of another process's tensors
        # Pickles and state dicts of hftc before the flags were param-group keys: the
        # optimizer's own values (as torch's optimizers fill in keys added later).
        for key, default in self._flags.items():
            self.defaults.setdefault(key, default)
            for group in self.param_groups:
                group.setdefault(key, self.defaults[key])
        if self.__dict__.get("_group_of") is None:
            self._group_of = [0] * len(self.param_groups[0]["params"])
            self._group_overrides = [{}]

    # -------------------------------------------------------------- the step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, for the few stacked parameters a fused
        optimizer holds.

        Stock's wraps the loop in a profiler scope and a dynamo guard; for the handful
        of stacked tensors of a fused model those cost more than the loop itself.  Same
        semantics otherwise.
        """
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    # Eager under torch.compile too (``torch.compile(opt.step)``, or a compiled training
    # step that calls it): the update already runs one kernel per op for all N models,
    # and its per-step Python scalars (bias corrections from each model's step count)
    # would be traced as constants, one recompilation per step.
    # Compiled with tensor scalars it would not match stock bit for bit on the CPU either
    # (FMA and ``sqrt`` rounding: docs/DESIGN_NOTES.md, "Why the optimizer step is eager").
    @torch.no_grad()
    @run_eagerly
    def step(self, closure=None, *, skip_models: Sequence[bool] | Tensor | None = None):
        """Update every model with its own current hyper-parameters.

        Args:
            closure: re-evaluates the loss (as in ``torch.optim``); its value is returned.
            skip_models: optional ``[N]`` bools. Models marked ``True`` are left exactly
                as they were: parameters, optimizer state and step counter
                (``hftc.amp.GradScaler`` passes the models whose gradients overflowed).
                On a capturable optimizer (:attr:`is_capturable`) a bool tensor is never
                read on the host: every model is updated and the skipped ones are then
                put back with ``torch.where`` (:meth:`_step_models`), so the
                step can be captured in a CUDA graph and replayed with new flags.
        """
        if hasattr(self, "found_inf"):  # set by torch.amp.GradScaler.step (see below)
            del self.found_inf  # which would delete them after a step: usable again
            self.__dict__.pop("grad_scale", None)
            raise FusionArgumentError(
                "torch.amp.GradScaler steps this fused optimizer with one loss scale for all "
                f"{self.num_models} models: an overflow in one model would skip every "
                "model's step and shrink every model's scale. Use hftc.amp.GradScaler, "
                "which keeps a scale per model and skips only the models that overflowed "
                "(scaler.scale(per_model_losses).sum().backward(); scaler.step(opt); "
                "scaler.update())")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for p in self.param_groups[0]["params"] if p.grad is not None]
        # (the copies unfuse() gave, trained instead; skip_models on models with batch norm)
        mistakes.check_fused_step(self, self.param_groups[0]["params"], skip_models)
        if not params:
            return loss
        if params[0].shape[0] != self.num_models:
            raise FusionArgumentError(
                f"{type(self).__name__}.step: the parameters hold {params[0].shape[0]} models "
                f"but this optimizer {self.num_models}: hftc.keep_models cut the fused module "
                f"and not this optimizer (its optimizers=[...] left it out); leave "
                f"optimizers= out (every hftc.optim optimizer on the module is cut), pass "
                f"it there, or build it again")
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if isinstance(skip_models, Tensor) and self._capturable():
            self._step_models(params, skip_on_device=self._skip_flags(skip_models))
            return loss
        skip = self._skip_indices(skip_models)
        if len(skip) == self.num_models:
            return loss
        self._step_models(params, skip=skip)
        return loss

    def _step_models(self, params: list[Tensor], skip: Sequence[int] = (),
                     skip_on_device: Tensor | None = None) -> None:
        """One update of ``params`` (those with a ``.grad``), leaving as they were the
        models at the host indices ``skip``, or those flagged in ``skip_on_device`` (a
        ``[N]`` bool tensor, never read on the host)::

            saved = P, state[P]            (parameters, moments, buffers, step counts)
            update every model             (a skipped model's inf/NaN grads too)
            P = where(skip, saved, P); state[P] = where(skip, saved, state[P])

        A skipped model's slices are then the very values it had, as if stock had not
        called its ``optimizer.step()``; the other models' went through the same ops as
        with no skip.  On the device this costs a copy of the parameters and their state
        (masking each update's coefficients instead is not exact: a learning rate of 0
        still decays Adam's moments and weights, and 0 * inf is NaN); host indices copy
        only the skipped models' slices."""
        hp = self.hyperparameters()
        self._check_group_bases(hp)
        # Parameters by param group (one unless groups set their own hyper-parameters).
        groups: dict[int, list[Tensor]] = {0: params}
        if len(self._group_overrides) > 1:
            group_of = {id(p): k for p, k in zip(self.param_groups[0]["params"],
                                                 self._group_of)}
            groups = {}
            for p in params:
                groups.setdefault(group_of[id(p)], []).append(p)
        group_hp = {k: {**hp, **self._group_overrides[k]} for k in groups}
        for k, group in groups.items():
            for p in group:
                if not self.state[p]:
                    self._init_state(p, group_hp[k])
        saved = self._save_models(params, skip) if skip else None
        saved_on_device = None
        if skip_on_device is not None:
            saved_on_device = [
                (p, p.clone(), {k: v.clone() for k, v in self._per_model_tensors(p).items()})
                for p in params]
        capturable = self._capturable()
        for k, group in groups.items():
            if capturable:
                self.__dict__.setdefault("_captured_switches", {})[k] = \
                    self._switches(group_hp[k])
            self._group_in_update = k
            if self._stock is not None:
                by_stock = [p for p in group if takes_stock_update(p)]
                if by_stock:
                    self._update_by_stock(by_stock, group_hp[k])
                    group = [p for p in group if not takes_stock_update(p)]
            if group:
                self._update(group, group_hp[k])
        if saved is not None:
            self._restore_models(saved, skip)
        if saved_on_device is not None:
            for p, p_saved, state_saved in saved_on_device:
                pairs = [(p, p_saved)] + [(self.state[p][k], v) for k, v in state_saved.items()]
                for current, before in pairs:
                    flags = skip_on_device.to(current.device)
                    torch.where(flags.view(-1, *([1] * (current.dim() - 1))), before, current,
                                out=current)
        if saved is not None or saved_on_device is not None:
            # Restored state may be a first step's (SGD: no momentum buffer yet); on the
            # device the host cannot tell whether any model was skipped.
            self.__dict__.pop("_momentum_ready", None)

    def _update_by_stock(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        """The update of float16 / bfloat16 / complex ``params``: for each model, a stock optimizer
        of :attr:`_stock` over views of that model's slices, with its values and its slices
        of the state (what :func:`~hftc.optim.slicing.stock_keeps`, as
        ``unfuse_optimizers`` does), stepped::

            for i in models:
                stock = torch.optim.<Class>([p[i] for p in params], **model i's values)
                stock.state[p[i]] = {key: state[p][key][i], ...};  stock.step()

        A half type's kernels compute ``a + alpha * b`` in float32, ``alpha`` a float32
        scalar, and round once; the per-model coefficient tensors of the other paths are
        in the parameter's dtype, their values rounded to it first (an lr of 0.1 in
        bfloat16 is 0.10009765625), so every step would be an ulp off stock's.  Stock
        updates a complex parameter as its real view (each component its own moments),
        which the stacked update does not.  A buffer stock makes on its first step (SGD's
        momentum) is copied into the stacked state and marked in its ``has_<key>`` flags."""
        dtype = params[0].dtype
        half = dtype in HALF_DTYPES
        if params[0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise FusionArgumentError(
                f"{type(self).__name__}: a step over {dtype} parameters is being captured "
                f"in a CUDA graph; they take each model's stock update with its values as "
                f"Python numbers, which a graph would keep as constants (a scheduler's "
                f"changes would never apply).  Step the optimizer outside the graph "
                f"(hftc.compile_step does: is_capturable is False for it)"
                + (f", or keep the parameters in float32 and train in {dtype} under "
                   f"autocast" if half else ""))
        n = self.num_models
        names = set(inspect.signature(self._stock).parameters)
        # Each model's own flags: NAdam's and RAdam's foreach and for-loop updates round
        # differently, and each model takes the one its group picks.
        flags = [{key: group.get(key) for key in self._flags
                  if key in names and key != "differentiable"} for group in self.param_groups]
        if flags[0].get("capturable") and not params[0].is_cuda:
            raise FusionArgumentError(
                f"{type(self).__name__}(capturable=True) over {dtype} parameters on the "
                f"{params[0].device.type}: they take each model's stock update, and stock "
                f"refuses capturable=True there.  Drop capturable=True (it is for CUDA "
                f"graphs)" + (", or keep the parameters in float32" if half else ""))
        for i in range(n):
            values = {name: hp[name][i] for name in self._hyperparameters if name in names}
            views = [p.detach()[i] for p in params]
            stock = self._stock(views, **values, **flags[i])
            given = []
            for p, view in zip(params, views):
                view.grad = p.grad[i]
                state = self.state[p]
                own = {key: value[i] if _per_model(value, n) else value
                       for key, value in state.items()
                       if not _per_model(value, n) or stock_keeps(key, state, i, values)}
                stock.state[view] = dict(own)
                given.append(own)
            stock.step()
            for p, view, own in zip(params, views, given):
                state = self.state[p]
                # What stock wrote in place is ours already; a tensor it made anew (SGD's
                # first momentum buffer, or a value it replaced) is copied into our slice.
                for key, value in stock.state[view].items():
                    if not isinstance(value, Tensor) or value is own.get(key):
                        continue
                    if key not in state:  # made lazily (a scheduler turned momentum on)
                        state[key] = value.new_zeros((n, *value.shape))
                        state[f"has_{key}"] = torch.zeros(n, dtype=p.dtype, device=p.device)
                    state[key][i].copy_(value)
                    if f"has_{key}" in state:
                        state[f"has_{key}"][i].fill_(1)

    def _skip_flags(self, skip_models: Tensor) -> Tensor:
        """``skip_models`` as a ``[N]`` bool tensor where it is, checked by shape only."""
        if skip_models.shape != (self.num_models,):
            raise FusionArgumentError(
                f"skip_models has shape {list(skip_models.shape)} but there are "
                f"{self.num_models} models: give one flag per model, shape [{self.num_models}]")
        return skip_models.detach().to(torch.bool)

    def _skip_indices(self, skip_models) -> list[int]:
        if skip_models is None:
            return []
        values = torch.as_tensor(skip_models).detach().to("cpu").reshape(-1)
        indices = (isinstance(skip_models, Sequence) and any(
            isinstance(f, numbers.Integral) and not isinstance(f, bool) for f in skip_models)
        ) or bool(((values != 0) & (values != 1)).any())
        if indices:  # (read as flags, [1, 0] would skip model 0 only, [2, 3] every model)
            n = self.num_models
            raise FusionArgumentError(
                f"{type(self).__name__}.step(skip_models={skip_models!r}){user_line()}: "
                f"skip_models takes one bool per model ([{n}] flags, True: leave that model "
                f"as it is), not model indices; for indices: "
                f"skip_models=[i in skipped for i in range({n})]")
        flags = values.to(torch.bool)
        if flags.numel() != self.num_models:
            raise FusionArgumentError(
                f"skip_models has {flags.numel()} entries but there are {self.num_models} models"
            )
        return flags.nonzero().flatten().tolist()

    def _per_model_tensors(self, p: Tensor) -> dict[str, Tensor]:
        n = self.num_models
        return {k: v for k, v in self.state[p].items()
                if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == n}

    def _save_models(self, params: list[Tensor], skip: list[int]):
        # Copies only the skipped models' slices: an overflow in one model of N
        # costs 1/N of a full copy, and nothing when no model is skipped.
        saved = []
        for p in params:
            idx = torch.tensor(skip, device=p.device)
            state = {k: v.index_select(0, idx.to(v.device))
                     for k, v in self._per_model_tensors(p).items()}
            saved.append((p, p.index_select(0, idx), state))
        return saved

    def _restore_models(self, saved, skip: list[int]) -> None:
        for p, p_saved, state_saved in saved:
            idx = torch.tensor(skip, device=p.device)
            p.index_copy_(0, idx, p_saved)
            for k, v in state_saved.items():
                self.state[p][k].index_copy_(0, idx.to(v.device), v)

    def _new_steps(self, p: Tensor) -> Tensor:
        """Zero step counts, one per model, where and as stock keeps them: on the
        parameter's device with ``capturable=True`` or ``fused=True`` (the CUDA kernels
        read them there), float32 for the fused kernels."""
        fused = self._flag("fused")
        dtype = torch.float32 if fused else scalar_dtype()
        device = p.device if fused or self._capturable() else None
        return torch.zeros(self.num_models, dtype=dtype, device=device)

    # -------------------------------------------------------- capturable steps

    def _count_steps(self, params: list[Tensor]) -> list[Tensor]:
        """Add one to every parameter's per-model step counts (``state["step"]``, as
        stock's ``step += 1``) and return them.  One ``_foreach`` call for all
        parameters, not one small op per parameter."""
        steps = [self.state[p]["step"] for p in params]
        if steps:
            torch._foreach_add_(steps, 1)
        return steps

    # ------------------------------------------------------ subclass hooks

    def _init_state(self, p: Tensor, hp: dict[str, list[Any]]) -> None:
        """Create ``state[p]`` (all models at once), as the stock class's first step would."""
        raise NotImplementedError

    def _update(self, params: list[Tensor], hp: dict[str, list[Any]]) -> None:
        """Apply one step to every parameter in ``params`` (all have a ``.grad``)."""
        raise NotImplementedError

