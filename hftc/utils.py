"""Per-model training utilities: gradient clipping and losses over N stacked outputs.

Nothing here mixes models: each model's gradients are clipped by its own norm,
and ``per_model`` gives one loss per model, so a model that diverges cannot
change another's numbers.  Stock ``clip_grad_norm_`` on a fused module would clip
all N models by one global norm: ``import hftc`` makes
``torch.nn.utils.clip_grad_norm_`` clip a fused module's parameters per model.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import FusionArgumentError, FusionTypeError
from .lowering.kernels import short_row_cross_entropy

__all__ = ["clip_grad_norm_", "clip_grad_value_", "per_model"]


def values_on(values: Sequence[float] | Sequence[Sequence[float]], dtype: torch.dtype,
              device: torch.device) -> Tensor:
    """Python numbers as a tensor on ``device`` without stalling a GPU.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which
    synchronizes the stream: the CPU would wait for every queued kernel (the whole
    backward) before issuing the next op. From pinned memory the copy is queued like a
    kernel. The values are made float64 first and cast on the device, so the result is
    what ``torch.tensor(values, dtype=dtype)`` gives on the CPU.
    """
    host = torch.tensor(values, dtype=torch.float64)
    if torch.device(device).type != "cuda":
        return host.to(device=device, dtype=dtype)
    return host.pin_memory().to(device=device, non_blocking=True).to(dtype)


# --------------------------------------------------------------------------- torch's own clipping

#: The attribute that marks a fused module's stacked parameters (``FusedModule`` sets it
#: to N): what ``torch.nn.utils.clip_grad_norm_`` clips per model.  An attribute of the
#: tensor, so deepcopy, pickling and ``.to()`` keep it.
STACKED_MARK = "_hftc_num_models"


#: The live fused modules (weakly): their parameters are stacked whatever their marks say
#: (``load_state_dict(..., assign=True)`` puts in new Parameter objects), and the gradients
#: torch's two-step clipping gets carry no mark of their own.  Modules, not their
#: tensors: ``torch.utils.swap_tensors`` (``.to()`` under
#: ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``load_state_dict``)
#: refuses a tensor that has a weak reference.
_FUSED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def register_fused(module: nn.Module) -> None:
    """Count ``module``'s parameters as stacked from now on (``FusedModule`` calls it)."""
    _FUSED_MODULES.add(module)


def _live_stacked() -> dict[int, tuple[Tensor, int]]:
    """``id(parameter) -> (parameter, N)`` for every live fused module's parameters."""
    return {id(p): (p, module.num_models) for module in list(_FUSED_MODULES)
            for p in module.parameters()}


def _num_models(p: Tensor, live: dict[int, tuple[Tensor, int]] | None = None) -> int | None:
    """N where ``p`` is a fused module's stacked parameter, else ``None``."""
    mark = getattr(p, STACKED_MARK, None)
    if mark is not None:
        return mark
    entry = (live if live is not None else _live_stacked()).get(id(p))
    return None if entry is None or entry[0] is not p else entry[1]


def _stacked_counts(params: Sequence[Tensor]) -> list[int | None]:
    live = None if all(_num_models(p, {}) is not None for p in params) else _live_stacked()
    return [_num_models(p, live) for p in params]


_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_


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
    stacked = [n is not None for n in _stacked_counts(params)]
    if not any(stacked):
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                      foreach)
    if not all(stacked):
        raise FusionArgumentError(
            "torch.nn.utils.clip_grad_norm_ got a fused module's stacked parameters together "
            "with other parameters; clip the fused ones on their own (each model by its own "
            "norm: hftc.utils.clip_grad_norm_) and the others apart")
    return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)


torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_per_model
torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_per_model

# torch's two-step form of clip_grad_norm_: ``total = get_total_norm(grads)`` then
# ``clip_grads_with_norm_(params, max_norm, total)``.  Gradients carry no mark of their
# own: the live fused modules' parameters (``_FUSED_MODULES``) recognise theirs.


def mark_stacked(p: Tensor, num_models: int) -> None:
    """Mark ``p`` as a fused module's stacked ``[N, ...]`` parameter (see ``STACKED_MARK``)."""
    setattr(p, STACKED_MARK, num_models)


def _stacked_gradients(tensors: Sequence[Tensor]) -> list[tuple[Tensor, int]]:
    """The stacked parameters whose ``.grad`` is among ``tensors``, with their N."""
    ids = {id(t) for t in tensors}
    return [(p, n) for p, n in _live_stacked().values()
            if p.grad is not None and id(p.grad) in ids]


_torch_get_total_norm = torch.nn.utils.get_total_norm
_torch_clip_grads_with_norm_ = torch.nn.utils.clip_grads_with_norm_


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
    numbers = _stacked_counts(params)
    if all(n is None for n in numbers):
        return _torch_clip_grads_with_norm_(params, max_norm, total_norm, foreach)
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


for _module in (torch.nn.utils, torch.nn.utils.clip_grad):
    _module.get_total_norm = _get_total_norm_per_model
    _module.clip_grads_with_norm_ = _clip_grads_with_norm_per_model


_torch_update_bn = torch.optim.swa_utils.update_bn


@functools.wraps(_torch_update_bn)
def _update_bn_refusing_fused(loader: Any, model: nn.Module, device: Any = None) -> None:
    """``torch.optim.swa_utils.update_bn`` as installed by ``import hftc``: it finds batch
    norms by type, and a fused module's are stacked tensors in ``StackedModule``s, so on
    one it would silently recompute nothing.  Refused there, saying what to do."""
    fused = any(n is not None for n in _stacked_counts(list(model.parameters())))
    if fused and any(name.endswith("running_mean") for name, _ in model.named_buffers()):
        raise FusionArgumentError(
            "torch.optim.swa_utils.update_bn finds batch norms by their class, and a fused "
            "module holds them as stacked tensors, so it would recompute no statistics. "
            "Recompute them per model on the unfused models: for m in "
            "fused.unfuse(): update_bn(loader, m) (for an AveragedModel, "
            "swa_model.module.unfuse())")
    return _torch_update_bn(loader, model, device)


torch.optim.swa_utils.update_bn = _update_bn_refusing_fused


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
        raise ValueError(f"{fn}: a gradient is 0-dim; fused gradients are [N, *shape]")
    if len(leading) > 1:
        raise ValueError(
            f"{fn}: gradients must all be [N, *shape] with one N, but their leading dims "
            f"are {sorted(leading)}"
        )
    if num_models is None:
        if not leading:
            raise ValueError(f"{fn}: no gradients, and num_models was not given")
        num_models = leading.pop()
    elif leading and leading != {num_models}:
        raise ValueError(
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
        raise ValueError(f"{name} has {t.numel()} values but there are {n} models")
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


# Losses whose reduction="none" result is one value per sample (or per element):
# the N models' batches can be flattened into one batch of N*B and reduced per model.
_ELEMENTWISE_LOSSES = {
    F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits, F.soft_margin_loss,
}
_CLASS_LOSSES = {F.cross_entropy, F.nll_loss}


def per_model(loss_fn: Callable[..., Tensor], *,
              in_dims: int | None | tuple[int | None, ...] = (0, None),
              **loss_kwargs: Any) -> Callable[..., Tensor]:
    """Turn a loss over one model's output into N losses over N stacked outputs.

    ``in_dims`` says which of the loss's positional parameters carry the model dim
    first (``0``) and which are shared by all models (``None``), as in
    ``torch.func.vmap``. The default ``(0, None)``: the first argument (the fused
    output ``[N, B, ...]``) is stacked, the second (the target) is shared; parameters
    past the end of ``in_dims`` are shared::

        loss_fn = hftc.per_model(F.cross_entropy)
        losses = loss_fn(out, y)          # out [N, B, C], y [B]  -> [N]
        losses.sum().backward()           # each model gets its own gradient

        hftc.per_model(F.mse_loss, in_dims=0)(out, y_stacked)   # y_stacked [N, B, D]
        hftc.per_model(F.nll_loss, reduction="sum")(out, y)     # [N]: each model's sum

    Keyword arguments, given here (``loss_kwargs``, as ``functools.partial`` binds
    them; a call's own override them) or to the call, bind to the loss's parameters as
    the loss binds them, and hold for each model's loss: ``losses[i]`` is
    ``loss_fn(out[i], y, **kwargs)``. A keyword the loss does not take raises a
    ``FusionTypeError`` here.  An argument passed by keyword takes the ``in_dims`` entry
    of its parameter's position (``(out, target=ys)`` with ``in_dims=(0, 0)`` stacks
    ``ys``, as ``(out, ys)`` does); with an int ``in_dims`` (vmap's: the arguments passed
    by position), a tensor passed by keyword to a positional parameter is refused as
    ambiguous (``FusionArgumentError``: pass it by position, or ``in_dims`` as a tuple).
    Other keywords (``reduction``, ``ignore_index``, a shared ``weight``) are shared.
    Where the loss has no signature to bind to (a builtin), keywords are shared.

    No Python loop for ``cross_entropy``, ``nll_loss`` (class-index targets, no
    ``weight``) and elementwise losses (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``,
    ``huber_loss``, ``binary_cross_entropy[_with_logits]``, ``soft_margin_loss``):
    the N batches are flattened into one, the loss is taken with
    ``reduction="none"`` and reduced per model. Other losses run under
    ``torch.func.vmap``, or, if vmap cannot run them, in a loop over models.
    Result: ``[N]`` for reduction ``"mean"`` / ``"sum"``; ``[N, ...]`` for ``"none"``.
    """
    for d in in_dims if isinstance(in_dims, tuple) else (in_dims,):
        if d not in (0, None):
            raise ValueError(f"per_model: in_dims entries must be 0 or None, got {in_dims}")
    signature = _loss_signature(loss_fn)
    if signature is not None and loss_kwargs:
        try:
            signature.bind_partial(**loss_kwargs)
        except TypeError as exc:
            name = _loss_name(loss_fn)
            where = (f"set it where the loss module is built ({type(loss_fn).__name__}"
                     f"({next(iter(loss_kwargs))}=...))" if isinstance(loss_fn, nn.Module)
                     else "pass only keywords the loss takes")
            raise FusionTypeError(
                f"per_model({name}, {', '.join(f'{k}=...' for k in loss_kwargs)}): {exc} "
                f"(its parameters: {', '.join(signature.parameters)}); {where}") from exc

    @functools.wraps(loss_fn)
    def losses(*args: Any, **kwargs: Any) -> Tensor:
        args, kwargs, dims = _bind_loss_arguments(
            loss_fn, signature, in_dims, args, {**loss_kwargs, **kwargs})
        stacked = [a for a, d in zip(args, dims) if d == 0]
        if not stacked:
            raise ValueError("per_model: in_dims marks no argument as stacked (0)")
        for a in stacked:
            if not isinstance(a, Tensor):
                raise ValueError(
                    f"per_model: an argument marked 0 in in_dims is a {type(a).__name__}, "
                    f"not a tensor; a fused module's output with several fields (a dict, "
                    f"a ModelOutput, a tuple) is stacked field by field: pass the one the "
                    f"loss takes (out['logits'], out.logits, out[0])")
        n = stacked[0].shape[0] if stacked[0].dim() else None
        for a in stacked:
            if a.dim() == 0 or a.shape[0] != n:
                raise ValueError(
                    f"per_model: every argument marked 0 in in_dims must be a tensor with "
                    f"leading dim N = {n}; got shape {getattr(a, 'shape', type(a).__name__)}"
                )
        fast = _flattened_loss(loss_fn, args, dims, n, kwargs)
        if fast is not None:
            return fast
        # A loss module that updates its buffers per call (a running average of itself)
        # would update them once for all N under vmap, or partly, in an attempt that
        # fails midway: its buffers (a loss module's are small) are put back and it runs
        # in the loop, N calls, as the models' losses would.  Buffers it only reads (a
        # class weight) leave vmap's result as it is.
        buffers = list(loss_fn.buffers()) if isinstance(loss_fn, nn.Module) else []
        kept = [(b, b._version, b.detach().clone()) for b in buffers]
        try:
            with warnings.catch_warnings():
                # vmap's "performance drop ... no batching rule" for ops it runs in a loop
                # of its own, on every call: per_model's documented way, not news.
                warnings.filterwarnings("ignore", message="There is a performance drop")
                out = torch.func.vmap(functools.partial(loss_fn, **kwargs),
                                      in_dims=dims)(*args)
        except Exception:  # noqa: BLE001 - vmap cannot run every function (.item()): a loop can
            out = None
        if any(b._version != version for b, version, _ in kept):
            with torch.no_grad():
                for b, _, saved in kept:
                    b.copy_(saved)
            out = None
        if out is not None:
            return out
        outs = [loss_fn(*[a[i] if d == 0 else a for a, d in zip(args, dims)], **kwargs)
                for i in range(n)]
        return torch.stack(outs)

    return losses


def _loss_name(loss_fn: Callable[..., Tensor]) -> str:
    return getattr(loss_fn, "__name__", type(loss_fn).__name__)


def _loss_signature(loss_fn: Callable[..., Tensor]) -> inspect.Signature | None:
    """The loss's signature (a module's: its ``forward``'s), or None where Python has none
    (builtins)."""
    try:
        return inspect.signature(loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn)
    except (TypeError, ValueError):
        return None


def _bind_loss_arguments(loss_fn, signature: inspect.Signature | None, in_dims,
                         args: tuple[Any, ...], kwargs: dict[str, Any]
                         ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[int | None, ...]]:
    """``(args, kwargs, dims)`` for one call: the arguments bound to the loss's parameters
    as the loss binds them, and each positional argument's in_dims entry::

        nll_loss(out, target=y, reduction="sum"), in_dims=(0, None)
            -> args (out, y), kwargs {"reduction": "sum"}, dims (0, None)

    An argument passed by keyword to a positional parameter whose ``in_dims`` entry is 0
    is moved to its position (the parameters between it and the others passed by
    position take their defaults), so that it is stacked as if passed by position.
    A wrong call raises the loss's own ``TypeError`` here, before anything runs."""
    if signature is not None and kwargs:  # (positional arguments alone bind as given)
        bound = signature.bind(*args, **kwargs)  # missing or doubled arguments: the loss's error
        positional = [p for p in signature.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        by_keyword = {p.name: k for k, p in enumerate(positional)
                      if k >= len(args) and p.name in kwargs}
        if not isinstance(in_dims, tuple):
            tensors = [name for name in by_keyword if isinstance(kwargs[name], Tensor)]
            if in_dims == 0 and tensors:
                raise FusionArgumentError(
                    f"per_model({_loss_name(loss_fn)}, in_dims=0): {', '.join(tensors)} "
                    f"passed by keyword; in_dims=0 stacks the arguments passed by position "
                    f"only, so it would be shared by all models. Pass it by position, or "
                    f"in_dims as a tuple per parameter ((0, 0) stacks "
                    f"{positional[1].name if len(positional) > 1 else 'the second'}, "
                    f"(0, None) shares it)")
        else:
            moved = [k for name, k in by_keyword.items()
                     if k < len(in_dims) and in_dims[k] == 0]
            if moved:
                last = max(moved)
                args = tuple(args) + tuple(
                    bound.arguments[p.name] if p.name in bound.arguments else p.default
                    for p in positional[len(args): last + 1])
                kwargs = {k: v for k, v in kwargs.items()
                          if k not in {p.name for p in positional[: last + 1]}}
    if isinstance(in_dims, tuple):
        dims = (in_dims + (None,) * len(args))[: len(args)]
    else:  # one int (or None) for every positional argument, as in vmap
        dims = (in_dims,) * len(args)
    return args, kwargs, dims


def _flattened_loss(loss_fn, args, dims, n: int, kwargs: dict[str, Any]) -> Tensor | None:
    """The N losses from one call on the flattened [N*B, ...] batch, or None if not applicable."""
    if len(args) != 2 or dims[0] != 0:
        return None
    reduction = kwargs.get("reduction", "mean")
    if reduction not in ("mean", "sum", "none") or kwargs.get("size_average") is not None \
            or kwargs.get("reduce") is not None:
        return None
    out, target = args
    if not isinstance(target, Tensor) or out.dim() < 3:
        return None  # no batch dim per model: nothing to flatten
    shared_target = target if dims[1] is None else None
    if shared_target is not None:
        target = target.expand(n, *target.shape)
    flat_out = out.reshape(n * out.shape[1], *out.shape[2:])
    flat_target = target.reshape(n * target.shape[1], *target.shape[2:])
    rest = {k: v for k, v in kwargs.items() if k != "reduction"}

    if loss_fn in _CLASS_LOSSES:
        class_indices = not target.is_floating_point()
        if rest.get("weight") is not None or not class_indices:
            return None  # weighted means and probability targets: vmap handles them
        if target.shape[1:] != out.shape[1:2] + out.shape[3:]:
            return None
        if loss_fn is F.cross_entropy and flat_out.dim() == 2 \
                and not rest.get("label_smoothing"):
            # Classes fewer than a SIMD vector's lanes (10 classes, N*B rows) make ATen's
            # CPU (log_)softmax slow: kernels.short_row_cross_entropy instead.
            losses = short_row_cross_entropy(flat_out, flat_target, n, reduction,
                                             rest.get("ignore_index", -100))
            if losses is not None:
                return losses.reshape(n, *target.shape[1:]) if reduction == "none" else losses
        per_sample = loss_fn(flat_out, flat_target, reduction="none", **rest).reshape(n, -1)
        if reduction == "none":
            return per_sample.reshape(n, *target.shape[1:])
        total = per_sample.sum(dim=1)
        if reduction == "sum":
            return total
        # torch's mean divides by the number of targets that are not ignore_index; a
        # shared target has one count for all N models (counted on its [B] values, not
        # on the N copies: at small N these few ops are a visible part of the step).
        ignore = rest.get("ignore_index", -100)
        if shared_target is not None:
            return total / (shared_target != ignore).sum()
        return total / (target.reshape(n, -1) != ignore).sum(dim=1)

    if loss_fn in _ELEMENTWISE_LOSSES:
        if target.shape != out.shape or any(rest.get(k) is not None
                                            for k in ("weight", "pos_weight")):
            return None
        per_element = loss_fn(flat_out, flat_target, reduction="none", **rest).reshape(n, -1)
        if reduction == "none":
            return per_element.reshape(out.shape)
        return per_element.sum(dim=1) if reduction == "sum" else per_element.mean(dim=1)
    return None
