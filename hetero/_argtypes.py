"""Argument checks: of option values passed in Python, and ``argparse`` types shared by the ``hetero``
command line and the pipelines' commands."""

from __future__ import annotations

import argparse

__all__ = ["check_positive_int", "positive_int"]


def check_positive_int(name: str, v: object) -> int:
    """``v`` if it is an integer >= 1 (not a bool); else a ValueError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return v


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value
