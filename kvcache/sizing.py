"""KV sizing without torch: bytes per token, memory sizes, blocks per budget (the planner imports this)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class KVShape:
    """What one token costs in the cache: model geometry and element size.

    Attributes:
        num_layers: decoder layers that keep a KV cache.
        num_kv_heads: key/value heads per layer (fewer than query heads under GQA).
        head_dim: channels per head.
        bytes_per_element: 2 for fp16/bf16, 4 for fp32, 1 for an int8/fp8 cache.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_element: int

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per resident token.

        bytes/token = 2 * L * H_kv * d * b  (K and V for every layer; GQA, Ainslie et al. 2023, divides H_kv).
        """
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    def formula(self) -> str:
        """The formula with this model's numbers, for logs and the capacity planner."""
        return (
            f"2 x {self.num_layers} layers x {self.num_kv_heads} kv_heads x {self.head_dim} head_dim"
            f" x {self.bytes_per_element} B = {self.bytes_per_token:,} bytes/token"
        )


def parse_bytes(text: str) -> int:
    """Parse a memory size such as ``1GiB``, ``512MiB``, ``2GB`` or ``1048576`` into bytes.

    Raises:
        ValueError: the text is not a number with an optional unit.
    """
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("kmgtib")
    unit = stripped[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = None
    if unit not in units or value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"cannot parse memory size {text!r}: a number with an optional unit (B, KB, MB, GB, "
                         "TB, KiB, MiB, GiB, TiB), e.g. 1GiB, 512MiB, 2GB")
    return int(value * units[unit])


def num_blocks_for_budget(shape: KVShape, block_size: int, budget_bytes: int) -> int:
    """How many whole blocks fit in ``budget_bytes``.

    Raises:
        ValueError: the budget holds not even one block.
    """
    block_bytes = shape.bytes_per_token * block_size
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"KV budget of {budget_bytes:,} bytes holds no block of {block_bytes:,} bytes")
    return int(num_blocks)
