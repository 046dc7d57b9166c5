"""One trace for N models that differ only in numbers their modules hold (a sweep over
dropout p): the numbers are traced as tokens and each model's graph gets its own.

::

    models      MLP(p=0.0)  MLP(p=0.1)  MLP(p=0.2)        differ in `drop.p` only
    trace       model 0, `drop.p` a WatchedNumber          one trace, not three
    graphs      dropout(x, p=0.0)  dropout(x, p=0.1)  dropout(x, p=0.2)

A :class:`WatchedNumber` is a ``float`` that notes every use Python makes of it
(arithmetic, comparison, ``bool``, formatting, hashing): a number forward only passes on
to an op reaches the graph as the token itself, one forward computes or branches on is
used, and then each model is traced itself (the program may depend on the value).  A
read in C (``math.exp(self.p)`` takes a float's value without a method call) goes
unnoted, so the token trace is run twice, its tokens holding another model's values the
second time: graphs that then differ read a value in C, and each model is traced itself.
The first-call check still runs every model whose Python state differs from model 0's
against its own forward, and without the check (``check=False``) models are each traced.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

import torch.fx as fx
from torch import nn

__all__ = ["WatchedNumber", "watched_numbers", "graph_with_numbers"]

#: ``float``'s methods through which Python reads the value (and ``__repr__``, called
#: from outside torch.fx, which writes the graph's code with it).
_READS = ("__abs__", "__add__", "__bool__", "__ceil__", "__divmod__", "__eq__", "__float__",
          "__floor__", "__floordiv__", "__format__", "__ge__", "__gt__", "__hash__",
          "__int__", "__le__", "__lt__", "__mod__", "__mul__", "__ne__", "__neg__",
          "__pos__", "__pow__", "__radd__", "__rdivmod__", "__rfloordiv__", "__rmod__",
          "__rmul__", "__round__", "__rpow__", "__rsub__", "__rtruediv__", "__sub__",
          "__truediv__", "__trunc__", "__str__", "__reduce__", "__reduce_ex__",
          "__getnewargs__", "is_integer", "hex", "as_integer_ratio", "conjugate")


class WatchedNumber(float):
    """A module's float attribute while one model is traced for several; ``uses`` lists
    how Python read it (empty: it only reached the graph)."""

    uses: list[str]

    def __new__(cls, value: float, uses: list[str]) -> WatchedNumber:
        number = super().__new__(cls, value)
        number.uses = uses
        return number

    def __copy__(self) -> WatchedNumber:
        self.uses.append("__copy__")
        return self

    def __deepcopy__(self, memo: dict) -> WatchedNumber:
        self.uses.append("__deepcopy__")
        return self

    def __repr__(self) -> str:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith("torch.fx"):
            self.uses.append("__repr__")
        return float.__repr__(self)


def _noting(name: str):
    read = getattr(float, name)

    def method(self, *args, **kwargs):
        self.uses.append(name)
        return read(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in _READS:
    setattr(WatchedNumber, _name, _noting(_name))


@contextlib.contextmanager
def watched_numbers(model: nn.Module, attributes: Sequence[tuple[str, str]],
                    uses: list[str], values: dict[tuple[str, str], float] | None = None
                    ) -> Iterator[dict[int, tuple[str, str]]]:
    """``model``'s float ``attributes`` ((module path, name)) as :class:`WatchedNumber`\\ s
    while the block runs (their uses appended to ``uses``); yields token id -> attribute.
    A token holds ``values[attribute]`` where given, else the model's own value. The
    model's own floats are back afterwards, whatever happened."""
    tokens: dict[int, tuple[str, str]] = {}
    saved: list[tuple[nn.Module, str, float]] = []
    try:
        for path, name in attributes:
            module = model.get_submodule(path)
            value = vars(module)[name]
            token = WatchedNumber((values or {}).get((path, name), value), uses)
            saved.append((module, name, value))
            vars(module)[name] = token
            tokens[id(token)] = (path, name)
        yield tokens
    finally:
        for module, name, value in saved:
            vars(module)[name] = value


def graph_with_numbers(gm: fx.GraphModule, model: nn.Module,
                       tokens: dict[int, tuple[str, str]]) -> bool:
    """Put ``model``'s own values of the traced attributes in place of their tokens in
    ``gm``'s graph (node arguments); False where a token is somewhere else (the graph's
    meta, an attribute), which the caller then traces itself."""
    def own(value):
        if type(value) is WatchedNumber:
            path, name = tokens[id(value)]
            return float(vars(model.get_submodule(path))[name])
        return value

    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, own)
        node.kwargs = fx.node.map_aggregate(node.kwargs, own)
    return not any(type(v) is WatchedNumber for v in vars(gm).values())
