"""hftc's graph vocabulary: what the stages of the pipeline agree on about a graph.

- the ``node.meta`` / ``GraphModule.meta`` keys that tracing, matching, the passes and
  the runtime read and write (one owner for each key's name and meaning);
- the functions a traced graph calls beyond torch's own: the autocast regions and
  custom ``autograd.Function`` applications the tracer records, and :func:`bind`,
  which names a kernel bound to the op it wraps.

It imports nothing of hftc's, so every stage may import it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# --------------------------------------------------------------------------- meta keys

#: ``node.meta`` key of the value model 0 computes at a node, on the meta device.
EXAMPLE_VALUE = "example_value"

#: ``GraphModule.meta`` key: the plain attributes of the model's modules that its forward
#: changed while traced (``["encoder.calls"]``), which the tracer put back.
PYTHON_STATE = "hftc_python_state"

#: ``GraphModule.meta`` key: forward's inputs traced as Python constants, ``{name: value}``.
CONSTANT_INPUTS = "hftc_constant_inputs"

#: ``node.meta`` key: ``{key: [value of model 0, ..., model N-1]}`` for hyper-parameters
#: that differ between the models (absent when they all agree).  A key is a module
#: attribute's name (``"p"``, ``"eps"``) or an :class:`ArgKey`.
PER_MODEL = "hftc_per_model"


@dataclass(frozen=True)
class ArgKey:
    """A call's argument whose value may differ per model: given by ``position``
    (``F.dropout(x, 0.1)``: ``ArgKey(position=1)``) or by ``keyword`` (``p=0.1``:
    ``ArgKey(keyword="p")``)."""

    position: int | None = None
    keyword: str | None = None

    def __str__(self) -> str:
        return f"argument {self.position}" if self.keyword is None else f"argument `{self.keyword}`"

#: The memory layout a program may run its 4-d activations in (autotune's candidates).
CHANNELS_LAST = "channels_last"

#: ``node.meta`` keys a fusion rule leaves on each node it builds: the rule's name, the
#: matched nodes of the N models it came from, and where in the user's code they are.
RULE = "hftc_rule"
ORIGIN = "hftc_origin"
SOURCE = "hftc_source"


# --------------------------------------------------------------------------- graph ops

_BOUND: dict[tuple[Any, Any], Callable[..., Any]] = {}


# --------------------------------------------------------------------------- autocast regions

#: The autocast regions of a model's forward that the running program has entered and
#: not yet left (:func:`enter_autocast`), innermost last, per thread.
_AUTOCAST_REGIONS = threading.local()


def _open_regions() -> list[Any]:
    if not hasattr(_AUTOCAST_REGIONS, "modes"):
        _AUTOCAST_REGIONS.modes = []
    return _AUTOCAST_REGIONS.modes


def enter_autocast(device_type: str, dtype: torch.dtype | None, enabled: bool,
                   cache_enabled: bool | None) -> Any:
    """``with torch.autocast(device_type, dtype, enabled, cache_enabled):`` in a model's
    forward, entered (the tracer records it: :mod:`hftc.frontends.symbolic`); returns the region for
    :func:`exit_autocast`."""
    mode = torch.amp.autocast_mode._enter_autocast(device_type, dtype, enabled, cache_enabled)
    _open_regions().append(mode)
    return mode


def exit_autocast(mode: Any) -> None:
    """The end of the autocast region :func:`enter_autocast` entered."""
    _open_regions().remove(mode)
    torch.amp.autocast_mode._exit_autocast(mode)


class modes_restored_on_error:  # noqa: N801 - used as a context manager, like a function
    """Around a run of a generated program: if it raises, grad mode is the caller's again
    and the autocast regions it entered are left (the generated code switches grad mode
    and enters regions where the models' forward did, with no ``with`` block that would
    undo them).  A class, not a generator: it wraps every fused forward."""

    __slots__ = ("grad_mode", "depth")

    def __enter__(self) -> None:
        self.grad_mode, self.depth = torch.is_grad_enabled(), len(_open_regions())

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            return
        torch.set_grad_enabled(self.grad_mode)
        regions = _open_regions()
        while len(regions) > self.depth:
            torch.amp.autocast_mode._exit_autocast(regions.pop())


def apply_function(function: type, *args: Any, **kwargs: Any) -> Any:
    """``function.apply(*args)``: a custom ``torch.autograd.Function`` of the models' code
    as one node of a graph (:func:`bind` names it per class); it runs per model."""
    return function.apply(*args, **kwargs)


def bind(kernel: Callable[..., Any], fn: Any) -> Callable[..., Any]:
    """``kernel`` with ``fn`` as its first argument, as a named function a graph can call.

    torch.fx cannot print a function as an argument of a node, so a kernel that
    wraps another op (``channelwise(F.max_pool2d, ...)``, the per-model loop) is
    emitted as ``channelwise__max_pool2d(x, ...)``.  Cached: one function per pair.
    """
    key = (kernel, fn)
    if key not in _BOUND:

        def bound(*args: Any, **kwargs: Any) -> Any:
            return kernel(fn, *args, **kwargs)

        name = getattr(fn, "__name__", type(fn).__name__)
        bound.__name__ = bound.__qualname__ = f"{kernel.__name__}__{name}".replace(".", "_")
        _BOUND[key] = bound
    return _BOUND[key]
