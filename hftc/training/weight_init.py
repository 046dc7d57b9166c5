"""``torch.nn.init`` on a fused module's stacked parameters: each model's row initialised
as torch initialises that model's own tensor.

A stacked weight is ``[N, out, in]``; torch's initialisers read its shape as one tensor's,
so ``nn.init.kaiming_uniform_(fused.fc.weight)`` took the fan-in from ``out * in`` (not
``in``), ``orthogonal_`` made the N models' rows orthogonal to each other and ``dirac_``
read a conv's ``[N, out, in, k, k]`` as a 3-d kernel: silently wrong.  After ``import
hftc`` each of them runs on rows ``0, 1, ..., N-1`` in turn::

    nn.init.kaiming_uniform_(fused.fc.weight)   ==   for m in models:
                                                         nn.init.kaiming_uniform_(m.fc.weight)

(the same draws, in that order: the same seeds give the same bits), and
``nn.init._calculate_fan_in_and_fan_out`` (a ``reset_parameters``' bias bound) gives one
model's fans.  Other tensors get torch's own functions.  Installed by :mod:`hftc.patches`.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import torch
from torch import Tensor

from ..errors import FusionNotImplementedError, user_line
from ..lowering.runtime.modules import FUSED_MODULES, STACKED_MARK

#: The initialisers whose result depends on the tensor's shape or draws from the RNG
#: (``constant_``, ``ones_``, ``zeros_`` fill every row alike and stay torch's).
PER_MODEL_INITS = ("uniform_", "normal_", "trunc_normal_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                   "kaiming_normal_", "orthogonal_", "sparse_")
#: The helpers that read one tensor's fans off its shape.
FAN_HELPERS = ("_calculate_fan_in_and_fan_out", "_calculate_correct_fan")

#: name -> torch's own function (a new function object on torch's code).
_STOCK: dict[str, types.FunctionType] = {}
#: ``rows``: whether this thread runs an initialiser row by row now (its inner calls,
#: kaiming_'s fans, are torch's own).
_ON_ROWS = threading.local()


def _stacked_models(tensor: Any) -> tuple[int, bool] | None:
    """``(N, padded)`` where ``tensor`` is a fused module's stacked parameter (or its
    ``.data``: ``nn.init.xavier_uniform_(m.weight.data)``), ``padded`` where that module
    was fused with ``pad_widths=True``; else None."""
    if not isinstance(tensor, Tensor) or tensor.dim() == 0:
        return None
    mark = getattr(tensor, STACKED_MARK, None)
    if mark is None and (not FUSED_MODULES or isinstance(tensor, torch.nn.Parameter)):
        return None  # (a fused module marks its parameters, also after a load or a copy)
    pointer = tensor.data_ptr()
    for module in list(FUSED_MODULES):
        for p in module.parameters():
            if p is tensor or (p.data_ptr() == pointer and p.shape == tensor.shape):
                return module.num_models, getattr(module, "padding", None) is not None
    return None if mark is None else (mark, False)


def _init_per_model(name: str, args: tuple, kwargs: dict) -> Any:
    """What ``torch.nn.init.<name>`` runs after ``import hftc`` (see the module docstring)."""
    stock = _STOCK[name]
    if getattr(_ON_ROWS, "rows", False):
        return stock(*args, **kwargs)
    in_kwargs = not args
    tensor = kwargs.get("tensor") if in_kwargs else args[0]
    found = _stacked_models(tensor)
    if found is None:
        return stock(*args, **kwargs)
    num_models, padded = found

    def on_row(row: Tensor) -> Any:
        if in_kwargs:
            return stock(**{**kwargs, "tensor": row})
        return stock(row, *args[1:], **kwargs)

    if name in FAN_HELPERS:
        return on_row(tensor[0].detach())
    if padded:
        raise FusionNotImplementedError(
            f"torch.nn.init.{name} on a stacked parameter of a module fused with "
            f"pad_widths=True{user_line()}: its rows are padded to the widest model, so "
            f"torch would read the padded shape's fans and fill the padding. Initialise "
            f"each model at its own widths: fused.apply(init_fn) (init_fn(m) runs on each "
            f"model's own modules), or initialise the models before fusing")
    _ON_ROWS.rows = True
    try:
        with torch.no_grad():
            for i in range(num_models):
                on_row(tensor[i])
    finally:
        _ON_ROWS.rows = False
    return tensor


def _trampoline(name: str, globals_: dict[str, Any]) -> types.CodeType:
    source = (f"def {name}(*args, **kwargs):\n"
              f"    return _hftc_init_per_model({name!r}, args, kwargs)\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<hftc: torch.nn.init.{name}>", "exec"), globals_, namespace)
    return namespace[name].__code__


def install_per_model_init() -> None:
    """Make torch's initialisers and fan helpers per model on stacked parameters: the
    same function objects with a new ``__code__`` that calls :func:`_init_per_model`
    (so a name bound before ``import hftc``, ``from torch.nn.init import
    kaiming_uniform_``, and ``reset_parameters``' calls agree), torch's code kept in a
    twin; ``inspect.signature`` reads torch's through ``__wrapped__``."""
    for name in (*PER_MODEL_INITS, *FAN_HELPERS):
        function = getattr(torch.nn.init, name, None)
        if name in _STOCK or not isinstance(function, types.FunctionType) \
                or function.__closure__:
            continue
        stock = types.FunctionType(function.__code__, function.__globals__, name,
                                   function.__defaults__, function.__closure__)
        stock.__kwdefaults__ = function.__kwdefaults__
        stock.__doc__, stock.__qualname__ = function.__doc__, function.__qualname__
        stock.__module__ = function.__module__
        function.__globals__["_hftc_init_per_model"] = _init_per_model
        function.__code__ = _trampoline(name, function.__globals__)
        function.__wrapped__ = stock
        _STOCK[name] = stock
