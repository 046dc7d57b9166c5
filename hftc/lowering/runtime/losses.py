"""Per-model losses: N models' outputs and targets -> one loss per model, ``[N]``.

::

    before:  [loss_fn(out_n, target_n) for n in 0..N-1]
    after:   per_model(loss_fn)(out, target)   -> flattened into one batch of N*B where the
             loss is per sample (cross_entropy, mse_loss, ...), else vmap over the models

:func:`per_model` is the public ``hftc.per_model`` (re-exported by :mod:`hftc.utils`);
the fused graph calls :func:`per_model_loss` for a loss traced inside a model.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ...errors import FusionArgumentError, FusionError, FusionTypeError
from .function_apply import apply_function_fast
from .layout import model_slice
from .reduction import short_rows


def per_model_loss(fn: Callable[..., Tensor], output: Tensor, target: Any, *,
                   target_batched: bool, **kwargs: Any) -> Tensor:
    """``fn(output_i, target_i, **kwargs)`` for every model i, stacked: ``[N]`` for a
    reduced loss, what ``hftc.per_model(fn)`` computes (:mod:`hftc.passes.loss`)."""
    return per_model(fn, in_dims=(0, 0 if target_batched else None))(output, target, **kwargs)


def short_row_cross_entropy(x: Tensor, target: Tensor, num_models: int,
                            reduction: str = "mean", ignore_index: int = -100) -> Tensor | None:
    """N models' ``F.cross_entropy`` over rows of few classes, or ``None`` where
    :func:`short_rows` says ATen's kernels are the fast ones.

    ``x`` ``[R, C]`` float32 logits, the N models' batches flattened (``R = N*B``,
    model i's rows ``[i*B, (i+1)*B)``), ``target`` ``[R]`` class indices.  Returns each
    model's loss ``[N]`` for ``reduction`` ``"mean"`` or ``"sum"``, each row's ``[R]`` for
    ``"none"``.  :class:`_ShortRowCrossEntropy` computes what ATen's
    ``nll_loss(log_softmax(x))`` computes, in fewer whole-tensor passes, without
    ``log_softmax``'s ``[R, C]`` output, and with the reduction inside (one autograd
    node, not five)::

        ATen:  log_softmax (amax, sub, exp, sum, log, sub) -> nll_loss (gather)
               -> per model: view, sum, divide by the count
               backward: the reduction's, nll_loss's scatter into zeros [R, C], then
               log_softmax's g - exp(out) * g.sum(-1)
        here:  amax, sub, gather, exp_, sum -> log(sum) - picked -> per model: sum, div_
               backward: exp * (g_row / sum), scatter_add_ -g_row at the targets

    About twice as fast as ATen's on the MLP benchmark's loss (docs/DESIGN_NOTES.md).
    Within a rounding of ATen's (its sums run in another order), not bit for bit.
    """
    if not short_rows(x, 1) or x.dim() != 2 or target.dtype != torch.long \
            or target.shape != x.shape[:1] or x.shape[0] % num_models \
            or reduction not in ("mean", "sum", "none"):
        return None
    return apply_function_fast(_ShortRowCrossEntropy, x, target, num_models, reduction,
                               ignore_index)[0]


class _ShortRowCrossEntropy(torch.autograd.Function):
    """Cross-entropy over short rows (see :func:`short_row_cross_entropy`).

    Loss of row r with target t: ``log(sum_j exp(x_rj - m_r)) - (x_rt - m_r)``, ``m_r``
    the row's max, as ATen's ``-log_softmax(x)[r, t]``; 0 where t is ``ignore_index``.
    A model's mean divides its rows' sum by its rows that are not ignored, as ATen's.
    Gradient: ``g_r * (softmax(x_r) - onehot(t))`` with ``g_r`` the row's share of its
    model's gradient, 0 on ignored rows.  A double backward (``create_graph=True``) gets
    the same gradient in differentiable ops.

    The forward returns ``(loss, exp, total, index, ignored, counts)``: what the backward
    reads besides ``x``, made in the forward (``setup_context``, which ``torch.func``
    transforms need, sees only inputs and outputs), non-differentiable; callers take
    ``[0]``.  Under ``torch.func.vmap`` the vmapped dim joins the rows (``[V, R, C]`` ->
    ``[V*R, C]``, ``V*N`` models of ``R/N`` rows each) and the loss runs on that, once:
    whether some target is ignored is read from the values, which vmap cannot branch on.
    Called through :func:`apply_function_fast`.
    """

    @staticmethod
    def forward(x: Tensor, target: Tensor, num_models: int, reduction: str,
                ignore_index: int) -> tuple[Any, ...]:
        ignored = target == ignore_index
        # Eager: the masks only where some target is ignored (rare).  Under torch.compile
        # always, as reading the tensor's value in Python would break the graph there.
        if not torch.compiler.is_compiling() and not bool(ignored.any()):
            ignored = None
        index = (target if ignored is None else target.masked_fill(ignored, 0)).unsqueeze(1)
        shifted = x - x.amax(1, keepdim=True)
        picked = shifted.gather(1, index)
        exp = shifted.exp_()
        total = exp.sum(1, keepdim=True)
        loss = total.log().sub_(picked).squeeze(1)
        if ignored is not None:
            loss.masked_fill_(ignored, 0.0)
        counts: Tensor | int = x.shape[0] // num_models
        if reduction == "mean" and ignored is not None:
            counts = ignored.logical_not().view(num_models, -1).sum(1)
        if reduction != "none":
            loss = loss.view(num_models, -1).sum(1)
            if reduction == "mean":
                loss = loss.div_(counts)
        return loss, exp, total, index, ignored, counts

    @staticmethod
    def in_plain_ops(x: Tensor, target: Tensor, num_models: int, reduction: str,
                     ignore_index: int) -> tuple[Tensor]:
        """``(loss,)`` by ATen's own cross-entropy, for forward-mode AD
        (:func:`apply_function_fast`): each model's rows reduced as its own loss reduces them."""
        loss = F.cross_entropy(x, target, reduction="none", ignore_index=ignore_index)
        if reduction == "none":
            return (loss,)
        loss = loss.view(num_models, -1).sum(1)
        if reduction == "mean":
            loss = loss / (target != ignore_index).view(num_models, -1).sum(1)
        return (loss,)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, _, ctx.num_models, ctx.reduction, _ = inputs
        _, exp, total, index, ignored, counts = output
        ctx.mark_non_differentiable(exp, total)  # (the integer ones are anyway)
        ctx.set_materialize_grads(False)  # (no zeros made for the outputs besides the loss)
        saved_counts = counts if isinstance(counts, Tensor) else None
        ctx.counts = None if saved_counts is not None else counts
        ctx.save_for_backward(x, index, ignored, exp, total, saved_counts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        x, index, ignored, exp, total, counts = ctx.saved_tensors
        n = ctx.num_models
        if ctx.reduction == "none":
            rows = grad.reshape(-1, 1)
        else:
            if ctx.reduction == "mean":
                grad = grad / (ctx.counts if counts is None else counts)
            rows = grad.reshape(n, 1).expand(n, x.shape[0] // n).reshape(-1, 1)
        if ignored is not None:
            rows = rows.masked_fill(ignored.unsqueeze(1), 0.0)
        if torch.is_grad_enabled():  # create_graph=True: a gradient that can be differentiated
            # (out of place: under vmap x may be shared while the targets are batched)
            onehot = torch.zeros_like(x).scatter(1, index, 1.0)
            return (torch.softmax(x, 1) - onehot) * rows, None, None, None, None
        out = exp * (rows / total)  # softmax(x) * g_row in one pass over [R, C]
        out.scatter_add_(1, index, -rows)
        return out, None, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, target: Tensor, num_models: int,
             reduction: str, ignore_index: int) -> tuple:
        def rows(t: Tensor, dim: int | None) -> Tensor:  # [V, R, ...] -> [V*R, ...]
            t = t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)
            return t.flatten(0, 1)

        output = apply_function_fast(
            _ShortRowCrossEntropy, rows(x, in_dims[0]), rows(target, in_dims[1]),
            info.batch_size * num_models, reduction, ignore_index)
        batched = [isinstance(t, Tensor) for t in output]
        return (tuple(t.unflatten(0, (info.batch_size, -1)) if b else t
                      for t, b in zip(output, batched)),
                tuple(0 if b else None for b in batched))


# Losses whose reduction="none" result is one value per sample (or per element):
# the N models' batches can be flattened into one batch of N*B and reduced per model.
_ELEMENTWISE_LOSSES = {
    F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits, F.soft_margin_loss,
}
_CLASS_LOSSES = {F.cross_entropy, F.nll_loss}
_FLATTENED_LOSSES = _CLASS_LOSSES | _ELEMENTWISE_LOSSES


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

    An argument marked 0 may be a tuple, list or dict of stacked tensors (a fused module's
    output with several fields), as under vmap: the loss gets model i's, each field at
    ``[i]``::

        hftc.per_model(lambda out, y: F.nll_loss(out[0], y))(fused(x), y)   # (log_probs, aux)
    """
    for d in in_dims if isinstance(in_dims, tuple) else (in_dims,):
        if d not in (0, None):
            raise FusionArgumentError(
                f"per_model: in_dims entries must be 0 or None, got {in_dims}")
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
        stacked, n = _stacked_arguments(loss_fn, args, dims)
        _check_target_not_stacked(loss_fn, args, dims, n)
        for check in ARGUMENT_CHECKS:  # (hftc.training.mistakes: a fused output shared)
            check(_loss_name(loss_fn), signature, args, dims, kwargs, n)
        result = _per_model_losses(loss_fn, args, dims, kwargs, n, stacked)
        for check in RESULT_CHECKS:  # (hftc.training.mistakes: a .mean() of the N losses)
            check(result)
        return result

    losses.__dict__[PER_MODEL_MARK] = loss_fn  # (what compile_step must not wrap again)
    return losses


#: On ``hftc.per_model``'s results: the one model's loss they wrap.
PER_MODEL_MARK = "_hftc_per_model_of"


def _stacked_arguments(loss_fn: Callable[..., Tensor], args: Sequence[Any],
                       dims: Sequence[int | None]) -> tuple[list[Any], int | None]:
    """The arguments marked 0 in ``in_dims`` and their models' count N, each checked to be
    a tensor (or a tuple, list or dict of tensors) with leading dim N."""
    stacked = [a for a, d in zip(args, dims) if d == 0]
    if not stacked:
        raise FusionArgumentError(
            "per_model: in_dims marks no argument as stacked (0): mark the fused "
            "output 0, as in_dims=(0, None) (the default) does")
    # A fused module's output with several fields (a tuple, a dict, a ModelOutput) is
    # stacked field by field: each field is model i's at [i], as under vmap.
    leaves = [t for a in stacked for t in pytree.tree_leaves(a)]
    for a in stacked:
        if isinstance(a, Tensor):
            continue
        fields = pytree.tree_leaves(a)
        if not fields or not all(isinstance(t, Tensor) for t in fields):
            raise FusionArgumentError(
                f"per_model: an argument marked 0 in in_dims is a {type(a).__name__} "
                f"of {', '.join(sorted({type(t).__name__ for t in fields})) or 'nothing'}"
                f", not of tensors stacked per model; pass the field the loss takes "
                f"(out['logits'], out.logits, out[0]) or mark it None in in_dims")
    n = leaves[0].shape[0] if leaves[0].dim() else None
    for t in leaves:
        if t.dim() == 0 or t.shape[0] != n:
            where = next((k for k, (a, d) in enumerate(zip(args, dims)) if d == 0 and any(
                t is leaf for leaf in pytree.tree_leaves(a))), None)
            hint = ""
            if where is not None and where > 0:
                marks = tuple(None if k == where else d for k, d in enumerate(dims))
                hint = (f"; a target all models share (one model's, as its own run "
                        f"takes it) is marked None: hftc.per_model({_loss_name(loss_fn)}, "
                        f"in_dims={marks})")
            raise FusionArgumentError(
                f"per_model({_loss_name(loss_fn)}): every argument marked 0 in in_dims "
                f"must be a tensor (or a tuple, list or dict of tensors) stacked per "
                f"model, with leading dim N = {n} (argument 0's); argument "
                f"{where if where is not None else '?'} has shape {list(t.shape)}{hint}")
    return stacked, n


def _check_target_not_stacked(loss_fn: Callable[..., Tensor], args: Sequence[Any],
                              dims: Sequence[int | None], n: int) -> None:
    """A target marked shared (``in_dims`` None) that is stacked per model (``[N, *one
    model's target]``) would be broadcast against each model's output, or refused by the
    loss: refused here, saying ``in_dims=(0, 0)``."""
    if len(args) < 2 or dims[0] != 0 or dims[1] is not None or n < 2:
        return
    out, target = args[0], args[1]
    if not isinstance(out, Tensor) or not isinstance(target, Tensor) or out.dim() < 2:
        return
    ones = (out.shape[1:], out.shape[1:2] + out.shape[3:])  # elementwise, class-index
    if target.dim() and target.shape[0] == n and target.shape[1:] in ones:
        raise FusionArgumentError(
            f"per_model({_loss_name(loss_fn)}): the target {list(target.shape)} holds one "
            f"per model ([{n}, ...]) but in_dims marks it shared (None: every model gets "
            f"all {n}); pass in_dims=(0, 0): hftc.per_model({_loss_name(loss_fn)}, "
            f"in_dims=(0, 0))(out, targets)")


#: Functions called with each result of a ``per_model`` loss (installed by hftc.patches).
RESULT_CHECKS: list[Callable[[Tensor], None]] = []

#: Functions called with each call's bound arguments before the loss runs: ``(loss name,
#: signature or None, args, dims, kwargs, N)`` (installed by hftc.patches).
ARGUMENT_CHECKS: list[Callable[..., None]] = []


def _vmapped_or_looped(loss_fn: Callable[..., Tensor], args: Sequence[Any],
                       dims: Sequence[int | None], kwargs: dict[str, Any], n: int,
                       stacked: Sequence[Any]) -> Tensor:
    """The N losses under ``torch.func.vmap``, or in a loop over the models where vmap
    cannot run the loss (or would update its buffers once for all N)."""
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
    try:
        outs = [loss_fn(*[model_slice(a, i) if d == 0 else a for a, d in zip(args, dims)],
                        **kwargs) for i in range(n)]
    except Exception as exc:
        fields = next((a for a in stacked if not isinstance(a, Tensor)), None)
        if fields is None:
            raise
        raise FusionArgumentError(
            f"per_model({_loss_name(loss_fn)}): an argument marked 0 in in_dims is a "
            f"{type(fields).__name__} of stacked tensors, and the loss failed on model "
            f"0's {type(fields).__name__} ({type(exc).__name__}: {exc}); pass the field "
            f"the loss takes (out['logits'], out.logits, out[0]), or give a loss that "
            f"takes the {type(fields).__name__}") from exc
    return torch.stack(outs)


def _per_model_losses(loss_fn: Callable[..., Tensor], args: Sequence[Any],
                      dims: Sequence[int | None], kwargs: dict[str, Any], n: int,
                      stacked: Sequence[Any]) -> Tensor:
    """The N losses: flattened into one call where the loss allows, else under vmap or in
    a loop; a failure on the models' shares said as such (:func:`_explain_loss_failure`)."""
    try:
        result = _flattened_loss(loss_fn, args, dims, n, kwargs)
        if result is None:
            result = _vmapped_or_looped(loss_fn, args, dims, kwargs, n, stacked)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        if not isinstance(exc, (FusionError, torch.OutOfMemoryError)):
            _explain_loss_failure(loss_fn, args, dims, n, exc)
        raise
    return result


def _explain_loss_failure(loss_fn: Callable[..., Tensor], args: Sequence[Any],
                          dims: Sequence[int | None], n: int, exc: Exception) -> None:
    """A loss that failed on model 0's share of its arguments, said with what per_model
    read them as (dim 0 of each stacked argument: the N models; the others shared), so
    that one model's output given for the fused one (``[B, C]`` read as B models) or a
    target of the wrong kind is seen as such; torch's words and error kept as the cause."""
    shares = []
    for k, (a, d) in enumerate(zip(args, dims)):
        shape = (f"{list(a.shape)}" if isinstance(a, Tensor) else type(a).__name__)
        shares.append(f"argument {k} {shape}" + (f" (read as {n} models' stacked: dim 0)"
                                                 if d == 0 else " (shared by the models)"))
    said = (str(exc).strip().splitlines()[0] if str(exc).strip() else "").rstrip(".")
    cls = FusionTypeError if isinstance(exc, TypeError) else FusionArgumentError
    raise cls(
        f"hftc.per_model({_loss_name(loss_fn)}) failed on each model's share of "
        f"{'; '.join(shares)}: {type(exc).__name__}: {said}. per_model takes a fused "
        f"module's output [N, B, ...] (dim 0 the models, as fused(x) returns it), each "
        f"model's loss then as for one model; a target stacked per model [N, B] needs "
        f"in_dims=(0, 0); one model's own output takes the stock loss itself"
        f"{_repeated_target_hint(args, dims, n)}") from exc


def _repeated_target_hint(args: Sequence[Any], dims: Sequence[int | None], n: int) -> str:
    """Where a shared argument holds N times the batch of the stacked output
    (``y.repeat(N)``, ``torch.cat([y] * N)``, as one loss over all models would take it):
    say that per_model shares one model's target with each."""
    stacked = next((a for a, d in zip(args, dims) if d == 0 and isinstance(a, Tensor)
                    and a.dim() > 1), None)
    if stacked is None:
        return ""
    batch = stacked.shape[1]
    for k, (a, d) in enumerate(zip(args, dims)):
        if d is None and isinstance(a, Tensor) and a.dim() > 0 and n > 1 \
                and a.shape[0] == n * batch:
            return (f". Argument {k}'s dim 0 is {n} x the batch {batch}: a target repeated "
                    f"for the {n} models (y.repeat({n}), torch.cat([y] * {n})) is not needed; "
                    f"pass one model's target y [{batch}, ...], which per_model gives each "
                    f"model, or one per model stacked [{n}, {batch}, ...] with in_dims=(0, 0)")
    return ""


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
    if len(args) != 2 or dims[0] != 0 or loss_fn not in _FLATTENED_LOSSES:
        return None  # (any other loss's second argument may be a number per model, [N])
    reduction = kwargs.get("reduction", "mean")
    if reduction not in ("mean", "sum", "none") or kwargs.get("size_average") is not None \
            or kwargs.get("reduce") is not None:
        return None
    out, target = args
    if not isinstance(out, Tensor) or not isinstance(target, Tensor) or out.dim() < 3 \
            or target.dim() < (2 if dims[1] == 0 else 1):
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
