"""The exported program's input guards: what ``torch.export`` fixed, checked on every call.

The export front-end (:mod:`hftc.frontends.export`) puts a call to one of these after each
input placeholder of an exported graph; the fused graph keeps them (the rule in
:mod:`hftc.passes.shape` moves a stacked input's sizes past its model dim)::

    x = placeholder; check_input_shape(x, (None, 3, 32, 32), "x")            (one model)
    x = placeholder; check_input_shape(x, (None, 3, 32, 32), "x", offset=1)  (fused)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...errors import FusionArgumentError, InputShapeError


def check_input_shape(x: Any, shape: tuple, name: str, offset: int = 0,
                      exported: str = "") -> None:
    """Raise unless ``x`` has the rank and the fixed sizes the model was exported with.

    ``shape`` has an int for every dim export fixed, ``None`` for free symbolic
    ones and ``(low, high)`` for bounded ones (``None`` for no bound); ``offset``
    skips leading model dims (1 for an input stacked per model); ``exported`` says how
    the sizes were exported where not every dim could be kept symbolic
    (:meth:`hftc.frontends.export.ExportedShapes.describe`).
    """
    if not isinstance(x, torch.Tensor):
        raise FusionArgumentError(
            f"input `{name}` was a tensor in example_inputs but is a {type(x).__name__} now; "
            f"fuse again with example_inputs of this kind"
        )
    got = tuple(x.shape[offset:])

    def fits(want: Any, size: int) -> bool:
        if isinstance(want, tuple):
            return (want[0] is None or size >= want[0]) and (want[1] is None or size <= want[1])
        return want is None or want == size

    if len(got) != len(shape) or not all(fits(s, g) for s, g in zip(shape, got)):
        want = "[" + ", ".join(
            "*" if s is None else f"{s[0] or ''}..{s[1] or ''}" if isinstance(s, tuple)
            else str(s) for s in shape) + "]"
        fixed = (f"exported {exported}" if exported else
                 "the sizes given as numbers were fixed by the model's code or by the example "
                 "(export specialises sizes 0 and 1, so give example inputs with a batch size "
                 "of at least 2)")
        raise InputShapeError(
            f"input `{name}` has shape {list(got)}, but the models were exported (torch.export, "
            f"from example_inputs) with shape {want}: {fixed}. Call with that shape, or fuse "
            f"again with example_inputs of the new shape."
        )


def check_input_value(value: Any, expected: Any, name: str) -> None:
    """Raise unless a Python input (an int, a flag, ``None``) is what export baked in."""
    same = value is expected if expected is None else (
        type(value) is type(expected) and value == expected
    )
    if not same:
        raise FusionArgumentError(
            f"input `{name}` is {value!r}, but the models were exported (torch.export, from "
            f"example_inputs) with {expected!r}, which their graph has baked in; fuse again "
            f"with example_inputs holding {value!r}"
        )


def check_input_structure(value: Any, expected: str, name: str) -> None:
    """Raise unless a structured input (a tuple of tensors, None) has the example's structure."""
    got = str(pytree.tree_structure(value))
    if got != expected:
        raise FusionArgumentError(
            f"input `{name}` has structure {got}, but the models were exported (torch.export, "
            f"from example_inputs) with {expected}; fuse again with example_inputs of this "
            f"structure"
        )


#: The guards, which compute nothing of the model's (a mismatch between the models'
#: graphs is looked for past them: a guard differs where the models' own code does).
INPUT_GUARDS = frozenset({check_input_shape, check_input_value, check_input_structure})
