"""argparse types shared by the ``python -m loadtest`` commands: a bad value is a usage error, not a traceback."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse reports anything else as a usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma list of integers >= 1, e.g. ``1,8,32``."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, arrivals/s)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


def positive_floats(text: str) -> list[float]:
    """A comma list of numbers > 0, e.g. ``0.5,2,8``."""
    values = [positive_float(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values
