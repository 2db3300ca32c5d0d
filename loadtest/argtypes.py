"""argparse types shared by the ``python -m kvserve.loadtest`` commands: a bad value is a usage error, not a traceback."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable, TypeVar

N = TypeVar("N", int, float)


def _positive(text: str, convert: Callable[[str], N], noun: str) -> N:
    """``convert(text)`` if it is finite and above 0; anything else is an ``ArgumentTypeError``."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


def _listed(text: str, one: Callable[[str], N]) -> list[N]:
    """A comma list of ``one`` values (at least one)."""
    values = [one(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse reports anything else as a usage error)."""
    return _positive(text, int, "an integer")


def positive_ints(text: str) -> list[int]:
    """A comma list of integers >= 1, e.g. ``1,8,32``."""
    return _listed(text, positive_int)


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, arrivals/s)."""
    return _positive(text, float, "a number")


def positive_floats(text: str) -> list[float]:
    """A comma list of numbers > 0, e.g. ``0.5,2,8``."""
    return _listed(text, positive_float)


# --quantization of the benchmarks that load or serve the model: the server's choices; auto (their default) is
# what `kvserve serve` picks (for the embedded model: the GGUF's own blocks)
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4", "nf4")


def absolute_path(text: str) -> Path:
    """A path made absolute against the caller's working directory: the servers a command launches run from the
    repository root, where a relative path would name another file."""
    return Path(text).expanduser().resolve()
