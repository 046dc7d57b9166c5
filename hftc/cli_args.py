"""Argument types of the command line (``python -m hftc ...``): a bad value is argparse's
usage error (exit 2) naming the option, not a traceback from the command."""

from __future__ import annotations

import argparse


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
