"""The engine's choices as enums, in a module without torch, so that configuration and CLIs can name them
without loading the engine."""

from __future__ import annotations

import enum
import sys
from pathlib import Path


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


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (what ``--device auto`` picks), without importing torch where the answer
    is surely no: on Linux with no NVIDIA or ROCm driver loaded. Elsewhere torch is asked (a second or two)."""
    if sys.platform.startswith("linux") and not any(Path(p).exists() for p in ("/proc/driver/nvidia/version",
                                                                                 "/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def activation_dtype(choice: DType, device: Device) -> DType:
    """The activations' dtype, and so an ``auto`` KV cache's: ``--dtype`` when it names one; auto: bfloat16 on a
    GPU, float32 on a CPU (kvserve's fused ops and kernels take float32 rows, even where full-precision weights are
    kept in bfloat16 for the AVX512-BF16 kernel). ``engine.loader.resolve_dtype`` applies this rule to torch dtypes;
    the capacity planner applies it without torch (tests/test_planner.py keeps the two equal)."""
    if choice is not DType.AUTO:
        return choice
    on_gpu = device is Device.CUDA or (device is Device.AUTO and cuda_present())
    return DType.BFLOAT16 if on_gpu else DType.FLOAT32
