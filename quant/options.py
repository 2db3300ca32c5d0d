"""Quantization choices as enums, in a module without torch (configuration and CLIs name them)."""

from __future__ import annotations

import enum


class Scheme(enum.Enum):
    """``--quantization`` choices: what a weight is stored as."""

    AUTO = "auto"  # chosen at start from the model (server.quantization.choose)
    NONE = "none"  # full precision
    GGUF = "gguf"  # a GGUF file's own blocks (Q4_1, Q4_0, Q8_0), as the file has them
    INT8 = "int8"
    INT4 = "int4"
    NF4 = "nf4"

