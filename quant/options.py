"""Quantization choices as enums, in a module without torch (configuration and CLIs name them)."""

from __future__ import annotations

import enum


class Scheme(enum.Enum):
    """``--quantization`` choices: what a weight is stored as."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    NF4 = "nf4"
