"""The KV pool: preallocated tensors that hold every layer's keys and values in fixed-size blocks.

Layout (one tensor, so the bytes allocated are exactly what the formula says)::

    data: [2 (k|v), num_layers, num_blocks, block_size, num_kv_heads, head_dim]

    block table of a sequence  [7, 2, 9]          block_size = 4
    token position p           0 1 2 3 | 4 5 6 7 | 8 9
    slot = table[p // 4] * 4 + p % 4
                               28..31   | 8..11   | 36 37

A slot indexes the flattened ``[num_blocks * block_size]`` axis of one layer's K (or V).

A quantized cache (int8, int4) keeps codes in ``data`` and their float16 scales beside them in ``scales``::

    data:   [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim * bits / 8]   int8 | uint8 (int4)
    scales: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim / group]      float16

Symmetric round-to-nearest per token and KV head (and per group of 32 along head_dim for int4), so a token's
codes depend on that token's vector alone, never on which tokens, sequences or steps share its block:

    scale = fp16(max|x_group| / qmax)        qmax = 127 (int8), 7 (int4)
    code  = clamp(round_half_even(x / scale), -qmax, qmax)      (0 where scale is 0)
    x'    = code * scale                                         (exact in float32)

int4 packs a group of 32 codes into 16 bytes as llama.cpp's q4_0 does: byte j holds code j + 8 in its low nibble
and code j + 16 + 8 in its high one. ``quantize`` / ``dequantize`` are the torch reference; the C++ write and
attention (native/csrc/kv_quant.cpp) give the same codes and read them in place.
"""

from __future__ import annotations

import torch

from kvserve.kvcache.sizing import KVShape

_FLOAT_DTYPES = {4: torch.float32, 2: torch.bfloat16}


def storage_dtype(shape: KVShape, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of ``data`` for ``shape``: the model's dtype when it has the shape's width, else
    float32 / bfloat16 by width; int8 codes, or uint8 bytes of two int4 codes."""
    if shape.scale_group:
        return torch.int8 if shape.code_bits == 8 else torch.uint8
    if torch.empty((), dtype=model_dtype).element_size() == shape.bytes_per_element:
        return model_dtype
    return _FLOAT_DTYPES[int(shape.bytes_per_element)]


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of head vectors (the module docstring's rule).

    Args:
        x: ``[..., D]`` any float dtype (computed in float32).
        bits: 8 or 4.
        group: elements per scale (D for int8; it must divide D).

    Returns:
        codes ``[..., D]`` int8 (bits 8) or ``[..., D / 2]`` uint8 (bits 4, packed), scales ``[..., D / group]``
        float16.
    """
    qmax = _qmax(bits)
    grouped = x.float().unflatten(-1, (-1, group))  # [..., S, G]
    scales = (grouped.abs().amax(-1, keepdim=True) / qmax).to(torch.float16)
    s = scales.float()
    codes = torch.where(s > 0, torch.round(grouped / s), 0.0).clamp_(-qmax, qmax)
    scales = scales.squeeze(-1)
    if bits == 8:
        return codes.to(torch.int8).flatten(-2), scales
    nibbles = (codes + 8).to(torch.uint8)  # 1..15
    half = group // 2
    return (nibbles[..., :half] | (nibbles[..., half:] << 4)).flatten(-2), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Head vectors back from ``quantize``'s codes ``[..., D or D / 2]`` and scales ``[..., S]``: ``[..., D]``
    in ``dtype`` (code * scale in float32, exact, then rounded to ``dtype``)."""
    num_scales = scales.shape[-1]
    if bits == 8:
        values = codes.float().unflatten(-1, (num_scales, -1))
    else:
        packed = codes.unflatten(-1, (num_scales, -1))  # [..., S, G / 2]
        values = torch.cat([packed & 15, packed >> 4], dim=-1).float() - 8  # [..., S, G]
    return (values * scales.float()[..., None]).flatten(-2).to(dtype)


class KVPool:
    """Preallocated paged KV storage for all layers.

    Args:
        shape: model geometry and cache format (``kvcache.sizing.cache_shape``).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype: element type of ``data``; it must agree with ``shape`` (``storage_dtype``).
        device: where the pool lives.

    Raises:
        ValueError: on a non-positive size or a dtype that disagrees with ``shape``.
    """

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        if shape.scale_group and dtype is not storage_dtype(shape, dtype):
            raise ValueError(f"a {shape.code_bits}-bit cache stores {storage_dtype(shape, dtype)}, not {dtype}")
        element_size = torch.empty((), dtype=dtype).element_size()
        if not shape.scale_group and element_size != shape.bytes_per_element:
            raise ValueError(f"dtype {dtype} has {element_size} bytes/element, shape says {shape.bytes_per_element}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bits = shape.code_bits if shape.scale_group else 0  # 0: a float cache
        row = shape.head_dim * shape.code_bits // 8 if shape.scale_group else shape.head_dim
        # [2, num_layers, num_blocks, block_size, num_kv_heads, row]
        self.data = torch.zeros(2, shape.num_layers, num_blocks, block_size, shape.num_kv_heads, row,
                                dtype=dtype, device=device)
        # [2, num_layers, num_blocks, block_size, num_kv_heads, scales per head] (no elements for a float cache)
        self.scales = torch.zeros(2, shape.num_layers, num_blocks, block_size, shape.num_kv_heads,
                                  shape.scales_per_head, dtype=torch.float16, device=device)
        # Per-layer views, made once: indexing ``data`` is a tensor op with its own dispatch cost on every call,
        # and every layer of every step asks for its views.
        self._blocks = [(self.data[0, i], self.data[1, i]) for i in range(shape.num_layers)]
        self._flat = [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in self._blocks]
        self._scale_blocks = [(self.scales[0, i], self.scales[1, i]) for i in range(shape.num_layers)]
        self._scale_flat = [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in self._scale_blocks]

    @property
    def quantized(self) -> bool:
        """True for an int8 / int4 cache (codes and scales)."""
        return self.bits != 0

    @property
    def num_slots(self) -> int:
        """Token capacity of the pool (tokens)."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for the pool, scales included."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def cache_dtype(self) -> str:
        """What the cache holds, as ``--kv-cache-dtype`` names it: float32, bfloat16, int8, int4 (or float16)."""
        return f"int{self.bits}" if self.quantized else str(self.data.dtype).removeprefix("torch.")

    def layer_blocks(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V by block, each ``[num_blocks, block_size, num_kv_heads, row]`` (row: head_dim,
        or its codes' bytes)."""
        return self._blocks[layer_idx]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V, each ``[num_blocks * block_size, num_kv_heads, row]``."""
        return self._flat[layer_idx]

    def layer_scale_blocks(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V scales by block, each ``[num_blocks, block_size, num_kv_heads, scales]``."""
        return self._scale_blocks[layer_idx]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V scales, each ``[num_blocks * block_size, num_kv_heads, scales]``."""
        return self._scale_flat[layer_idx]

    def write(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[T, num_kv_heads, head_dim]`` at ``slots`` ``[T]`` (quantized once, for a
        quantized cache), with torch ops."""
        k_cache, v_cache = self._flat[layer_idx]
        if not self.quantized:
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))  # index_copy_/index_select: 2-4x faster
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))  # than advanced indexing on CPU
            return
        k_scales, v_scales = self._scale_flat[layer_idx]
        for cache, scales, x in ((k_cache, k_scales, k), (v_cache, v_scales, v)):
            codes, s = quantize(x, self.bits, self.shape.scale_group)
            cache.index_copy_(0, slots, codes)
            scales.index_copy_(0, slots, s)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache gives back for ``x`` ``[..., head_dim]`` once written: ``x`` itself in the cache's
        dtype, or its dequantized codes, in ``x``'s dtype."""
        if not self.quantized:
            return x.to(self.data.dtype).to(x.dtype)
        return dequantize(*quantize(x, self.bits, self.shape.scale_group), self.bits, x.dtype)

    def gather(self, layer_idx: int, tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole blocks of each block table ``[num_seqs, n]``: K and V, each
        ``[num_seqs, n * block_size, num_kv_heads, head_dim]`` in ``dtype`` (dequantized from a quantized cache:
        one sequence's context at a time, never the whole pool)."""
        num_seqs, width = tables.shape
        flat = tables.flatten()
        k_blocks, v_blocks = self._blocks[layer_idx]
        out = []
        for index, blocks in enumerate((k_blocks, v_blocks)):
            picked = blocks.index_select(0, flat)  # [num_seqs * n, block_size, H_kv, row]
            if self.quantized:
                scales = self._scale_blocks[layer_idx][index].index_select(0, flat)
                picked = dequantize(picked, scales, self.bits, dtype)
            out.append(picked.view(num_seqs, width * self.block_size, *picked.shape[2:]).to(dtype))
        return out[0], out[1]
