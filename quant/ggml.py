"""A GGUF file's own quantized blocks as kvserve layers: ``GGMLLinear`` (a projection) and ``GGMLEmbedding``.

llama.cpp's block formats (ggml-common.h; the ``gguf`` package reads and dequantizes them the same way), each
covering 32 consecutive weights of one row, a row being ``in / 32`` blocks back to back:

    Q4_1  20 bytes: float16 d, float16 m, 16 bytes of nibbles      w = d * q + m, q in 0..15
    Q8_0  34 bytes: float16 d, 32 int8 codes                       w = d * q,     q in -128..127
    Q4_0  18 bytes: float16 d, 16 bytes of nibbles                 w = d * (q - 8)

Byte ``j`` of the nibbles holds weight ``j`` in its low half and weight ``j + 16`` in its high half. Q4_0 is
stored as Q4_1 with ``m = -8 d`` (exact in float16: a power-of-two multiple), so one 4-bit kernel serves both.

The layers hold these bytes as the file has them (``Layout.ROWS``: ``[out, in / 32 * bytes]``), or, where the C++
kernels have the GGUF ops, only in the kernel's own order (``Layout.PANELS``, ``ggml_pack``; ``ggml_unpack``
gives the file's bytes back for ``dequantize``). ``dequantize`` equals ``gguf.quants.dequantize`` bit for bit:
the same float32 products and sum, in the same order.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn

from kvserve import native
from kvserve.quant.linear import Layout, QuantLinear
from kvserve.quant.schemes import ACT_BLOCK, Scheme

BLOCK = 32  # weights per GGML block (QK4_1 = QK8_0 = QK4_0 = 32)
Q4_0_BYTES = 18


class GGMLKind(enum.Enum):
    """The block formats a ``GGMLLinear`` holds (its value is the kernels' name for it)."""

    Q4_1 = "q4_1"
    Q8_0 = "q8_0"

    @property
    def block_bytes(self) -> int:
        """Bytes per block of 32 weights: 20 (Q4_1) or 34 (Q8_0)."""
        return 20 if self is GGMLKind.Q4_1 else 34


def _halves(v: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes ``start, start + 1`` of each block, as float32 ``[rows, blocks, 1]``."""
    return v[..., start:start + 2].contiguous().view(torch.float16).float()


def dequantize_blocks(blocks: torch.Tensor, kind: GGMLKind) -> torch.Tensor:
    """The weights of GGML blocks, float32 ``[rows, blocks_per_row * 32]``.

    Args:
        blocks: uint8 ``[rows, blocks_per_row * kind.block_bytes]``, the file's bytes.
        kind: their format.

    Bit for bit what ``gguf.quants.dequantize`` computes: float32 ``d * q`` (exact: an 11-bit by 8-bit
    product), then ``+ m`` for Q4_1 (the one rounding).
    """
    rows = blocks.shape[0]
    v = blocks.view(rows, -1, kind.block_bytes)  # [rows, blocks, bytes]
    d = _halves(v, 0)  # [rows, blocks, 1]
    if kind is GGMLKind.Q8_0:
        q = v[..., 2:].contiguous().view(torch.int8).float()  # [rows, blocks, 32]
        return q.mul_(d).view(rows, -1)
    nibbles = v[..., 4:]  # [rows, blocks, 16]
    q = torch.empty(rows, v.shape[1], 2, 16, device=blocks.device)  # [rows, blocks, half, 16]: weights 0-15, then 16-31
    q[:, :, 0] = nibbles & 0x0F
    q[:, :, 1] = nibbles >> 4
    q = q.view(rows, -1, BLOCK)  # [rows, blocks, 32]
    return q.mul_(d).add_(_halves(v, 2)).view(rows, -1)  # in place: a third of the time of d * q + m


def q4_0_as_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks ``[rows, n * 18]`` rewritten as Q4_1 ``[rows, n * 20]`` with ``m = -8 d``.

    Exact: ``d q + (-8 d)`` is ``d (q - 8)``, a value float32 holds, so the sum does not round (a zero weight
    of a negative ``d`` comes out +0.0 where Q4_0 gives -0.0; they compare equal).
    """
    rows = blocks.shape[0]
    v = blocks.view(rows, -1, Q4_0_BYTES)  # [rows, blocks, 18]
    d = v[..., :2]
    m = (d.contiguous().view(torch.float16) * -8).view(torch.uint8)  # [rows, blocks, 2]
    return torch.cat((d, m, v[..., 2:]), dim=-1).reshape(rows, -1)


def native_ops():
    """The C++ kernels when they have the GGUF block ops (``ggml_linear`` and its packing), else None."""
    module = native.load()
    return module if module is not None and hasattr(module, "ggml_linear") else None


class GGMLLinear(QuantLinear):
    """A projection computed with a GGUF tensor's own blocks, ``[..., in]`` -> ``[..., out]``.

    Args:
        blocks: uint8 ``[out, in / 32 * kind.block_bytes]``: the file's bytes for the tensor, rows in the order
            the model multiplies them (a permuted tensor already permuted back).
        kind: Q4_1 or Q8_0.
        bias: optional float ``[out]``.

    The kernel (``ggml_linear``) quantizes the activations to int8 per block of 32, as llama.cpp does for these
    formats; the reference applies the same ``quantize_activations(x, 32, 127)`` before ``F.linear`` on the
    dequantized weights, which it keeps (float32, four to seven times the blocks' bytes: made at load where there
    is no kernel, else at the first reference call) since dequantizing per call would cost more than the product.

    Raises:
        ValueError: a row that is not whole blocks.
    """

    scheme = Scheme.GGUF

    def __init__(self, blocks: torch.Tensor, kind: GGMLKind, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)  # QuantLinear.__init__ quantizes a float layer: here the codes exist already
        rows, width = blocks.shape
        if width % kind.block_bytes:
            raise ValueError(f"{kind.value} rows are whole blocks of {kind.block_bytes} bytes, got {width} bytes")
        self.kind = kind
        self._init_shape(width // kind.block_bytes * BLOCK, rows, BLOCK, bias)
        blocks = blocks.to(torch.uint8).contiguous()
        self.register_buffer("weight", self._packed(blocks))
        # without the kernel every call runs the reference: dequantize now, at load, not inside a request
        self._reference_cache = None if self.has_kernel else self.dequantize()

    def _layout_for_shape(self) -> Layout:
        return Layout.PANELS if self.has_kernel else Layout.ROWS

    @property
    def has_kernel(self) -> bool:
        return native_ops() is not None

    @property
    def kernel_act_block(self) -> int | None:
        return ACT_BLOCK

    def _packed(self, blocks: torch.Tensor) -> torch.Tensor:
        """The file's bytes in this layer's layout."""
        if self.layout is Layout.PANELS:
            return native_ops().ggml_pack(blocks, self.kind.value)
        return blocks

    def blocks(self) -> torch.Tensor:
        """The file's bytes, uint8 ``[out, in / 32 * block_bytes]`` (unpacked from the kernel's order if needed)."""
        if self.layout is Layout.PANELS:
            return native_ops().ggml_unpack(self.weight, self.kind.value, self.out_features, self.in_features)
        return self.weight

    def dequantize(self) -> torch.Tensor:
        return dequantize_blocks(self.blocks(), self.kind)

    def _reference_weight(self, dtype: torch.dtype) -> torch.Tensor:
        cache = self._reference_cache
        if cache is None or cache.device != self.weight.device or cache.dtype != dtype:
            cache = self._reference_cache = self.dequantize().to(dtype)
        return cache

    def _apply(self, fn, recurse: bool = True):
        # .to(device) / .bfloat16() move the buffers; the reference weights (a plain attribute) go with them
        super()._apply(fn, recurse)
        if self._reference_cache is not None:
            self._reference_cache = fn(self._reference_cache)
        return self

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return native_ops().ggml_linear(x, self.weight, self.kind.value, self.out_features, self.in_features)

    def _bind(self, module) -> Callable[[torch.Tensor], torch.Tensor]:
        return module.bind_ggml(self.weight, self.kind.value, self.out_features, self.in_features)

    def _stack_rows(self, layers: list[QuantLinear]) -> None:
        raw = torch.cat([m.blocks() for m in layers])  # [sum(out), bytes]: blocks run along `in`, rows stack
        self.weight = self._packed(raw)
        caches = [m._reference_cache for m in layers]
        self._reference_cache = None if any(c is None for c in caches) else torch.cat(caches)  # [sum(out), in]
        start = 0
        for m in layers:  # share the storage where the kernel's order keeps each layer's rows apart
            rows = self.weight[start:start + m.out_features]
            if rows.shape == m.weight.shape and torch.equal(rows, m.weight):
                m.weight = rows
            if self._reference_cache is not None:
                m._reference_cache = self._reference_cache[start:start + m.out_features]
            start += m.out_features

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def get_extra_state(self) -> dict:
        return {"scheme": self.scheme.value, "kind": self.kind.value, "group_size": self.group_size,
                "layout": self.layout.value}

    def set_extra_state(self, state: dict) -> None:
        if state.get("kind") != self.kind.value:
            raise ValueError(f"state holds {state.get('kind')} blocks, layer is {self.kind.value}")
        super().set_extra_state(state)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._reference_cache = None if self.has_kernel else self.dequantize()  # of the blocks just loaded

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.kind.value} (GGUF blocks of {BLOCK})"


class GGMLEmbedding(nn.Module):
    """A token embedding looked up in GGUF blocks: ids ``[...]`` -> ``[..., dim]`` in ``dtype``.

    Each looked-up row is dequantized as ``dequantize_blocks`` does, so it equals the file's row exactly, and
    the table stays at its stored size (SmolLM2's Q8_0 table: 30 MB instead of 113 MB of float32).

    Args:
        blocks: uint8 ``[vocab, dim / 32 * kind.block_bytes]`` (may be the tied LM head's own tensor).
        kind: their format.
        dtype: the dtype of the rows returned (the model's activations).
    """

    def __init__(self, blocks: torch.Tensor, kind: GGMLKind, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.kind, self.dtype = kind, dtype
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = blocks.shape[1] // kind.block_bytes * BLOCK
        self.register_buffer("weight_blocks", blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_blocks.index_select(0, input_ids.reshape(-1))  # [n, bytes]
        return dequantize_blocks(rows, self.kind).view(*input_ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.value} (GGUF blocks of {BLOCK})"

