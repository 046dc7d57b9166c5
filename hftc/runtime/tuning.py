"""Which kernels autotune may time, declared next to each kernel.

A tunable kernel takes ``lowering=`` one of the names its lowerings function gives for
the call's arguments (the cost model's choice first; ``None``: that one)::

    @tunable(conv_lowerings)
    def conv(x, weight, bias, ..., lowering=None): ...

:mod:`hftc.compile.autotune` times every node whose target is tunable; the graph picture
(``hftc graph``) shows the cost model's choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

Kernel = TypeVar("Kernel", bound=Callable[..., Any])
Lowerings = Callable[..., list[str]]

#: The attribute :func:`tunable` sets on a kernel: its lowerings function.
_LOWERINGS = "hftc_lowerings"


def tunable(lowerings: Lowerings) -> Callable[[Kernel], Kernel]:
    """Declare ``kernel(..., lowering=name)`` tunable over ``lowerings(*args, **kwargs)``."""

    def wrap(kernel: Kernel) -> Kernel:
        setattr(kernel, _LOWERINGS, lowerings)
        return kernel

    return wrap


def lowerings_of(kernel: Any) -> Lowerings | None:
    """The lowerings function of a :func:`tunable` kernel, or None if it is not one."""
    return getattr(kernel, _LOWERINGS, None) if callable(kernel) else None
