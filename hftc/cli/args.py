"""Argument types of the command line (``python -m hftc ...``): a bad value is argparse's
usage error (exit 2) naming the option, not a traceback from the command."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a count of models, rounds, threads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an int >= 0 (0 meaning "the default")."""
    if text.strip() == "0":
        return 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be 0 (the default) or more, got {text!r}") from None


def int_list(text: str) -> str:
    """An argparse type: comma-separated ints >= 1 (``8,3,32,32``, ``1,4,16``), checked and
    returned as given; ``""`` is allowed (the default)."""
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            positive_int(part)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return text


#: ``--input`` dtype names -> torch dtype attribute names (no torch import for the parser).
INPUT_DTYPES = {
    "float": "float32", "float32": "float32", "double": "float64", "float64": "float64",
    "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
    "long": "int64", "int64": "int64", "int": "int32", "int32": "int32", "bool": "bool",
}


@dataclass(frozen=True)
class InputSpec:
    """One example input of ``hftc inspect``: ``long:8,16`` -> dtype "int64", shape (8, 16);
    ``high``: integer values are drawn from [0, high) (None: inspect picks)."""

    dtype: str
    shape: tuple[int, ...]
    high: int | None = None


def input_spec(text: str) -> InputSpec:
    """An argparse type: ``[DTYPE:]SHAPE[:HIGH]``, e.g. ``8,3,32,32``, ``long:8,16``,
    ``long:8,16:1000`` (token ids in [0, 1000)); DTYPE one of :data:`INPUT_DTYPES`."""
    parts = text.split(":")
    dtype = "float"
    if parts[0].strip().lower() in INPUT_DTYPES:
        dtype = parts.pop(0).strip().lower()
    elif parts[0].strip() and not any(c.isdigit() for c in parts[0]):  # a word: a dtype
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown dtype {parts[0]!r}; use one of {', '.join(INPUT_DTYPES)}")
    if not parts or len(parts) > 2 or not parts[0].strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected [DTYPE:]SHAPE[:HIGH], e.g. long:8,16 or 8,3,32,32")
    dims = [p.strip() for p in parts[0].split(",")]
    if dims[-1] == "" and len(dims) > 1:  # "8,16,": a trailing comma, as Python allows
        dims.pop()
    try:  # each dim a whole number >= 1: "2,,3" or "2.5,3" is a typo, not the shape (2, 3)
        shape = tuple(positive_int(d) for d in dims)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: SHAPE {parts[0]!r}: {exc}") from None
    high = None
    if len(parts) == 2:
        if INPUT_DTYPES[dtype] not in ("int64", "int32"):
            raise argparse.ArgumentTypeError(f"{text!r}: HIGH (values in [0, HIGH)) is for "
                                             f"integer inputs, not {dtype}")
        try:
            high = positive_int(parts[1])
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: HIGH {exc}") from None
    return InputSpec(INPUT_DTYPES[dtype], shape, high)
