"""Calling hftc's own autograd Functions without ``Function.apply``'s per-call binding
(:func:`apply_function_fast`): the runtime's kernels (linear, conv, losses, reductions)
all go through it."""

from __future__ import annotations

from typing import Any

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad

#: The C++ ``apply`` that ``torch.autograd.Function.apply`` ends in (:func:`apply_function_fast`).
_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]


unwrap_dead_wrappers = torch._functorch.utils.unwrap_dead_wrappers


def apply_function_fast(function: type, *args: Any) -> Any:
    """``function.apply(*args)`` for hftc's own autograd Functions (positional arguments).

    They define ``setup_context`` (``forward`` without ``ctx``), the form ``torch.func``
    transforms need: ``torch.func.grad`` / ``vmap`` / ``jacrev`` through a fused module.
    For such a Function ``Function.apply`` binds the arguments with ``inspect.signature``
    on every call, to fill in defaults, which costs as much as a sweep's small layer.
    Their forwards have no defaults and every call passes all its arguments
    positionally, so where no ``torch.func`` transform is active, and outside
    ``torch.compile`` (which traces ``apply`` itself), this calls the C++ ``apply``
    directly, as ``Function.apply`` then does (dead ``torch.func`` wrappers unwrapped, too).

    Forward mode (``torch.func.jvp`` / ``jacfwd`` / ``hessian``, ``torch.autograd.forward_ad``'s
    dual tensors) they do not define (a ``jvp`` staticmethod would make ``torch.compile``
    break the graph at every call): there each Function's ``in_plain_ops``, the same
    result in stock differentiable ops, runs instead, which forward mode differentiates
    as it does the models' own ops.
    """
    if torch.compiler.is_compiling():
        return function.apply(*args)
    if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
        if forward_mode_active():
            return function.in_plain_ops(*args)
        return function.apply(*args)
    return _FUNCTION_APPLY.__get__(None, function)(*unwrap_dead_wrappers(args))


def forward_mode_active() -> bool:
    """Whether forward-mode AD may see this call: a ``forward_ad.dual_level`` is open, or a
    ``torch.func.jvp`` (``jacfwd``, ``hessian``) transform is on the stack."""
    return forward_ad._current_level >= 0 or any(
        interpreter.key() == TransformType.Jvp
        for interpreter in retrieve_all_functorch_interpreters())
