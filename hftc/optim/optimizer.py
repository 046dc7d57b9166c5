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
import math
import numbers
import weakref
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from ..errors import FusionArgumentError
from ..lowering.compile_guard import run_eagerly
from ..lowering.runtime.per_model import values_on
from ..training import mistakes
from .slicing import stock_keeps

__all__ = ["FusedOptimizer"]


def scalar_dtype() -> torch.dtype:
    # The dtype stock optimizers give state["step"] (torch.optim.optimizer._get_scalar_dtype).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _is_number(x: Any) -> bool:
    if isinstance(x, Tensor):
        return x.dim() == 0
    return isinstance(x, numbers.Real)


def _is_sequence(x: Any) -> bool:
    if isinstance(x, (str, bytes, dict)):
        return False
    if isinstance(x, Tensor):
        return x.dim() == 1
    return isinstance(x, Sequence) or hasattr(x, "__len__") and hasattr(x, "__getitem__")


def _as_float(name: str, value: Any, model: int | None = None) -> float:
    where = f"{name}[{model}]" if model is not None else name
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where} must be a number, got a tensor of shape {list(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a number, got {type(value).__name__}: {value!r}")
    return float(value)


def _as_flag(name: str, value: Any, model: int | None = None) -> bool:
    where = f"{name}[{model}]" if model is not None else name
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, numbers.Integral)):
        raise TypeError(f"{where} must be a bool, got {type(value).__name__}: {value!r}")
    return bool(value)


def _as_pair(name: str, value: Any, model: int | None = None) -> tuple[float, float]:
    where = f"{name}[{model}]" if model is not None else name
    if not _is_sequence(value) or len(value) != 2 or not all(_is_number(v) for v in value):
        raise TypeError(f"{where} must be a pair of numbers, got {value!r}")
    return (_as_float(name, value[0], model), _as_float(name, value[1], model))


#: Half types, whose parameters each model's stock optimizer updates, as complex ones
#: (:meth:`FusedOptimizer._update_by_stock`).
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _takes_stock_update(p: Tensor) -> bool:
    """Is ``p`` updated model by model by the stock class (a half or complex dtype)?"""
    return p.dtype in _HALF_DTYPES or p.is_complex()


def _per_model(value: Any, n: int) -> bool:
    """Is ``value`` a state tensor with one entry per model (``[N, ...]``)?"""
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n


class Coefficients:
    """Per-model scalars, as ``[N, 1, ..., 1]`` tensors that broadcast over ``[N, *shape]``.

    Built from Python values once per step (one host-to-device copy per dtype and
    device, not one per parameter or per coefficient).

    ``persistent`` (a capturable step, :meth:`FusedOptimizer.refresh_hyperparameters`):
    every row stays a tensor (no shared value becomes a Python scalar, which a CUDA graph
    would keep as a constant), and :meth:`assign` writes new values into the same tensors.
    """

    def __init__(self, values: dict[str, Sequence[float]], persistent: bool = False):
        self._row = {name: k for k, name in enumerate(values)}
        self.persistent = persistent
        self._cache: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._views: dict[tuple[Any, ...], Tensor] = {}
        self._set_rows(values)

    def _set_rows(self, values: dict[str, Sequence[float]]) -> None:
        self._rows = [[float(v) for v in vs] for vs in values.values()]
        # Shared by all N models -> that value; else False.  (NaN never compares equal,
        # so a NaN hyper-parameter takes the tensor path; 0.0 and -0.0 are not shared:
        # dividing by them gives infinities of opposite signs.)
        self._uniform: dict[str, float | bool] = {
            name: row[0] if not self.persistent and all(
                v == row[0] and math.copysign(1.0, v) == math.copysign(1.0, row[0])
                for v in row) else False
            for name, row in zip(values, self._rows)
        }

    def assign(self, values: dict[str, Sequence[float]]) -> None:
        """New values for the same rows, written into the tensors made so far in place
        (their views, held by a captured graph, then read the new values)."""
        if list(values) != list(self._row):
            raise ValueError(f"rows {list(values)} are not {list(self._row)}")
        self._set_rows(values)
        for (dtype, device), table in self._cache.items():
            table.copy_(values_on(self._rows, dtype, device), non_blocking=True)

    def __call__(self, name: str, like: Tensor) -> Tensor:
        """Row ``name`` in ``like``'s dtype and device, shaped to broadcast over ``like``."""
        # Memoised per (row, dtype, device, rank): an update asks for the same few views
        # once per parameter, and each view costs more than the op it feeds at small N.
        view_key = (name, like.dtype, like.device, like.dim())
        view = self._views.get(view_key)
        if view is not None:
            return view
        key = (like.dtype, like.device)
        table = self._cache.get(key)
        if table is None:
            if self.persistent and like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise FusionArgumentError(
                    "a fused optimizer's step is being captured in a CUDA graph before an "
                    "eager step made its coefficient tensors: run optimizer.step() once "
                    "eagerly (a warm-up step) before capturing it")
            # Its own copy: values_on's GPU tensors are shared read-only, and assign()
            # writes into this one.
            table = self._cache[key] = values_on(self._rows, like.dtype, like.device).clone()
        view = table[self._row[name]].view(-1, *([1] * (like.dim() - 1)))
        self._views[view_key] = view
        return view

    def row(self, name: str) -> list[float]:
        """Row ``name`` as N Python floats (model i's value at index i)."""
        return self._rows[self._row[name]]

    def mask(self, name: str, like: Tensor) -> Tensor:
        """Row ``name`` (0/1 values) as a bool ``[N, 1, ..., 1]`` tensor on ``like``'s device."""
        return self(name, like) != 0

    def get(self, name: str, like: Tensor) -> float | Tensor:
        """Row ``name`` as one Python float if all N models share it, else as ``self(name, like)``.

        A shared value then goes to the kernel as a Python scalar, exactly as stock torch
        passes it (one op fewer where the tensor form needs a multiply first, and the
        scalar fast paths of the elementwise kernels).
        """
        uniform = self._uniform[name]
        return self(name, like) if uniform is False else uniform


def addcmul_(x: Tensor, y: Tensor, z: Tensor, c: float | Tensor) -> Tensor:
    """``x += c * y * z`` as stock writes ``x.addcmul_(y, z, value=c)``, with ``c`` per model."""
    if isinstance(c, Tensor):
        return x.addcmul_(y * c, z)
    return x.addcmul_(y, z, value=c)


#: On the CPU, a per-model ``value`` of :func:`addcdiv_` over slices of at least this many
#: elements per model is applied by one ``addcdiv_`` per model (stock's very call, its
#: value a Python float): one pass over ``[N, ...]`` fewer than the product ``y * c``
#: first.  Below, the calls cost more than the pass (docs/DESIGN_NOTES.md).
PER_MODEL_CALLS_MIN = 1 << 15


def addcdiv_(x: Tensor, y: Tensor, z: Tensor, coef: Coefficients, name: str,
             scratch: Tensor | None = None, per_model_calls: bool = True) -> Tensor:
    """``x += c * y / z`` as stock writes ``x.addcdiv_(y, z, value=c)``, with ``c`` the
    per-model row ``name`` of ``coef``.

    One value for all models: stock's call.  Per model: one call per model with its
    own value where the slices are large (``PER_MODEL_CALLS_MIN``, unless
    ``per_model_calls`` is false) or of a half type,
    else one call on the product ``y * c`` (into ``scratch`` if given), which rounds as
    stock does in float32 and float64: ``addcdiv_`` computes ``(value * y) / z``.  In
    float16 / bfloat16 it computes that in float32 and rounds once, where the product
    rounds first (fp16 Adam: 695 of 768 elements a step off stock's by an ulp; 0 / 0
    where ``y * c`` underflows).
    """
    c = coef.get(name, x)
    if not isinstance(c, Tensor):
        return x.addcdiv_(y, z, value=c)
    half = x.dtype in (torch.float16, torch.bfloat16)
    if half or (per_model_calls and x.device.type == "cpu"
                and x.numel() // x.shape[0] >= PER_MODEL_CALLS_MIN):
        for i, value in enumerate(coef.row(name)):
            x[i].addcdiv_(y[i], z[i], value=value)
        return x
    return x.addcdiv_(torch.mul(y, c, out=scratch) if scratch is not None else y * c, z)


def copy_model_state(target: Tensor, value: Tensor, blocks: int = 1) -> None:
    """``target.copy_(value)``; a ``value`` narrower than ``target`` (a model padded to the
    widest, ``hftc.fuse(..., pad_widths=True)``) goes where the padding put the model's
    entries (the leading ones; ``blocks`` > 1: each of dim 0's blocks, as
    ``in_proj_weight``'s q, k, v), zeros on the padding."""
    if isinstance(value, Tensor) and value.dim() == target.dim() and value.shape != target.shape:
        from ..module.padding import into_padded

        into_padded(target, value, blocks)
        return
    target.copy_(value)


#: Every live ``hftc.optim`` optimizer, weakly: :func:`hftc.keep_models` given no
#: ``optimizers=`` cuts those built on the fused module it cuts (no list to keep by hand).
LIVE_OPTIMIZERS: weakref.WeakSet[FusedOptimizer] = weakref.WeakSet()


#: Every stock ``torch.optim`` optimizer that has taken a step, weakly (a global step
#: pre-hook that ``import hftc`` installs): ``hftc.keep_models`` refuses to cut a fused
#: module under one of them, whose state for N models it cannot cut.
STEPPED_STOCK_OPTIMIZERS: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def _note_stock_optimizer_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """torch global optimizer step pre-hook: remember stock optimizers (weakly)."""
    if not isinstance(optimizer, FusedOptimizer):
        STEPPED_STOCK_OPTIMIZERS.add(optimizer)


class FusedOptimizer(Optimizer):
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
    #: updates float16 / bfloat16 / complex parameters model by model
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
            raise TypeError(
                f"{type(self).__name__} takes an iterable of stacked parameters "
                f"(fused.parameters()), got a single Tensor"
            )
        items = list(params)
        if not items:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
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
                raise TypeError(
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
        LIVE_OPTIMIZERS.add(self)

    # ------------------------------------------------------------------ set-up

    def _split_groups(self, items: list[Any], flags: dict[str, Any] | None = None
                      ) -> tuple[list[Any], list[int], list[dict]]:
        """Param-group dicts, as torch takes them, -> one flat list of parameters, each
        parameter's group index, and each group's hyper-parameters (``[]`` for none)::

            AdamW([{"params": matrices, "weight_decay": 0.1},      # nanoGPT's grouping
                   {"params": biases_and_norms, "weight_decay": 0.0}], lr=[...])

        A group's values (one shared, or N per model) hold for its parameters, the
        constructor's for the rest.  Not ``lr``: ``param_groups[i]`` is model i, whose
        learning rate its scheduler sets for all of its parameters.  A group may name a
        flag (``foreach``, ...) only with the optimizer's value: it holds for all of them."""
        if not any(isinstance(x, dict) for x in items):
            return items, [0] * len(items), [{}]
        cls = type(self).__name__
        if not all(isinstance(x, dict) for x in items):
            raise TypeError(f"{cls} takes stacked parameters or param-group dicts, not both")
        flat, group_of, overrides = [], [], []
        for k, group in enumerate(items):
            if "params" not in group:
                raise TypeError(f"{cls}: param group {k} has no 'params'")
            params = group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            extra = {key: value for key, value in group.items() if key != "params"}
            group_flags = {key: extra.pop(key) for key in self._flags if key in extra}
            if group_flags and flags is not None:
                checked = self._check_flags({**flags, **group_flags}, f"param group {k}: ")
                if checked != flags:
                    differ = sorted(key for key in group_flags if checked[key] != flags[key])
                    raise FusionArgumentError(
                        f"{cls}: param group {k} sets "
                        f"{', '.join(f'{key}={group_flags[key]!r}' for key in differ)}, "
                        f"which picks how the update runs for all parameters and models at "
                        f"once; give it to the constructor instead")
            if "lr" in extra:
                raise TypeError(
                    f"{cls}: param group {k} sets lr; param_groups[i] of a fused optimizer "
                    f"is model i, whose learning rate (and its scheduler) holds for all its "
                    f"parameters. Give those parameters a second fused optimizer instead")
            unknown = sorted(set(extra) - set(self._hyperparameters))
            if unknown:
                raise TypeError(f"{cls}: param group {k} has unknown hyper-parameter(s) "
                                f"{unknown}; {cls} takes {sorted(self._hyperparameters)}")
            flat += params
            group_of += [k] * len(params)
            overrides.append(extra)
        return flat, group_of, overrides

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_group_of"] = self.__dict__.get("_group_of")
        state["_group_overrides"] = self.__dict__.get("_group_overrides")
        return state

    @property
    def num_models(self) -> int:
        """N, the number of fused models (one param group each)."""
        return len(self.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict``, and under ``"hftc"`` N and the per-parameter
        hyper-parameters of param-group dicts (which torch's groups, one per model, do
        not hold), so that ``load_state_dict`` restores them as torch restores a group's."""
        saved = super().state_dict()
        saved["hftc"] = {
            "num_models": self.num_models,
            "group_of": list(self._group_of),
            "group_overrides": [{k: list(v) for k, v in extra.items()}
                                for extra in self._group_overrides],
        }
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, refusing a state dict that is not a fused
        optimizer's over the same N models and parameters (a stock optimizer's loaded
        into N = 1 failed on the next step, inside the update)."""
        extra = state_dict.get("hftc")
        groups = state_dict.get("param_groups", [])
        n, cls = self.num_models, type(self).__name__
        fix = ("N stock optimizers' state goes into a fused one through "
               "hftc.optim.fuse_optimizers(fused, stock_optimizers), which converts it")
        saved_n = extra["num_models"] if extra is not None else len(groups)
        if saved_n != n or len(groups) != n:
            raise FusionArgumentError(
                f"{cls}.load_state_dict: the state dict has {len(groups)} param group(s); "
                f"this fused optimizer has one per model, {n}: it is a stock optimizer's or "
                f"a fused one's over another number of models; {fix}")
        params = self.param_groups[0]["params"]
        for index, p in zip(groups[0]["params"], params):
            for key, value in state_dict.get("state", {}).get(index, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == p.numel() \
                        and value.shape not in (p.shape, (n,)):  # (n,): per-model step counts
                    raise FusionArgumentError(
                        f"{cls}.load_state_dict: state {key!r} of parameter {index} has shape "
                        f"{list(value.shape)}, its stacked parameter {list(p.shape)}: not a "
                        f"fused optimizer's state; {fix}")
        for group in groups:  # what the constructor refuses (differentiable=True, ...)
            self._check_flags({k: group[k] for k in self._flags if k in group},
                              "load_state_dict: ")
        if extra is not None and len(extra["group_of"]) != len(params):
            raise FusionArgumentError(
                f"{cls}.load_state_dict: the state dict is for {len(extra['group_of'])} "
                f"parameters, this optimizer has {len(params)}")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "hftc"})
        self.__dict__.pop("_momentum_ready", None)  # state the update knew is replaced
        # torch moves a fused or capturable group's step counts to the parameter's device
        # as float32, where those updates read them, and NAdam's mu_product to the
        # parameter's device and dtype; hftc keeps the others on the CPU as saved.
        for index, p in zip(groups[0]["params"], params):
            for key in self._per_model_scalar_state:
                if key == "step" and (self._capturable() or self._flag("fused")):
                    continue  # where _new_steps puts them, as torch does
                saved = state_dict.get("state", {}).get(index, {}).get(key)
                loaded = self.state[p].get(key) if p in self.state else None
                if isinstance(saved, Tensor) and isinstance(loaded, Tensor) \
                        and (loaded.device != saved.device or loaded.dtype != saved.dtype):
                    self.state[p][key] = saved.to("cpu").clone()
        if extra is not None:  # as torch restores each group's hyper-parameters
            self._group_of = list(extra["group_of"])
            self._group_overrides = [
                {k: list(v) for k, v in overrides.items()}
                for overrides in extra["group_overrides"]]

    def _infer_num_models(self, names, tensors, num_models, hyperparameters) -> int:
        cls = type(self).__name__
        for name, t in zip(names, tensors):
            if t.dim() == 0:
                raise ValueError(
                    f"{cls}: parameter {name} is a 0-dim tensor; fused parameters are "
                    f"stacked [N, *shape] (N = number of models)"
                )
        leading = {t.shape[0] for t in tensors}
        if len(leading) > 1:
            shapes = ", ".join(f"{n}: {list(t.shape)}" for n, t in zip(names, tensors))
            raise ValueError(
                f"{cls}: fused parameters must all be stacked [N, *shape] with one N, "
                f"but their leading dims differ ({shapes})"
            )
        n = leading.pop()
        if num_models is not None and num_models != n:
            bad = next(name for name, t in zip(names, tensors) if t.shape[0] != num_models)
            shape = list(tensors[names.index(bad)].shape)
            raise ValueError(
                f"{cls}: num_models={num_models}, but parameter {bad} has shape {shape}: "
                f"each fused parameter must be [N, *shape] with N = {num_models}"
            )
        for key, kind in self._hyperparameters.items():
            value = hyperparameters[key]
            if self._is_per_model(kind, value) and len(value) != n:
                raise ValueError(
                    f"{cls}: {key} has {len(value)} values but there are {n} models "
                    f"(the parameters' leading dim); give one value per model or one shared value"
                )
        return n

    @staticmethod
    def _is_per_model(kind: str, value: Any) -> bool:
        if kind == "pair":
            # (0.9, 0.999) is one shared pair; [(0.9, 0.999), (0.8, 0.99)] is one per model.
            return _is_sequence(value) and len(value) > 0 and all(_is_sequence(v) for v in value)
        return _is_sequence(value)

    def _expand(self, key: str, kind: str, value: Any, n: int) -> list[Any]:
        convert = {"float": _as_float, "flag": _as_flag, "pair": _as_pair}[kind]
        if self._is_per_model(kind, value):
            return [convert(key, v, i) for i, v in enumerate(value)]
        return [convert(key, value)] * n

    def _default_of(self, key: str, value: Any) -> Any:
        # optimizer.defaults only has to name the hyper-parameters (OneCycleLR and
        # CyclicLR look for "momentum" / "betas" there); model 0's value stands in.
        return self._expand(key, self._hyperparameters[key], value, 1)[0]

    def _check_hyperparameters(self, hp: dict[str, Any], model: int) -> None:
        """Raise ``ValueError`` for model ``model``'s bad values, as the stock class would."""
        for key in ("lr", "eps", "weight_decay", "momentum", "lr_decay",
                    "initial_accumulator_value", "alpha"):
            if key in hp and not hp[key] >= 0.0:
                raise ValueError(f"Invalid {key} for model {model}: {hp[key]} (must be >= 0)")
        if "betas" in hp:
            for k, b in enumerate(hp["betas"]):
                if not 0.0 <= b < 1.0:
                    raise ValueError(
                        f"Invalid beta parameter at index {k} for model {model}: {b} "
                        f"(must be in [0, 1))"
                    )

    @classmethod
    def _check_flags(cls, flags: dict[str, Any], where: str = "") -> dict[str, Any]:
        """The constructor's implementation flags, checked: one bool (or ``None``) each;
        ``fused`` as a bool.  What hftc cannot honour raises ``FusionArgumentError``
        saying what to do instead: ``differentiable=True``, ``capturable=True``, and
        ``fused=True`` with ``foreach=True`` (which torch refuses too)."""
        name = cls.__name__
        out: dict[str, Any] = {}
        for key, value in flags.items():
            if isinstance(value, Tensor) and value.numel() == 1:
                value = value.item()
            if value is not None and not isinstance(value, (bool, numbers.Integral)):
                raise FusionArgumentError(
                    f"{name}: {where}{key} takes one bool (or None) for all N models: it "
                    f"picks how the update runs, not a value per model; got {value!r}")
            out[key] = value if value is None else bool(value)
        if "fused" in out:
            out["fused"] = bool(out["fused"])
        if out.get("differentiable"):
            raise FusionArgumentError(
                f"{name}: {where}differentiable=True is not supported: the fused step "
                f"updates the stacked parameters in place under torch.no_grad(), so autograd "
                f"cannot differentiate through it. Pass differentiable=False (the default). "
                f"To differentiate through optimizer steps (meta-learning), step each of "
                f"fused.unfuse()'s models with torch.optim.{name}(..., differentiable=True), "
                f"or write the update functionally (torch.func)")
        if out.get("capturable") and not cls._capturable_supported:
            raise FusionArgumentError(
                f"{name}: {where}capturable=True is not supported: each model's step count "
                f"stays on the CPU and every step prepares the models' coefficients on the "
                f"host (as torch.optim.{name} does with capturable=False), which a CUDA graph "
                f"replay would not repeat. Pass capturable=False (the default): the step "
                f"already runs each op once for all N models, and a torch.compile'd training "
                f"step runs it eagerly")
        if out.get("capturable") and out.get("fused"):
            raise FusionArgumentError(
                f"{name}: {where}capturable=True and fused=True cannot both be set: the "
                f"fused kernels take each model's learning rate as a host number, which a "
                f"CUDA graph replay would not update. Pass capturable=True alone (its step "
                f"runs each op once for all N models)")
        if out.get("fused") and out.get("foreach"):
            raise FusionArgumentError(
                f"{name}: {where}fused=True and foreach=True cannot both be set "
                f"(torch.optim.{name} refuses them together too); pass one of them")
        return out

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

    def _flag(self, key: str) -> bool:
        """Flag ``key`` (``fused``) as every param group holds it: it picks how the whole
        update runs, so the N models' groups must agree (a user or a loaded state dict
        could set one group's)."""
        groups = self.param_groups
        value = bool(groups[0].get(key))
        for g in groups:
            if bool(g.get(key)) is not value:
                raise FusionArgumentError(
                    f"{type(self).__name__}: the param groups (one per model) disagree on "
                    f"{key} ({[g.get(key) for g in groups]}); it picks how the update runs "
                    f"for all N models at once: set one value in every group")
        return value

    def _stock_foreach(self, params: list[Tensor]) -> list[bool]:
        """Per model, whether its stock optimizer would run its ``foreach`` update on
        ``params`` rather than its for-loop one (``torch.optim.optimizer.
        _default_to_fused_or_foreach``: ``foreach=None`` means foreach where every
        parameter is on a device with foreach kernels, CUDA, not the CPU).

        For the classes whose two updates round differently (NAdam, RAdam): each model
        gets the one its group's ``foreach`` picks (``fuse_optimizers`` copies it per model).
        """
        default = all(p.device.type in _get_foreach_kernels_supported_devices() for p in params)
        return [default if g.get("foreach") is None else bool(g["foreach"])
                for g in self.param_groups]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only used while constructing: groups are models, so none can be added later."""
        if getattr(self, "_groups_frozen", True):
            raise NotImplementedError(
                f"{type(self).__name__}.add_param_group: param_groups[i] is model i's "
                f"hyper-parameters, so groups cannot be added; build a new fused optimizer "
                f"over all the stacked parameters instead"
            )
        super().add_param_group(param_group)

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

    def _keep_models(self, keep: Sequence[int]) -> None:
        """Keep only models ``keep`` (checked, distinct indices), in that order, in place::

            param_groups  [g_0, ..., g_N-1]  ->  [g_keep[0], ...]  (the same dicts; the
                          stacked parameters stay in the first group, the same objects)
            state[p][key] [N, ...]           ->  state[p][key][keep]   (moments, steps ...)

        with the per-parameter hyper-parameters of param-group dicts sliced the same way.
        What :func:`hftc.keep_models` calls, together with the fused module's."""
        groups = self.param_groups
        n = len(groups)
        first = groups[0]
        kept = [groups[i] for i in keep]
        moved = {key: first[key] for key in ("params", "param_names") if key in first}
        for k, group in enumerate(kept):
            for key, value in moved.items():
                group[key] = value if k == 0 else []
        self.param_groups = kept
        for p in moved["params"]:
            state = self.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
                    index = torch.tensor(list(keep), dtype=torch.long, device=value.device)
                    state[key] = value.index_select(0, index)
        self._group_overrides = [{key: [values[i] for i in keep] for key, values in extra.items()}
                                 for extra in self._group_overrides]
        for cache in ("_momentum_ready", "_coefficient_cache", "_captured_switches",
                      "_scratch_views", "_group_in_update"):
            self.__dict__.pop(cache, None)  # made for the N models

    # -------------------------------------------------------------- the step

    def hyperparameters(self) -> dict[str, list[Any]]:
        """Each hyper-parameter's current value per model: ``{"lr": [lr_0, ..., lr_{N-1}], ...}``.

        Read from ``param_groups`` on every step, so schedulers' changes apply at once.
        """
        out = {}
        groups = self.param_groups
        for key, kind in self._hyperparameters.items():
            values = [g[key] for g in groups]
            # The common case, plain Python values, needs no conversion; checking it is
            # far cheaper than converting, which runs every step.
            if kind == "float" and all(type(v) is float for v in values):
                out[key] = values
                continue
            if kind == "flag" and all(type(v) is bool for v in values):
                out[key] = values
                continue
            if kind == "pair" and all(type(v) is tuple and len(v) == 2 and type(v[0]) is float
                                      and type(v[1]) is float for v in values):
                out[key] = values
                continue
            convert = {"float": _as_float, "flag": _as_flag, "pair": _as_pair}[kind]
            out[key] = [convert(key, v, i) for i, v in enumerate(values)]
        return out

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
    # Compiling the update with those scalars as tensors cannot match stock bit for bit on
    # the CPU either: eager ``lerp_`` and ``addcmul_`` round once through an FMA, which
    # inductor's C++ code never emits, and eager ``sqrt`` (MKL's vector math) differs from
    # the correctly rounded one inductor emits in ~16% of elements.  Compiling only what
    # follows an eager ``sqrt`` is exact, and saves too little to pay (docs/DESIGN_NOTES.md).
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
                by_stock = [p for p in group if _takes_stock_update(p)]
                if by_stock:
                    self._update_by_stock(by_stock, group_hp[k])
                    group = [p for p in group if not _takes_stock_update(p)]
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
        half = dtype in _HALF_DTYPES
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
            raise ValueError(
                f"skip_models has shape {list(skip_models.shape)} but there are "
                f"{self.num_models} models: give one flag per model, shape [{self.num_models}]")
        return skip_models.detach().to(torch.bool)

    def _skip_indices(self, skip_models) -> list[int]:
        if skip_models is None:
            return []
        flags = torch.as_tensor(skip_models).detach().to("cpu", torch.bool).reshape(-1)
        if flags.numel() != self.num_models:
            raise ValueError(
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

    def _scratch(self, like: Tensor, slot: int = 0) -> Tensor:
        """A reusable temporary shaped like ``like``: slot ``slot`` of a buffer kept across steps.

        The update's temporaries (Adam's denominator, a per-model step) would otherwise
        be allocated and freed once per parameter per step; freed large blocks go back
        to the OS and come back as fresh page faults, which cost more than the
        arithmetic (docs/DESIGN_NOTES.md).  One buffer per slot holds the
        largest parameter, so the memory cost is ``slots x`` the largest parameter, not
        a copy of the model.  Not part of ``state_dict`` (nor of pickling, which
        ``torch.optim.Optimizer.__getstate__`` limits to defaults, state, groups).
        """
        views = self.__dict__.setdefault("_scratch_views", {})
        view = views.get((slot, like))
        if view is not None and view.shape == like.shape and view.dtype == like.dtype \
                and view.device == like.device:
            return view
        buffers = self.__dict__.setdefault("_scratch_buffers", {})
        key = (slot, like.dtype, like.device)
        buf = buffers.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
            buffers[key] = buf
            views.clear()  # views of the old buffer would keep it alive
        view = buf[: like.numel()].view(like.shape)
        views[(slot, like)] = view
        return view

    def _column_blocks(self, tensors: list[Tensor], scratch_slots: int, block_numel: int):
        """Yield ``(blocks, scratch)``: the same column block of every tensor's ``[N, numel / N]``
        view (all shaped like ``tensors[0]`` and contiguous), and ``scratch_slots`` scratch
        tensors of the block's shape::

            whole tensors:  op1 over P, op2 over P, ...          (each pass from memory)
            in blocks:      op1, op2, ... over P[:, 0:c], then P[:, c:2c], ...   (in cache)

        Every element sees the same ops in the same order, so the results do not change;
        only the passes over memory do (one read and write per tensor instead of one per op).
        """
        n = self.num_models
        width = tensors[0].numel() // n
        columns = max(64, block_numel // n // 64 * 64)  # whole vectors per row of a block
        rows = [t.view(n, width) for t in tensors]
        scratch = [self._scratch(tensors[0], k).view(-1) for k in range(scratch_slots)]
        for start in range(0, width, columns):
            c = min(columns, width - start)
            yield ([t[:, start:start + c] for t in rows],
                   [s[: n * c].view(n, c) for s in scratch])

    def _row_chunks(self, tensors: list[Tensor], chunk_numel: int
                    ) -> tuple[list[int], list[tuple[Tensor, ...]]]:
        """Model by model, consecutive 1-D pieces of each row of every tensor's
        ``[N, numel / N]`` view (all shaped like ``tensors[0]`` and contiguous)::

            whole tensors:  op1 over P, op2 over P, ...          (each pass from memory)
            in row chunks:  op1, op2, ... over P[0, 0:c], P[0, c:2c], ..., P[N-1, ...]

        Returns ``(sizes, pieces)``: ``sizes`` one row's piece sizes (whole multiples of 64
        elements of ``chunk_numel`` float32 elements' bytes, the last ragged) and
        ``pieces[t][i * len(sizes) + j]`` tensor ``t``'s piece ``j`` of model ``i``'s row.
        Within a piece every element is model ``i``'s, so an update can call stock's very
        ops with model ``i``'s values as Python scalars, on contiguous memory in cache.
        Every piece but a row's last is a whole number of the kernels' vector steps, so
        each element meets the vectorised or the scalar-tail code exactly as in stock's
        call over model ``i``'s tensor: the same ops, the same rounding.
        """
        width = tensors[0].numel() // self.num_models
        chunk = max(64, chunk_numel * 4 // tensors[0].element_size() // 64 * 64)
        sizes = [chunk] * (width // chunk) + ([width % chunk] if width % chunk else [])
        # All pieces of a tensor in one call (cheaper than a slice per piece).
        return sizes, [t.view(-1).split(sizes * self.num_models) for t in tensors]

    def _row_scratch(self, like: Tensor, numel: int, slots: int) -> list[Tensor]:
        """``slots`` reusable ``numel``-element buffers in ``like``'s dtype (for the
        updates in :meth:`_row_chunks`: small enough to stay in cache)."""
        buffers = self.__dict__.setdefault("_row_scratch_buffers", {})
        key = (like.dtype, like.device)
        buf = buffers.get(key)
        if buf is None or buf.numel() < slots * numel:
            buf = buffers[key] = torch.empty(slots * numel, dtype=like.dtype,
                                             device=like.device)
        return [buf[k * numel:(k + 1) * numel] for k in range(slots)]

    def _row_scalars(self, dtype: torch.dtype, rows: list[list[float]]) -> list[tuple]:
        """Model i's values of ``rows`` (the operands of ``mul_``, ``div_``, ``add_``) as
        ``scalars[i]``: in float32 / float64 as 0-dim tensors of ``dtype``, made once per
        step for all parameters (a Python float is wrapped and cast to the tensor's dtype on
        every call; the 0-dim tensor is the same CPU scalar to the kernel), else the floats."""
        per_model = list(zip(*rows))
        if dtype not in (torch.float32, torch.float64):
            return per_model
        cache = self.__dict__.setdefault("_row_scalar_cache", {})
        key = array("d", [v for row in rows for v in row]).tobytes()  # bit for bit: -0.0
        hit = cache.get(dtype)
        if hit is None or hit[0] != key:
            values = torch.tensor(per_model, dtype=dtype)
            hit = cache[dtype] = (key, [tuple(row.unbind()) for row in values])
        return hit[1]

    def _coefficients(self, values: dict[str, Sequence[float]]) -> Coefficients:
        """``Coefficients(values)``, the very object of the last step while the values stay
        the same (compared bit for bit, so ``-0.0`` is not ``0.0``): its per-model tensors
        and their views are then made once, not on every step (on a GPU also one
        host-to-device copy per step).  One cache entry per set of row names, i.e. per
        call site; a scheduler's change misses once and replaces the entry."""
        cache = self.__dict__.setdefault("_coefficient_cache", {})
        names = tuple(values)
        persistent = self._capturable()
        if persistent:  # one entry per param group (their values differ)
            names = (self.__dict__.get("_group_in_update", 0), *names)
        key = tuple(array("d", row).tobytes() for row in values.values())
        hit = cache.get(names)
        if hit is not None and hit[0] == key:
            return hit[1]
        if persistent and hit is not None and hit[1].persistent:
            hit[1].assign(values)  # in place: a captured step reads the same tensors
            cache[names] = (key, hit[1])
            return hit[1]
        coef = Coefficients(values, persistent)
        cache[names] = (key, coef)
        return coef

    def _new_steps(self, p: Tensor) -> Tensor:
        """Zero step counts, one per model, where and as stock keeps them: on the
        parameter's device with ``capturable=True`` or ``fused=True`` (the CUDA kernels
        read them there), float32 for the fused kernels."""
        fused = self._flag("fused")
        dtype = torch.float32 if fused else scalar_dtype()
        device = p.device if fused or self._capturable() else None
        return torch.zeros(self.num_models, dtype=dtype, device=device)

    # -------------------------------------------------------- capturable steps

    @property
    def is_capturable(self) -> bool:
        """Whether :meth:`step` can be captured in a CUDA graph (``hftc.compile_step``
        captures it then): see :meth:`refresh_hyperparameters`.  Not where a parameter
        takes each model's stock update (:meth:`_update_by_stock`, half and complex
        dtypes: its values are host numbers), so ``compile_step`` runs the step after
        the graph."""
        return self._capturable() and not (self._stock is not None and any(
            _takes_stock_update(p) for p in self.param_groups[0]["params"]))

    def _capturable(self) -> bool:
        """Whether the step is graph-safe: coefficient tensors made once and refreshed in
        place, every per-model value a tensor, step counts on the parameters' device, no
        host sync.  ``capturable=True`` where the stock class takes that flag; subclasses
        whose stock class has none (SGD) decide otherwise."""
        return "capturable" in self._flags and self._flag("capturable")

    def _coefficient_rows(self, hp: dict[str, list[Any]]) -> dict[str, list[float]]:
        """The per-model coefficient rows a capturable step reads (``_coefficients``)."""
        raise NotImplementedError

    def _switches(self, hp: dict[str, list[Any]]) -> dict[str, list[bool]]:
        """What picks the ops of a capturable step rather than their values: every flag
        and which values are zero (a weight decay or momentum of 0 drops its ops).  A
        captured graph replays the ops of its capture, so these may not change."""
        out = {}
        for key, kind in self._hyperparameters.items():
            if kind == "flag":
                out[key] = list(hp[key])
            elif key in ("weight_decay", "momentum"):
                out[key] = [v != 0 for v in hp[key]]
        return out

    def refresh_hyperparameters(self) -> None:
        """Copy the current values of ``param_groups`` (which schedulers write) into the
        step's coefficient tensors in place, without reallocating them: a CUDA graph that
        captured ``step()`` then replays it with the new values.  Call it before each
        replay (``hftc.compile_step`` does).

        Raises ``FusionArgumentError`` if the optimizer is not capturable, or if a value
        changed that picks the step's ops (a flag such as ``nesterov`` or ``amsgrad``, a
        weight decay or momentum to or from 0): the captured graph cannot follow that;
        capture the step again."""
        cls = type(self).__name__
        if not self._capturable():
            raise FusionArgumentError(
                f"{cls}.refresh_hyperparameters: this optimizer's step is not capturable "
                f"(it reads its values on the host at every step); construct it with "
                f"capturable=True" + (" (SGD: with its parameters on a CUDA device)"
                                      if "capturable" not in self._flags else ""))
        hp = self.hyperparameters()
        captured = self.__dict__.get("_captured_switches", {})
        for k, overrides in enumerate(self._group_overrides):
            group_hp = {**hp, **overrides}
            before, now = captured.get(k), self._switches(group_hp)
            if before is not None and before != now:
                changed = sorted(key for key in now if now[key] != before[key])
                values = ", ".join(f"{key}: {before[key]} -> {now[key]}" for key in changed)
                raise FusionArgumentError(
                    f"{cls}.refresh_hyperparameters: {', '.join(changed)} changed since the "
                    f"step was captured ({values}); "
                    f"they pick the step's ops, which a captured graph replays unchanged. "
                    f"Run optimizer.step() eagerly and capture it again")
            self._group_in_update = k
            self._coefficients(self._coefficient_rows(group_hp))

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

    def _import_model_state(self, p: Tensor, model: int, stock_state: dict[str, Any]) -> None:
        """Copy a stock optimizer's ``state[p_i]`` into slice ``model`` of ``state[p]``."""
        state = self.state[p]
        for key, value in stock_state.items():
            if value is None:
                continue
            if key not in state:
                raise ValueError(
                    f"{type(self).__name__}: the stock optimizer of model {model} has state "
                    f"{key!r}, which {type(self).__name__} does not keep"
                )
            if key == "step":
                state["step"][model] = float(value)
            else:
                copy_model_state(state[key][model], value, getattr(p, "_hftc_width_blocks", 1))

