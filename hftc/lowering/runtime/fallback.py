"""The fallback: an op with no fused kernel runs one by one, and the results are stacked.

::

    before:  op(x_n, *args_n)                    for n in 0..N-1   (no fused rule for op)
    after:   loop_over_models(op, N, batched, x, *args)  ->  torch.stack([op(x[n], ...)])

``loop_module`` does the same for a module, calling its template with each model's
tensors (``torch.func.functional_call``); a result that differs in shape between
models is refused (:class:`~hftc.errors.RaggedResultError`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ...errors import FusionError, RaggedResultError
from ...ir import set_training


def _stack_results(outs: list[Any], name: str) -> Any:
    """Stack N per-model results: tensors along a new model dim; Python values once."""
    if name.startswith("Tensor_"):  # (call_method's loop function: the method as written)
        name = f"Tensor.{name[len('Tensor_'):]}()"
    flat = [pytree.tree_flatten(o) for o in outs]
    first, out_spec = flat[0]
    stacked = []
    for pos, leaf in enumerate(first):
        column = [f[0][pos] for f in flat]
        if isinstance(leaf, Tensor):
            if any(t.shape != leaf.shape for t in column[1:]):
                raise RaggedResultError(
                    f"`{name}` gave the models results of different shapes "
                    f"({', '.join(str(list(t.shape)) for t in column)}): a value whose shape "
                    f"depends on the data (x[mask] with a per-model mask, torch.nonzero, a "
                    f"mixture of experts routing rows by index) cannot be stacked over the "
                    f"models. The fused module runs the models one by one where its first "
                    f"call finds this; to fuse them, keep shapes fixed (torch.where(mask, h, "
                    f"0), dense top-k routing with gather / scatter)")
            stacked.append(torch.stack(column))
        else:
            try:
                differ = any(bool(v != leaf) for v in column[1:])
            except RuntimeError:  # a value holding tensors pytree does not open (a dataclass)
                raise FusionError(
                    f"`{name}` returned a {type(leaf).__name__} that holds tensors, inside "
                    f"a container, which hftc cannot stack per model; return tensors in "
                    f"tuples, lists or dicts, or the dataclass itself as forward's output"
                ) from None
            if differ:
                raise RaggedResultError(
                    f"`{name}` returned different Python values for different models "
                    f"({column}), which one fused program cannot hold (.item() of a "
                    f"per-model tensor, a size that depends on the data, a model's own "
                    f"number in arithmetic on a size: x.shape[-1] ** -0.5 / self.t). The "
                    f"fused module runs the models one by one where its first call finds "
                    f"this; to fuse them, compute with the tensor instead of its Python "
                    f"value (h * x.shape[-1] ** -0.5 / self.t: the tensor first, each "
                    f"model's number then scales it)"
                )
            stacked.append(leaf)
    return pytree.tree_unflatten(stacked, out_spec)


def _model_slice(value: Any, flag: Any, i: int) -> Any:
    """Model ``i``'s part of ``value``: ``flag`` mirrors its containers down to the
    graph's values, each flagged ``True`` (index its tensors by ``i``) or ``False``."""
    if isinstance(flag, bool):
        if not flag:
            return value
        return pytree.tree_map(lambda t: t[i] if isinstance(t, Tensor) else t, value)
    if isinstance(flag, dict):
        return {k: _model_slice(v, flag[k], i) for k, v in value.items()}
    if isinstance(flag, slice):
        return value
    return type(value)(_model_slice(v, f, i) for v, f in zip(value, flag))


def _per_model_arguments(n: int, batched: Any, args: tuple, kwargs: dict):
    for i in range(n):
        yield _model_slice((args, kwargs), batched, i)


def loop_over_models(
    fn: Callable[..., Any], n: int, batched: Any, args: tuple, kwargs: dict,
    per_model_args: Sequence[tuple[int, Sequence]] | None = None,
    per_model_kwargs: Sequence[tuple[str, Sequence]] | None = None,
) -> Any:
    """The lowering of last resort: call ``fn`` once per model and stack the results.

    ``batched`` is ``(args, kwargs)`` with each graph value replaced by a flag: the
    flagged values' tensors are indexed by model, the others are passed as they are.
    Tensor results are stacked along a new model dim; Python values must agree
    across models (they are shapes and flags) and are returned once.
    ``per_model_args`` / ``per_model_kwargs``: ``((position or keyword, values), ...)``,
    the scalar arguments each model passes its own value of (``values[i]``).
    """
    outs = []
    for i, (a, k) in enumerate(_per_model_arguments(n, batched, args, kwargs)):
        if per_model_args or per_model_kwargs:
            a, k = list(a), dict(k)
            for position, values in per_model_args or ():
                a[position] = values[i]
            for keyword, values in per_model_kwargs or ():
                k[keyword] = values[i]
        outs.append(fn(*a, **k))
    return _stack_results(outs, getattr(fn, "__name__", str(fn)))


def loop_module(module: torch.nn.Module, n: int, batched: Any,
                args: tuple, kwargs: dict, overrides: Sequence[Sequence] | None = None) -> Any:
    """A module no rule fuses, run model by model.

    ``module`` is the fused tree's node for it: a
    :class:`~hftc.lowering.runtime.modules.StackedModule`
    (model i runs as ``functional_call(template, {name: stacked[i]})``, so gradients
    and in-place buffer updates land in the stacked tensors) or, for a module
    without parameters or buffers, the module itself.
    """
    template = getattr(module, "_hftc_template", None)
    target = module if template is None else template
    saved = {name: getattr(target, name) for name, _ in (overrides[0] if overrides else ())}
    outs = []
    try:
        for i, (a, k) in enumerate(_per_model_arguments(n, batched, args, kwargs)):
            for name, value in (overrides[i] if overrides else ()):
                setattr(target, name, value)  # model i's own hyper-parameter (dropout p, eps)
            if template is None:
                outs.append(module(*a, **k))
                continue
            set_training(template, module.training)
            tensors = {name: t[i] for name, t in module.named_parameters(remove_duplicate=False)}
            tensors.update({name: t[i]
                            for name, t in module.named_buffers(remove_duplicate=False)})
            outs.append(torch.func.functional_call(template, tensors, a, k, strict=True))
    finally:  # (model 0's own values back, also when model i's call raised)
        for name, value in saved.items():
            setattr(target, name, value)
    return _stack_results(outs, type(template or module).__name__)


_METHODS: dict[str, Callable[..., Any]] = {}


def call_method(name: str) -> Callable[..., Any]:
    """A function that calls ``name`` as a method of its first argument (for loops)."""
    if name not in _METHODS:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, name)(*args, **kwargs)

        method.__name__ = method.__qualname__ = f"Tensor_{name}"
        _METHODS[name] = method
    return _METHODS[name]
