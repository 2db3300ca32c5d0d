"""The engine's choices as enums, in a module without torch, so that configuration and CLIs can name them
without loading the engine."""

from __future__ import annotations

import enum


class DType(enum.Enum):
    """``--dtype`` choices."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class Device(enum.Enum):
    """``--device`` choices."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"
