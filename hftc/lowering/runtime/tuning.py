"""Which kernels autotune may time, declared next to each kernel.

A tunable kernel takes ``lowering=`` one of the names its lowerings function gives for
the call's arguments (the cost model's choice first; ``None``: that one)::

    @tunable(conv_lowerings)
    def conv(x, weight, bias, ..., lowering=None): ...

:mod:`hftc.lowering.autotune` times every node whose target is tunable; the graph picture
(``hftc graph``) shows the cost model's choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ...errors import FusionError

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


def check_lowering(op: str, lowering: str | None, names: list[str]) -> str:
    """The lowering a kernel runs: ``lowering`` if it is one of ``names`` (the kernel's
    lowerings for this call), the cost model's choice ``names[0]`` if None."""
    if lowering is None:
        return names[0]
    if lowering not in names:
        raise FusionError(
            f"lowering {lowering!r} does not apply to this {op}; it can run as {names} "
            f"(an autotune cache written for other shapes? delete it, see hftc.lowering.autotune)"
        )
    return lowering


def lowerings_of(kernel: Any) -> Lowerings | None:
    """The lowerings function of a :func:`tunable` kernel, or None if it is not one."""
    return getattr(kernel, _LOWERINGS, None) if callable(kernel) else None
