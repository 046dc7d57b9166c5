"""The mistakes a user makes first when training a fused module with stock code, caught
with a message that names the fix (installed by :mod:`hftc.patches`)::

    torch.optim.SGD(fused.parameters(),   a stock optimizer given one value per model:
                    lr=[0.1, 0.2])        FusionTypeError -> hftc.optim.SGD(..., lr=[...])

A stock optimizer is only refused where torch's own check failed on a list or tuple of
values: what torch accepts runs as torch runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..errors import FusionTypeError


def refusing_per_model_values(init: Callable[..., None]) -> Callable[..., None]:
    """A stock optimizer's ``__init__`` that, where torch's own check fails on a list or
    tuple of hyper-parameter values (``lr=[0.1, 0.2]``), says to use hftc.optim's."""

    @functools.wraps(init)
    def checked(self: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, params, *args, **kwargs)
        except (TypeError, ValueError) as exc:
            given = [*(("lr", a) for a in args[:1]), *kwargs.items()]
            lists = [k for k, v in given if isinstance(v, (list, tuple)) and v
                     and all(isinstance(e, (int, float, tuple, list)) for e in v)]
            if not lists:
                raise
            cls = type(self).__name__
            raise FusionTypeError(
                f"torch.optim.{cls} takes one {lists[0]} for all its parameters, got "
                f"{dict(given)[lists[0]]!r}; for one value per model of a fused module, "
                f"use hftc.optim.{cls}(fused.parameters(), {lists[0]}=[...]) (the same "
                f"arguments, each hyper-parameter a value or a list of N)") from exc

    checked.__hftc_original__ = init
    return checked


def stock_optimizer_classes() -> list[type]:
    """torch.optim's optimizer classes, each with its own ``__init__``."""
    found, todo = [], [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("torch.optim") and "__init__" in vars(sub):
                found.append(sub)
    return found


__all__ = ["refusing_per_model_values", "stock_optimizer_classes"]
