"""The KV pool: one preallocated tensor that holds every layer's keys and values in fixed-size blocks.

Layout (one tensor, so the bytes allocated are exactly what the formula says)::

    data: [2 (k|v), num_layers, num_blocks, block_size, num_kv_heads, head_dim]

    block table of a sequence  [7, 2, 9]          block_size = 4
    token position p           0 1 2 3 | 4 5 6 7 | 8 9
    slot = table[p // 4] * 4 + p % 4
                               28..31   | 8..11   | 36 37

A slot indexes the flattened ``[num_blocks * block_size]`` axis of one layer's K (or V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    if unit not in units or not number:
        raise ValueError(f"cannot parse memory size {text!r}; use e.g. 1GiB, 512MiB, 2GB")
    return int(float(number) * units[unit])


class KVPool:
    """Preallocated paged KV storage for all layers.

    Args:
        shape: model geometry; its bytes_per_element must match ``dtype``.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype: element type of the cache.
        device: where the pool lives.

    Raises:
        ValueError: on a non-positive size or a dtype that disagrees with ``shape``.
    """

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        element_size = torch.empty((), dtype=dtype).element_size()
        if element_size != shape.bytes_per_element:
            raise ValueError(f"dtype {dtype} has {element_size} bytes/element, shape says {shape.bytes_per_element}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        self.data = torch.zeros(2, shape.num_layers, num_blocks, block_size, shape.num_kv_heads,
                                shape.head_dim, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        """Token capacity of the pool (tokens)."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for the pool."""
        return self.data.numel() * self.data.element_size()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V, each ``[num_blocks * block_size, num_kv_heads, head_dim]``."""
        flat = (self.num_slots, self.shape.num_kv_heads, self.shape.head_dim)
        return self.data[0, layer_idx].view(flat), self.data[1, layer_idx].view(flat)


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
