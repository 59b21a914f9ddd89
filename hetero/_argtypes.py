"""Argument checks: of option values passed in Python, and ``argparse`` types shared by the ``hetero``
command line and the pipelines' commands."""

from __future__ import annotations

import argparse

import numpy as np

__all__ = ["check_positive_int", "non_negative_int", "positive_int"]


def check_positive_int(name: str, v: object, *, minimum: int = 1, maximum: int | None = None, multiple_of: int = 1,
                       numpy_ints: bool = False, rule: str | None = None,
                       error: type[Exception] = ValueError) -> int:
    """``v`` as an int if it is an integer (never a bool) from ``minimum`` (1: positive; 0: non-negative)
    up to ``maximum`` and a multiple of ``multiple_of``; numpy integers count with ``numpy_ints``.

    Else raises ``error`` (ValueError, or the caller's own type) as ``"{name} must be {rule}, got
    {v!r}"``: ``rule`` says the bounds in the caller's words, by default ``an integer >= 1``
    (``an integer from 2 to 512`` with a maximum, ``... and a multiple of 4``).
    """
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and (numpy_ints or isinstance(v, int)):
        n = int(v)
        if n >= minimum and (maximum is None or n <= maximum) and n % multiple_of == 0:
            return n
    if rule is None:
        rule = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
        if multiple_of != 1:
            rule += f" and a multiple of {multiple_of}"
    raise error(f"{name} must be {rule}, got {v!r}")


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 0."""
    return _int_at_least(text, 0)
