"""Per-model training utilities: gradient clipping and losses over N stacked outputs.

Nothing here mixes models: each model's gradients are clipped by its own norm,
and ``per_model`` gives one loss per model, so a model that diverges cannot
change another's numbers.  Stock ``clip_grad_norm_`` on a fused module would clip
all N models by one global norm: ``import hftc`` makes
``torch.nn.utils.clip_grad_norm_`` clip a fused module's parameters per model (the
replacements of torch's functions are defined here and installed by :mod:`hftc.patches`).

``per_model`` is defined in :mod:`hftc.lowering.runtime.losses` (the fused graph calls it for a
loss traced inside a model) and public here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .errors import FusionArgumentError
from .lowering.runtime.losses import per_model
from .lowering.runtime.modules import StackedModule, live_stacked, stacked_counts
from .module.fused import FusedModule

__all__ = ["clip_grad_norm_", "clip_grad_value_", "per_model"]


# --------------------------------------------------------------------------- torch's own clipping

def _stock_twin(function: Any) -> Any:
    """A new function object that runs what torch's ``function`` runs now: the one hftc's
    replacement calls for other parameters, once :func:`route_bound_names` has made
    ``function`` itself call the replacement (no recursion through it)."""
    cell = _func_cell(function)
    if cell is None:
        return function
    raw = cell.cell_contents

    @functools.wraps(raw)
    def stock(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return raw(*args, **kwargs)
    return stock


def _func_cell(function: Any) -> Any:
    """The closure cell of torch's ``_no_grad`` wrapper that holds the wrapped function
    (None for another shape of function: another torch's)."""
    names = getattr(getattr(function, "__code__", None), "co_freevars", ())
    if "func" not in names or function.__closure__ is None:
        return None
    return function.__closure__[names.index("func")]


_torch_clip_grad_norm_ = _stock_twin(torch.nn.utils.clip_grad_norm_)


def _one_model_max_norm(max_norm: Any, called: str = "clip_grad_norm_ got {} max_norm") -> Any:
    """``max_norm`` for one model's (unfused) parameters: a list of one value per model is
    that value, so code written for a fused module (``[p["clip"] for p in params]``) runs
    on a stock model too (a sweep's train_step alone: ``train_alone``, ``--serial``)."""
    if isinstance(max_norm, Tensor) and max_norm.dim() == 1 or isinstance(max_norm,
                                                                          (list, tuple)):
        if len(max_norm) != 1:
            raise FusionArgumentError(
                f"torch.nn.utils.{called.format(len(max_norm))} values (one per model) for "
                f"parameters that are not a fused module's: one model's take one")
        return float(max_norm[0])
    return max_norm


@functools.wraps(_torch_clip_grad_norm_)
def _clip_grad_norm_per_model(parameters: Tensor | Iterable[Tensor], max_norm: float,
                              norm_type: float = 2.0, error_if_nonfinite: bool = False,
                              foreach: bool | None = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` as installed by ``import hftc``: on a fused
    module's parameters it clips each model by its own norm (:func:`clip_grad_norm_`)
    and returns the N norms, so the habit ``clip_grad_norm_(model.parameters(), 1.0)``
    trains each model as it trained alone; one norm over all N models would make each
    model's step depend on the others'.  Other parameters: torch's own, unchanged."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    stacked = [n is not None for n in stacked_counts(params)]
    if not any(stacked):
        return _torch_clip_grad_norm_(params, _one_model_max_norm(max_norm), norm_type,
                                      error_if_nonfinite, foreach)
    if not all(stacked):
        raise FusionArgumentError(
            "torch.nn.utils.clip_grad_norm_ got a fused module's stacked parameters together "
            "with other parameters; clip the fused ones on their own (each model by its own "
            "norm: hftc.utils.clip_grad_norm_) and the others apart")
    return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)


_torch_clip_grad_value_ = _stock_twin(torch.nn.utils.clip_grad_value_)


@functools.wraps(_torch_clip_grad_value_)
def _clip_grad_value_per_model(parameters: Tensor | Iterable[Tensor], clip_value: Any,
                               foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_`` as installed by ``import hftc``: on a fused
    module's parameters, one value per model (``clip_grad_value_(model.parameters(),
    [0.5, 1.0, 5.0])``, as ``clip_grad_norm_`` takes them; torch failed in ``float()`` of
    the list) clamps model i's by value i (:func:`clip_grad_value_`). One value, or other
    parameters: torch's own (an elementwise clamp is each model's already)."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    counts = stacked_counts(params)
    stacked = [n is not None for n in counts]
    per_model = isinstance(clip_value, (list, tuple)) or (
        isinstance(clip_value, Tensor) and clip_value.dim() == 1)
    if not any(stacked) or not per_model:
        value = (_one_model_max_norm(clip_value, "clip_grad_value_ got {} clip_value")
                 if not any(stacked) else clip_value)
        return _torch_clip_grad_value_(params, value, foreach)
    if not all(stacked):
        raise FusionArgumentError(
            "torch.nn.utils.clip_grad_value_ got a fused module's stacked parameters together "
            "with other parameters and one clip value per model; clip the fused ones on their "
            "own (hftc.utils.clip_grad_value_) and the others apart")
    return clip_grad_value_(params, clip_value, num_models=next(n for n in counts if n))


# torch's two-step form of clip_grad_norm_: ``total = get_total_norm(grads)`` then
# ``clip_grads_with_norm_(params, max_norm, total)``.  Gradients carry no mark of their
# own: the live fused modules' parameters (``FUSED_MODULES``) recognise theirs.


def _stacked_gradients(tensors: Sequence[Tensor]) -> list[tuple[Tensor, int]]:
    """The stacked parameters whose ``.grad`` is among ``tensors``, with their N."""
    ids = {id(t) for t in tensors}
    return [(p, n) for p, n in live_stacked().values()
            if p.grad is not None and id(p.grad) in ids]


_torch_get_total_norm = _stock_twin(torch.nn.utils.get_total_norm)
_torch_clip_grads_with_norm_ = _stock_twin(torch.nn.utils.clip_grads_with_norm_)


@functools.wraps(_torch_get_total_norm)
def _get_total_norm_per_model(tensors: Tensor | Iterable[Tensor], norm_type: float = 2.0,
                              error_if_nonfinite: bool = False,
                              foreach: bool | None = None) -> Tensor:
    """``torch.nn.utils.get_total_norm`` as installed by ``import hftc``: on the gradients
    of a fused module's stacked parameters it returns each model's norm (``[N]``), which
    ``clip_grads_with_norm_`` then applies per model.  Other tensors: torch's own."""
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    owners = _stacked_gradients(tensors)
    if not owners:
        return _torch_get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    counts = {n for _, n in owners}
    if len(owners) != len(tensors) or len(counts) > 1:
        raise FusionArgumentError(
            "torch.nn.utils.get_total_norm got the gradients of a fused module's stacked "
            "parameters together with other tensors (or with another fused module's); take "
            "the fused ones' norms on their own (one per model) and the others apart")
    return _per_model_norms(tensors, counts.pop(), norm_type, error_if_nonfinite)


@functools.wraps(_torch_clip_grads_with_norm_)
def _clip_grads_with_norm_per_model(parameters: Tensor | Iterable[Tensor], max_norm: float,
                                    total_norm: Tensor, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` as installed by ``import hftc``: on a fused
    module's stacked parameters ``total_norm`` must hold each model's norm (``[N]``, as
    ``get_total_norm`` returns for their gradients); one norm for all N models would
    clip each model by the others' gradients, and is refused.  Other parameters: torch's."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    numbers = stacked_counts(params)
    if all(n is None for n in numbers):
        return _torch_clip_grads_with_norm_(params, _one_model_max_norm(max_norm), total_norm,
                                            foreach)
    counts = set(numbers)
    if None in counts or len(counts) > 1:
        raise FusionArgumentError(
            "torch.nn.utils.clip_grads_with_norm_ got a fused module's stacked parameters "
            "together with other parameters; clip the fused ones on their own and the others "
            "apart")
    n = counts.pop()
    total = torch.as_tensor(total_norm)
    if total.numel() != n:
        raise FusionArgumentError(
            f"torch.nn.utils.clip_grads_with_norm_ on a fused module's parameters needs each "
            f"model's norm ({n} values), got a total_norm of {total.numel()} value(s): one "
            f"norm over all models would clip each model by the others' gradients. Take it "
            f"with torch.nn.utils.get_total_norm of the fused gradients (per model after "
            f"import hftc), or call torch.nn.utils.clip_grad_norm_(fused.parameters(), "
            f"max_norm)")
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        _clip_by_norms(grads, max_norm, total.reshape(n).to(grads[0].device))


def route_bound_names() -> None:
    """Make torch's own clipping function objects clip a fused module per model too, and
    torch's ``update_bn`` recompute a fused module's statistics per model (``from
    torch.optim.swa_utils import AveragedModel, SWALR, update_bn``, the SWA tutorial's
    line, above ``import hftc`` recomputed none, silently).

    ``from torch.nn.utils import clip_grad_norm_`` above ``import hftc`` (the convert
    guide adds ``import hftc`` below a script's imports) binds torch's function object,
    which the patch of ``torch.nn.utils``' names does not reach: it clipped all N models
    by one norm, silently.  Each of torch's three is a ``_no_grad`` wrapper; its cell
    holding the wrapped function now holds hftc's replacement (which calls its stock
    twin above for other parameters), so the name bound early, torch's own
    ``clip_grad_norm_`` body (which calls the other two) and the patched names agree."""
    for original, replacement in (
            (torch.nn.utils.clip_grad.clip_grad_norm_, _clip_grad_norm_per_model),
            (torch.nn.utils.clip_grad._get_total_norm, _get_total_norm_per_model),
            (torch.nn.utils.clip_grad.clip_grad_value_, _clip_grad_value_per_model),
            (torch.nn.utils.clip_grad._clip_grads_with_norm_,
             _clip_grads_with_norm_per_model),
            (torch.optim.swa_utils.update_bn, _update_bn_per_model)):
        if original is replacement:
            continue
        cell = _func_cell(original)
        if cell is not None:
            cell.cell_contents = replacement


def skipping_stacked_weights(torch_convert: Any) -> Any:
    """``torch.nn.utils.convert_conv2d_weight_memory_format`` (or the conv3d one) as
    installed by ``import hftc``: a fused module's stacked convolutions are left as they
    are, as ``fused.to(memory_format=...)`` leaves them (a stacked Conv2d weight is 5-d,
    ``[N, O, I, kh, kw]``, and torch's raised "required rank 4 tensor to use
    channels_last format"); the fused kernels choose their layouts per call.  Torch's
    own recursion calls the patched name, so a stacked module deep in a model is
    skipped too; every other module is converted by torch's."""
    @functools.wraps(torch_convert)
    def convert(module: nn.Module, memory_format: torch.memory_format) -> nn.Module:
        if not isinstance(module, StackedModule):
            return torch_convert(module, memory_format)
        for child in module.children():
            convert(child, memory_format)
        return module

    return convert


_torch_update_bn = _stock_twin(torch.optim.swa_utils.update_bn)


@functools.wraps(_torch_update_bn)
def _update_bn_per_model(loader: Any, model: nn.Module, device: Any = None) -> None:
    """``torch.optim.swa_utils.update_bn`` as installed by ``import hftc``: on a fused
    module with batch norms (or an ``AveragedModel`` of one, the SWA tutorial's
    ``update_bn(loader, swa_model)``) each model's statistics are recomputed by torch's
    own ``update_bn`` on that model alone (a pass over ``loader`` per model) and written
    into its row of the fused module's buffers, so ``swa_model(x)`` then predicts with
    them, as each model's own run would.  Torch's, over the fused module, would set the
    stacked norms' ``momentum`` (one value the fused program bakes in per model).  A fused
    module inside a module of the user's is refused, saying where to call it."""
    fused = model.module if isinstance(model, torch.optim.swa_utils.AveragedModel) else model
    norms = [name for name, m in fused.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    stacked = any(n is not None for n in stacked_counts(list(fused.parameters()))) or any(
        isinstance(m, FusedModule) for m in fused.modules())
    if not stacked or not norms:
        return _torch_update_bn(loader, model, device)
    if not isinstance(fused, FusedModule):
        raise FusionArgumentError(
            f"torch.optim.swa_utils.update_bn: {type(fused).__name__} holds a fused module "
            f"with batch norms inside it; call update_bn(loader, fused) on the fused module "
            f"itself (or on AveragedModel(fused)), which recomputes each model's statistics")
    if getattr(fused, "padding", None) is not None:
        raise FusionArgumentError(
            "torch.optim.swa_utils.update_bn: the fused module was fused with "
            "pad_widths=True, whose batch norms hold each model's statistics padded to the "
            "widest model; recompute them on the models themselves and use those: models "
            "= fused.unfuse(), then update_bn(loader, m) for each m in models")
    models = fused.unfuse()
    # One pass over the loader, each batch through every model: the batches model i's own
    # update_bn would see (a shuffling loader iterated N times would deal others).
    _torch_update_bn(loader, _EachModel(models), device)
    with torch.no_grad():
        for row, one in enumerate(models):
            for norm in norms:
                for name, buffer in one.get_submodule(norm).named_buffers(recurse=False):
                    fused.get_buffer(f"{norm}.{name}")[row].copy_(buffer)


class _EachModel(nn.Module):
    """The unfused models as one module whose forward runs each on the input (what
    torch's ``update_bn`` calls per batch)."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, x: Any) -> None:
        for model in self.models:
            model(x)


_torch_update_parameters = torch.optim.swa_utils.AveragedModel.update_parameters


@functools.wraps(_torch_update_parameters)
def _update_parameters_checking_models(self: Any, model: nn.Module) -> None:
    """``AveragedModel.update_parameters`` as installed by ``import hftc``: an average of a
    fused module's N models, updated from the fused module after ``hftc.keep_models``
    (``hftc.EarlyStopping``) dropped some, would broadcast the kept models' stacked
    weights over every model's average (``[1, ...]`` into ``[N, ...]``) or fail on a
    shape.  Refused, naming the models on each side and how to cut the average too."""
    averaged = getattr(getattr(self, "module", None), "model_ids", None)
    training = getattr(model, "model_ids", None)
    if averaged is not None and training is not None and list(averaged) != list(training):
        kept = [averaged.index(i) for i in training if i in averaged]
        cut = (f"save the averages of the models that left (ema.module.model_state_dict(j), "
               f"j their positions), then cut it as the array was: "
               f"hftc.keep_models(ema.module, {kept})" if len(kept) == len(training) else
               "make a new AveragedModel of the fused module")
        raise FusionArgumentError(
            f"AveragedModel.update_parameters: the fused module holds models {list(training)} "
            f"(model_ids), this AveragedModel averages models {list(averaged)}; torch would "
            f"mix one model's weights into another's average. {cut[0].upper()}{cut[1:]}")
    return _torch_update_parameters(self, model)


def _grads_and_num_models(parameters, num_models: int | None, fn: str) -> tuple[list[Tensor], int]:
    if isinstance(parameters, nn.Module):
        if num_models is None:
            num_models = getattr(parameters, "num_models", None)
        parameters = parameters.parameters()
    elif isinstance(parameters, Tensor):
        parameters = [parameters]
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    leading = {g.shape[0] if g.dim() > 0 else None for g in grads}
    if None in leading:
        raise FusionArgumentError(f"{fn}: a gradient is 0-dim; fused gradients are [N, *shape]")
    if len(leading) > 1:
        raise FusionArgumentError(
            f"{fn}: gradients must all be [N, *shape] with one N, but their leading dims "
            f"are {sorted(leading)}"
        )
    if num_models is None:
        if not leading:
            raise FusionArgumentError(f"{fn}: no gradients, and num_models was not given")
        num_models = leading.pop()
    elif leading and leading != {num_models}:
        raise FusionArgumentError(
            f"{fn}: num_models={num_models}, but the gradients' leading dim is {leading.pop()}"
        )
    return grads, num_models


def _per_model_values(name: str, value: float | Sequence[float] | Tensor, n: int,
                      like: Tensor) -> Tensor:
    """A scalar or N values, as a [N] tensor in ``like``'s dtype and device."""
    t = torch.as_tensor(value, dtype=torch.float64).reshape(-1)
    if t.numel() == 1:
        t = t.expand(n)
    elif t.numel() != n:
        raise FusionArgumentError(f"{name} has {t.numel()} values but there are {n} models")
    return t.to(device=like.device, dtype=like.dtype)


def _broadcast(v: Tensor, like: Tensor) -> Tensor:
    return v.view(-1, *([1] * (like.dim() - 1)))


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | Tensor | Iterable[Tensor],
    max_norm: float | Sequence[float],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    num_models: int | None = None,
) -> Tensor:
    """Clip each model's gradients by its own total norm; return the N norms.

    ``torch.nn.utils.clip_grad_norm_`` applied to each model separately, in one
    pass over the stacked ``[N, *shape]`` gradients::

        norms = hftc.utils.clip_grad_norm_(fused, max_norm=1.0)     # tensor [N]
        # model i's grads *= min(1, max_norm / (norms[i] + 1e-6))

    Args:
        parameters: a fused module, or its (stacked) parameters.
        max_norm: one value, or one per model.
        norm_type: as in torch (``float("inf")`` for the max norm).
        error_if_nonfinite: raise if some model's norm is NaN or inf (names them);
            otherwise such a model's gradients become NaN / 0 and no other model's change.
        num_models: N, if it cannot be read from ``parameters``.
    """
    grads, n = _grads_and_num_models(parameters, num_models, "clip_grad_norm_")
    if not grads:
        return torch.zeros(n)
    total = _per_model_norms(grads, n, norm_type, error_if_nonfinite)
    _clip_by_norms(grads, max_norm, total)
    return total


def _per_model_norms(grads: Sequence[Tensor], n: int, norm_type: float,
                     error_if_nonfinite: bool) -> Tensor:
    """Each model's total gradient norm ([N]) over stacked ``[N, *shape]`` gradients."""
    norm_type = float(norm_type)
    device = grads[0].device
    # Per parameter, each model's norm ([N]); then each model's norm over its parameters.
    norms = [torch.linalg.vector_norm(g.reshape(n, -1), norm_type, dim=1).to(device)
             for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms, dim=1), norm_type, dim=1)
    if error_if_nonfinite:
        bad = (~torch.isfinite(total)).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients of model(s) {bad} is "
                f"non-finite, so they cannot be clipped. To leave them as they are, set "
                f"error_if_nonfinite=False"
            )
    return total


def _clip_by_norms(grads: Sequence[Tensor], max_norm: float | Sequence[float],
                   total: Tensor) -> None:
    """Scale model i's gradients by ``min(1, max_norm_i / (total[i] + 1e-6))``."""
    limit = _per_model_values("max_norm", max_norm, total.numel(), total)
    coef = torch.clamp(limit / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(_broadcast(coef.to(device=g.device, dtype=g.dtype), g))


@torch.no_grad()
def clip_grad_value_(
    parameters: nn.Module | Tensor | Iterable[Tensor],
    clip_value: float | Sequence[float],
    *,
    num_models: int | None = None,
) -> None:
    """Clamp each model's gradients to ``[-clip_value_i, clip_value_i]``.

    ``torch.nn.utils.clip_grad_value_`` with one value, or one per model::

        hftc.utils.clip_grad_value_(fused, [0.5, 1.0, 5.0])
    """
    grads, n = _grads_and_num_models(parameters, num_models, "clip_grad_value_")
    if not isinstance(clip_value, (Sequence, Tensor)):
        for g in grads:
            g.clamp_(min=-float(clip_value), max=float(clip_value))
        return
    for g in grads:
        c = _broadcast(_per_model_values("clip_value", clip_value, n, g), g)
        g.clamp_(min=-c, max=c)
