"""Differing ops: an elementwise op that differs per model (an activation, dropout on or
off), run on each model's slice of the stacked tensor (before: ``per_model_ops.py``)::

    models:  relu(x_0)   relu(x_1)   gelu(x_2, approximate="tanh")   identity(x_3)
    fused:   cat([relu(x[0:2]), gelu(x[2:3], approximate="tanh"), x[3:4]])

Each op sees exactly the values (and gives exactly the gradients) it sees in its own
model: the ops are elementwise, so a slice of N models' values is what the models compute
alone.  Consecutive models with the same op share one call.

An op is ``(name, ((keyword, value), ...))``, a plain tuple the generated code can spell
(:data:`ELEMENTWISE_OPS` names its function).  In-place ops (``nn.ReLU(inplace=True)``)
write into their model's slice of ``x``, as they write into ``x`` in their own model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import random as rt_random


def identity(x: Tensor) -> Tensor:
    """``nn.Identity``: the input itself."""
    return x


def dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """``F.dropout`` on one model's slice: hftc's dropout kernel, so every element (every
    model) draws its own keep mask, as in the fused program's other dropouts."""
    return rt_random.dropout(x, p, training, inplace)


#: The elementwise, shape-preserving ops that may differ per model, by name: each
#: ``fn(x, **keywords)`` on a model's slice computes what the model computes.  Filled by
#: the rules that declare them (``@rule(..., differing_op=...)`` in
#: :mod:`hftc.passes.elementwise`).
ELEMENTWISE_OPS: dict[str, Any] = {}

Op = tuple[str, tuple[tuple[str, Any], ...]]


def writes_in_place(op: Op) -> bool:
    """Does ``op`` write into its input (``relu(inplace=True)``, ``tanh_``)?"""
    name, keywords = op
    return name.endswith("_") or dict(keywords).get("inplace", False) is True


def apply_op(op: Op, x: Tensor, training: bool) -> Tensor:
    """One model's (or a run of models') op on its slice ``x``; a module's dropout, which has
    no ``training`` keyword of its own, follows the fused module's flag ``training``."""
    name, keywords = op
    kwargs = dict(keywords)
    if name == "dropout":
        kwargs.setdefault("training", training)
    return ELEMENTWISE_OPS[name](x, **kwargs)


def differing_elementwise(x: Tensor, ops: Sequence[Op], training: bool = True) -> Tensor:
    """Model i's op ``ops[i]`` on its slice ``x[i]`` of ``x`` ``[N, ...]``, the results
    stacked ``[N, ...]`` again (see the module docstring).

    Where some ops write in place, every run computes on a copy of its slice and the
    in-place runs' results are copied back into ``x``: an in-place op on a view of ``x``
    bumps the version of all of ``x``, and autograd refused the tensors the other runs had
    saved (``tanh_``'s result).  Where every op writes in place, the result is ``x``
    itself, as each model's in-place op returns its input."""
    runs: list[tuple[Op, int, int]] = []  # (op, first model, number of models)
    for i, op in enumerate(ops):
        if runs and runs[-1][0] == op:
            runs[-1] = (op, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((op, i, 1))
    if len(runs) == 1:
        return apply_op(ops[0], x, training)
    in_place = [writes_in_place(op) for op, _, _ in runs]
    if not any(in_place):
        # one split (its backward one cat of the gradients; a narrow per run would make a
        # zero-padded full-size gradient each)
        slices = x.split_with_sizes([length for _, _, length in runs])
        return torch.cat([apply_op(op, piece, training) for (op, _, _), piece in zip(runs, slices)])
    outs = [apply_op(op, x.narrow(0, start, length).clone(), training)
            for op, start, length in runs]
    for (_, start, length), out, written in zip(runs, outs, in_place):
        if written:
            x.narrow(0, start, length).copy_(out)
    return x if all(in_place) else torch.cat(outs)
