"""KV sizing without torch: bytes per token, memory sizes, blocks per budget (the planner imports this)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

SCALE_BYTES = 2  # a quantized cache's scales are float16
INT4_GROUP = 32  # elements of a head vector sharing one scale in an int4 cache (llama.cpp's q4_0 block size)


class KVCacheDType(str, enum.Enum):
    """What the KV cache stores (``kvserve serve --kv-cache-dtype``).

    auto: the model's dtype. int8: per token and KV head, the head vector's int8 codes and one float16 scale
    (symmetric: x ~ code * scale, scale = max|x| / 127). int4: two codes per byte (-7..7), a float16 scale per
    group of ``INT4_GROUP`` elements along head_dim.
    """

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def quantized(self) -> bool:
        return self in (KVCacheDType.INT8, KVCacheDType.INT4)


@dataclass(slots=True, frozen=True)
class KVShape:
    """What one token costs in the cache: model geometry, element size and scales.

    Attributes:
        num_layers: decoder layers that keep a KV cache.
        num_kv_heads: key/value heads per layer (fewer than query heads under GQA).
        head_dim: channels per head.
        bytes_per_element: 2 for fp16/bf16, 4 for fp32, 1 for an int8/fp8 cache, 0.5 for int4 codes.
        scale_group: elements of a head vector sharing one float16 scale (``SCALE_BYTES``); 0: no scales (a
            float cache, or fp8 with one scale per tensor as vLLM keeps it).

    Raises:
        ValueError: from ``__post_init__`` when ``scale_group`` does not divide ``head_dim``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_element: float
    scale_group: int = 0

    def __post_init__(self) -> None:
        if self.scale_group < 0 or (self.scale_group and self.head_dim % self.scale_group):
            raise ValueError(f"a scale per {self.scale_group} elements does not divide head_dim {self.head_dim}")

    @property
    def scales_per_head(self) -> int:
        """float16 scales per token, KV head and K (or V)."""
        return self.head_dim // self.scale_group if self.scale_group else 0

    @property
    def code_bits(self) -> int:
        """Bits per stored element (32, 16, 8 or 4)."""
        return int(self.bytes_per_element * 8)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per resident token, scales included.

        bytes/token = 2 * L * H_kv * (d * b + s * 2)  (K and V for every layer; GQA, Ainslie et al. 2023, divides
        H_kv; s float16 scales per head vector, 0 for a float cache).
        """
        per_head = self.head_dim * self.bytes_per_element + self.scales_per_head * SCALE_BYTES
        return int(2 * self.num_layers * self.num_kv_heads * per_head)

    def formula(self) -> str:
        """The formula with this model's numbers, for logs and the capacity planner."""
        heads = f"2 x {self.num_layers} layers x {self.num_kv_heads} kv_heads"
        element = f"{self.bytes_per_element:g} B"
        if not self.scales_per_head:
            return f"{heads} x {self.head_dim} head_dim x {element} = {self.bytes_per_token:,} bytes/token"
        return (f"{heads} x ({self.head_dim} head_dim x {element} + {self.scales_per_head} scale"
                f"{'s' if self.scales_per_head > 1 else ''} x {SCALE_BYTES} B) = {self.bytes_per_token:,} bytes/token")


def cache_shape(num_layers: int, num_kv_heads: int, head_dim: int, cache_dtype: KVCacheDType,
                model_bytes: int) -> KVShape:
    """The KVShape of a ``cache_dtype`` cache (``model_bytes``: the model's bytes per element, for auto).

    Raises:
        ValueError: int4 with a head_dim that is not a multiple of ``INT4_GROUP``; int8 with one not a multiple
            of 8 (the attention kernel reads codes 8 at a time).
    """
    cache_dtype = KVCacheDType(cache_dtype)
    if cache_dtype is KVCacheDType.INT8 and head_dim % 8:
        raise ValueError(f"an int8 KV cache needs head_dim a multiple of 8, the model has {head_dim}")
    if cache_dtype is KVCacheDType.INT4 and head_dim % INT4_GROUP:
        raise ValueError(f"an int4 KV cache needs head_dim a multiple of {INT4_GROUP}, the model has {head_dim}")
    element, group = {KVCacheDType.AUTO: (model_bytes, 0), KVCacheDType.FLOAT32: (4, 0),
                      KVCacheDType.BFLOAT16: (2, 0), KVCacheDType.INT8: (1, head_dim),
                      KVCacheDType.INT4: (0.5, INT4_GROUP)}[cache_dtype]
    return KVShape(num_layers, num_kv_heads, head_dim, element, group)


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
