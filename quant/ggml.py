"""A GGUF file's own quantized blocks as kvserve layers: ``GGMLLinear`` (a projection) and ``GGMLEmbedding``.

llama.cpp's block formats (ggml-common.h; the ``gguf`` package reads and dequantizes them the same way). A row is
``in / weights`` units back to back; a unit covers 32 consecutive weights, or 256 for the K-quants (super-blocks
of 8 sub-blocks of 32, each with its own 6-bit scale and minimum, or 16 of 16 with an 8-bit scale for Q6_K):

    Q4_0  18 B / 32:   float16 d, 16 bytes of nibbles                          w = d (q - 8)
    Q4_1  20 B / 32:   float16 d, float16 m, 16 bytes of nibbles              w = d q + m
    Q5_0  22 B / 32:   float16 d, 32 fifth bits, 16 bytes of nibbles           w = d (q - 16)
    Q5_1  24 B / 32:   float16 d, float16 m, 32 fifth bits, nibbles           w = d q + m
    Q8_0  34 B / 32:   float16 d, 32 int8 codes                                w = d q
    Q4_K  144 B / 256: float16 d, dmin; 12 bytes of 6-bit (sc, m); nibbles     w = (d sc) q - (dmin m)
    Q5_K  176 B / 256: as Q4_K plus 32 bytes of fifth bits                     w = (d sc) q - (dmin m)
    Q6_K  210 B / 256: 4 low bits, 2 high bits, int8 scale per 16, float16 d   w = (d sc) (q - 32)

In a 32-weight unit byte ``j`` of the nibbles holds weight ``j`` (low half) and ``j + 16`` (high half); the
K-quants' and Q6_K's orders are in ``dequantize_blocks``.

The layers hold these bytes as the file has them (``Layout.ROWS``: ``[out, in / weights * bytes]``), or, where the
C++ kernels have the GGUF ops, only in the kernel's own order (``Layout.PANELS``, ``ggml_pack``; ``ggml_unpack``
gives the file's bytes back for ``dequantize``). ``dequantize`` equals ``gguf.quants.dequantize`` bit for bit:
the same float32 products and sums, in the same order (every product is exact; a weight has at most one rounding).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn

from kvserve import native
from kvserve.quant.linear import Layout, QuantLinear
from kvserve.quant.schemes import ACT_BLOCK, Scheme

BLOCK = 32  # weights per block, and per activation block of the kernels
SUPER_BLOCK = 256  # activation values per scale of the K-quant kernels (llama.cpp's Q8_K)


class GGMLKind(enum.Enum):
    """The block formats a ``GGMLLinear`` holds, by their ``gguf.GGMLQuantizationType`` names (``GGMLKind[t.name]``);
    the value is the kernels' name for it."""

    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    Q8_0 = "q8_0"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"

    @property
    def block_bytes(self) -> int:
        """Bytes per unit (``block_weights`` weights), as ggml's ``GGML_QUANT_SIZES``."""
        return _UNITS[self][0]

    @property
    def block_weights(self) -> int:
        """Weights per unit: 32, or 256 for the K-quants' super-blocks."""
        return _UNITS[self][1]


_UNITS = {GGMLKind.Q4_0: (18, 32), GGMLKind.Q4_1: (20, 32), GGMLKind.Q5_0: (22, 32), GGMLKind.Q5_1: (24, 32),
          GGMLKind.Q8_0: (34, 32), GGMLKind.Q4_K: (144, 256), GGMLKind.Q5_K: (176, 256), GGMLKind.Q6_K: (210, 256)}


def _halves(v: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes ``start, start + 1`` of each unit, as float32 ``[rows, units, 1]``."""
    return v[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(v: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` as codes ``[..., 2, n]``: the low nibbles, then the high ones (int32)."""
    v = v.int()
    return torch.stack((v & 0x0F, v >> 4), dim=-2)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 bytes of fifth bits ``[rows, units, 4]`` as ``[rows, units, 32]`` values 0 or 16."""
    word = qh.contiguous().view(torch.int32)  # [rows, units, 1], little-endian as the file
    return ((word >> torch.arange(32, device=qh.device, dtype=torch.int32)) & 1) << 4


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes ``[rows, units, 12]`` as 8 scales and 8 minimums (float32 ``[rows, units, 8,
    1]``), as ggml's ``get_scale_min_k4``: sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7, sub-blocks 4-7 in
    the nibbles of bytes 8-11 with their top 2 bits in the high bits of bytes 0-7."""
    s = scales.int()
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _codes32(v: torch.Tensor, qs: int, qh: int | None) -> torch.Tensor:
    """A 32-weight unit's codes float32 ``[rows, units, 32]`` from the nibbles at byte ``qs`` (and the fifth bits
    at ``qh``)."""
    q = _nibbles(v[..., qs:qs + 16]).flatten(-2)  # [rows, units, 32]: weights 0-15, then 16-31
    if qh is not None:
        q = q | _fifth_bits(v[..., qh:qh + 4])
    return q.float()


def _dequantize_k45(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Q4_K / Q5_K units ``[rows, units, bytes]``: ``(d sc) q - (dmin m)`` per sub-block of 32."""
    sc, mn = _scale_min_k4(v[..., 4:16])
    d = _halves(v, 0).unsqueeze(-1).mul(sc)  # [rows, units, 8, 1], exact
    dm = _halves(v, 2).unsqueeze(-1).mul(mn)
    qs = 48 if bits == 5 else 16
    q = _nibbles(v[..., qs:qs + 128].unflatten(-1, (4, 32))).flatten(-3, -2)  # [rows, units, 8, 32]: 2j low, 2j+1 high
    if bits == 5:
        sub_block = torch.arange(8, device=v.device, dtype=torch.int32).view(8, 1)
        q = q | (((v[..., 16:48].int().unsqueeze(-2) >> sub_block) & 1) << 4)
    return q.float().mul_(d).sub_(dm).flatten(-2)


def _dequantize_q6_k(v: torch.Tensor) -> torch.Tensor:
    """Q6_K units: weight ``128 h + 32 s + l`` has low bits from ql ``64 h + 32 (s % 2) + l`` (the high nibble for
    s >= 2) and high bits ``qh[32 h + l] >> 2 s``; ``(d sc) (q - 32)`` per 16 weights."""
    low = _nibbles(v[..., 0:128].unflatten(-1, (2, 64))).flatten(-2)  # [rows, units, 2, 128]
    shifts = torch.arange(0, 8, 2, device=v.device, dtype=torch.int32).view(4, 1)
    high = ((v[..., 128:192].unflatten(-1, (2, 32)).int().unsqueeze(-2) >> shifts) & 3).flatten(-2)  # [.., 2, 128]
    q = ((low | (high << 4)) - 32).float().flatten(-2).unflatten(-1, (16, 16))  # [rows, units, 16, 16]
    d = _halves(v, 208).unsqueeze(-1).mul(v[..., 192:208].contiguous().view(torch.int8).float().unsqueeze(-1))
    return q.mul_(d).flatten(-2)


def dequantize_blocks(blocks: torch.Tensor, kind: GGMLKind) -> torch.Tensor:
    """The weights of GGML units, float32 ``[rows, units_per_row * kind.block_weights]``.

    Args:
        blocks: uint8 ``[rows, units_per_row * kind.block_bytes]``, the file's bytes.
        kind: their format.

    Bit for bit what ``gguf.quants.dequantize`` computes: the same float32 operations (``d * q``, ``d * sc`` and
    their products are exact: at most 23 significant bits), then ``+ m`` (Q4_1, Q5_1) or ``- dmin m`` (Q4_K,
    Q5_K), the one rounding.
    """
    rows = blocks.shape[0]
    v = blocks.view(rows, -1, kind.block_bytes)  # [rows, units, bytes]
    d = _halves(v, 0)  # [rows, units, 1] (the K-quants' own d is read by their helpers)
    if kind is GGMLKind.Q8_0:
        w = v[..., 2:].contiguous().view(torch.int8).float().mul_(d)  # [rows, units, 32]
    elif kind is GGMLKind.Q4_0:
        w = _codes32(v, 2, None).sub_(8).mul_(d)
    elif kind is GGMLKind.Q5_0:
        w = _codes32(v, 6, 2).sub_(16).mul_(d)
    elif kind is GGMLKind.Q4_1:
        w = _codes32(v, 4, None).mul_(d).add_(_halves(v, 2))  # in place: a third of the time of d * q + m
    elif kind is GGMLKind.Q5_1:
        w = _codes32(v, 8, 4).mul_(d).add_(_halves(v, 2))
    elif kind is GGMLKind.Q6_K:
        w = _dequantize_q6_k(v)
    else:
        w = _dequantize_k45(v, 5 if kind is GGMLKind.Q5_K else 4)
    return w.reshape(rows, -1)


def native_ops():
    """The C++ kernels when they have the GGUF block ops (``ggml_linear`` and its packing), else None."""
    module = native.load()
    return module if module is not None and hasattr(module, "ggml_linear") else None


def panel_width() -> int:
    """Output features per panel of ``ggml_pack``'s layout on the ISA path the kernels run: 16 on AVX-512, 8
    otherwise (the scalar reference reads AVX2's panels; csrc/ukernel.h's ``KV_NR_*``).

    Raises:
        RuntimeError: the kernels do not run here (no panels then).
    """
    ops = native_ops()
    if ops is None:
        raise RuntimeError("the GGUF kernels do not run here: their layers keep the file's rows")
    return 16 if ops.isa() == "avx512" else 8


class GGMLLinear(QuantLinear):
    """A projection computed with a GGUF tensor's own blocks, ``[..., in]`` -> ``[..., out]``.

    Args:
        blocks: uint8 ``[out, in / kind.block_weights * kind.block_bytes]``: the file's bytes for the tensor, rows
            in the order the model multiplies them (a permuted tensor already permuted back).
        kind: its format (``GGMLKind[tensor.tensor_type.name]``).
        bias: optional float ``[out]``.

    The kernel (``ggml_linear``) quantizes the activations to int8 per block of 32 (llama.cpp's Q8_0 blocks), or
    for the K-quants per super-block of 256 (llama.cpp's Q8_K: their sub-block scales then fold in integer,
    docs/kernels.md); the reference applies the same ``quantize_activations(x, kernel_act_block, 127)`` before
    ``F.linear`` on the dequantized weights, which it keeps (float32,
    four to seven times the blocks' bytes: made at load where there is no kernel, else at the first reference
    call) since dequantizing per call would cost more than the product.

    Raises:
        ValueError: a row that is not whole blocks (units).
    """

    scheme = Scheme.GGUF

    def __init__(self, blocks: torch.Tensor, kind: GGMLKind, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)  # QuantLinear.__init__ quantizes a float layer: here the codes exist already
        rows, width = blocks.shape
        if width % kind.block_bytes:
            raise ValueError(f"{kind.value} rows are whole blocks of {kind.block_bytes} bytes, got {width} bytes")
        self.kind = kind
        self._init_shape(width // kind.block_bytes * kind.block_weights, rows, BLOCK, bias)
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
        return SUPER_BLOCK if self.kind in (GGMLKind.Q4_K, GGMLKind.Q5_K, GGMLKind.Q6_K) else ACT_BLOCK

    def _packed(self, blocks: torch.Tensor) -> torch.Tensor:
        """The file's bytes in this layer's layout."""
        if self.layout is Layout.PANELS:
            return native_ops().ggml_pack(blocks, self.kind.value)
        return blocks

    def blocks(self) -> torch.Tensor:
        """The file's bytes, uint8 ``[out, in / block_weights * block_bytes]`` (unpacked from the kernel's order if
        needed)."""
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

    def _handle(self, module):
        return module.ggml_handle(self.weight, self.kind.value, self.out_features, self.in_features)

    def _stack_rows(self, layers: list[QuantLinear]) -> None:
        # rows of the stacked weight per row of a layer's: one (the file's rows), or a panel of the kernel's
        # width, where a layer's rows are whole panels of the stack only if it starts at a panel's first feature
        width = panel_width() if self.layout is Layout.PANELS else 1
        if all(m.out_features % width == 0 for m in layers[:-1]):
            # each panel holds its own features' units alone (ggml_pack), so when every layer but the last fills
            # whole panels, the layers' panels stacked are their stacked rows packed: moved as they are
            self._move_weights(layers)
        else:
            raw = torch.cat([m.blocks() for m in layers])  # [sum(out), bytes]: blocks run along `in`, rows stack
            self.weight = self._packed(raw)
            start = 0
            for m in layers:  # share the storage where the stack holds each layer's own bytes
                rows = self.weight[start // width:start // width + m.weight.shape[0]]
                if start % width == 0 and rows.shape == m.weight.shape and torch.equal(rows, m.weight):
                    m.weight = rows
                start += m.out_features
        caches = [m._reference_cache for m in layers]
        self._reference_cache = None if any(c is None for c in caches) else torch.cat(caches)  # [sum(out), in]
        start = 0
        for m in layers:
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
        return (f"in={self.in_features}, out={self.out_features}, {self.kind.value} "
                f"(GGUF units of {self.kind.block_weights})")


class GGMLEmbedding(nn.Module):
    """A token embedding looked up in GGUF blocks: ids ``[...]`` -> ``[..., dim]`` in ``dtype``.

    Each looked-up row is dequantized as ``dequantize_blocks`` does, so it equals the file's row exactly, and
    the table stays at its stored size (SmolLM2's Q8_0 table: 30 MB instead of 113 MB of float32).

    Args:
        blocks: uint8 ``[vocab, dim / kind.block_weights * kind.block_bytes]`` (may be the tied LM head's own
            tensor).
        kind: their format.
        dtype: the dtype of the rows returned (the model's activations).

    ``tied_to`` makes one that reads a tied LM head's blocks in the kernels' panels instead.
    """

    def __init__(self, blocks: torch.Tensor, kind: GGMLKind, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.kind, self.dtype = kind, dtype
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = blocks.shape[1] // kind.block_bytes * kind.block_weights
        self.__dict__["head"] = None  # tied_to's
        self.register_buffer("weight_blocks", blocks)

    @classmethod
    def tied_to(cls, head: GGMLLinear, dtype: torch.dtype = torch.float32) -> GGMLEmbedding:
        """The embedding of a model whose LM head is tied to it: rows looked up in ``head``'s own buffer, in
        whichever layout it has (``ggml_rows`` takes a row's units out of the kernels' panels), so the table is
        held once: a tied Q6_K table of Llama 3's vocabulary is 205 MiB, which a second copy (or the file's pages
        of it, resident as tokens are looked up) would add to the resident set.

        Args:
            head: the LM head ``[vocab, dim]`` (GGMLLinear, any layout).
            dtype: as the constructor's.
        """
        if head.layout is Layout.ROWS:
            return cls(head.weight, head.kind, dtype)
        embedding = cls(head.weight[:0], head.kind, dtype)
        embedding.num_embeddings, embedding.embedding_dim = head.out_features, head.in_features
        embedding.weight_blocks = None  # the table is the head's buffer: one owner, one entry in a state dict
        embedding.__dict__["head"] = head  # not a submodule: the model's walks meet the head once, as lm_head
        return embedding

    @property
    def panel_rows(self) -> int:
        """Rows per panel of the table ``table()`` returns: 0 for rows in the file's order."""
        return 0 if self.head is None else panel_width()

    def table(self) -> torch.Tensor:
        """The blocks rows are looked up in: ``weight_blocks``, or the tied head's panels (``panel_rows``)."""
        return self.weight_blocks if self.head is None else self.head.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.head is None:
            rows = self.weight_blocks.index_select(0, ids)  # [n, bytes]
        else:
            rows = native_ops().ggml_rows(self.head.weight, self.kind.value, ids.to(torch.long), self.num_embeddings,
                                          self.embedding_dim)
        return dequantize_blocks(rows, self.kind).view(*input_ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.value} "
                f"(GGUF units of {self.kind.block_weights})")

