"""RoPE (RoFormer, Su et al. 2021) for the lean forward: cos/sin per position, and the rotation of q and k.

``RopeTable`` gives cos and sin ``[T, d]`` for a step's positions as the model's own rotary module computes
them; ``Rope`` applies them in transformers' rotate_half layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# RoPE types whose cos/sin depend on the position alone (others, e.g. "dynamic", rescale with the length)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
ROPE_TABLE_POSITIONS = 8192  # positions in the cos/sin table (2 x 8192 x d x 4 bytes: 4 MiB at d = 64)


class RopeTable:
    """cos and sin of a model's rotary embedding (``model.model.rotary_emb``), per position.

    On a CPU, where they depend on the position alone (static RoPE types), they are rows of a table the module
    filled once for positions below ROPE_TABLE_POSITIONS: the same values (each is an elementwise function of
    one position) for one index_select each instead of the module's ~10 ops.
    """

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary
        self.static = getattr(rotary, "rope_type", None) in STATIC_ROPE_TYPES
        self._table: tuple | None = None  # ((dtype, device), cos [P, d], sin [P, d]), built on first use

    def table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin ``[ROPE_TABLE_POSITIONS, d]`` (contiguous, CPU) of every position below
        ROPE_TABLE_POSITIONS in ``dtype``, built on first use; None where they depend on more than the position."""
        if not self.static:
            return None
        if self._table is None or self._table[0] != dtype:
            every = torch.arange(ROPE_TABLE_POSITIONS)
            cos, sin = self.rotary(torch.empty(1, 0, 0, dtype=dtype), every[None])  # [1, P, d] each
            self._table = (dtype, cos[0].contiguous(), sin[0].contiguous())
        return self._table[1], self._table[2]

    def cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, d]`` in ``x``'s dtype for ``positions`` ``[T]`` (``x`` gives only its dtype and
        device)."""
        table = self.table(x.dtype) if x.is_cpu else None
        if table is not None and positions.numel() and int(positions.max()) < ROPE_TABLE_POSITIONS:
            cos, sin = table
            return cos.index_select(0, positions), sin.index_select(0, positions)
        cos, sin = self.rotary(x[None], positions[None])  # [1, T, d] each
        return cos[0], sin[0]


class Rope:
    """The rotation for one step's positions, in transformers' rotate_half layout.

    With ``rope_`` (native/csrc/decode_ops.cpp's op, float32 CPU) it rotates ``[T, heads, d]`` in place in one
    call; otherwise ``x * cos + roll(x, d / 2) * [-sin_1, sin_2]`` (one call for q and k together; the sign
    moves onto sin).

    Args:
        cos, sin: ``[T, d]`` from ``RopeTable.cos_sin``.
        rope_: the C++ op ``(qk, cos, sin)``, or None for torch's ops.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rope_: Callable | None) -> None:
        self.rope_ = rope_
        if rope_ is not None:
            self.cos, self.sin = cos.contiguous(), sin.contiguous()
            return
        self.half = cos.shape[-1] // 2
        self.cos = cos[:, None, :]  # [T, 1, d]: broadcast over heads
        self.sin = torch.cat((-sin[:, :self.half], sin[:, self.half:]), dim=-1)[:, None, :]

    def __call__(self, qk: torch.Tensor) -> torch.Tensor:
        """``[T, heads, d]`` rotated (in place with the C++ op)."""
        if self.rope_ is not None:
            self.rope_(qk, self.cos, self.sin)
            return qk
        return qk * self.cos + qk.roll(self.half, -1) * self.sin
