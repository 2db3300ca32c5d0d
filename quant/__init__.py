"""Weight quantization (int8, int4, NF4) for kvserve's linear projections, with CPU kernels.

``quantize_model`` and ``QuantSummary`` are imported lazily so ``kvserve`` subcommands that never quantize
do not pay for torch at import time.
"""

from __future__ import annotations

__all__ = ["QuantSummary", "quantize_model"]


def __getattr__(name: str):
    if name in __all__:
        from kvserve.quant import model

        return getattr(model, name)
    raise AttributeError(f"module 'kvserve.quant' has no attribute {name!r}")
