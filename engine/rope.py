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

    def cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, d]`` in ``x``'s dtype for ``positions`` ``[T]``."""
        if self.static and x.is_cpu:
            key = (x.dtype, x.device)
            if self._table is None or self._table[0] != key:
                every = torch.arange(ROPE_TABLE_POSITIONS, device=x.device)
                cos, sin = self.rotary(x[:0][None], every[None])  # [1, P, d] each
                self._table = (key, cos[0], sin[0])
            _, cos, sin = self._table
            if positions.numel() and int(positions.max()) < ROPE_TABLE_POSITIONS:
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
