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

import torch

from kvserve.kvcache.sizing import KVShape


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
        # Per-layer views, made once: indexing ``data`` is a tensor op with its own dispatch cost on every call,
        # and every layer of every step asks for its views.
        flat = (self.num_slots, shape.num_kv_heads, shape.head_dim)
        self._blocks = [(self.data[0, i], self.data[1, i]) for i in range(shape.num_layers)]
        self._flat = [(k.view(flat), v.view(flat)) for k, v in self._blocks]

    @property
    def num_slots(self) -> int:
        """Token capacity of the pool (tokens)."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for the pool."""
        return self.data.numel() * self.data.element_size()

    def layer_blocks(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V by block, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self._blocks[layer_idx]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V, each ``[num_blocks * block_size, num_kv_heads, head_dim]``."""
        return self._flat[layer_idx]
