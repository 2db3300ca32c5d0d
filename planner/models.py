"""The planner's model geometry: a Llama-style decoder's sizes, the built-in presets, and a spec read from a
Hugging Face model directory (config.json and the safetensors headers). Light imports: json and struct, no torch.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.kvcache.sizing import KVCacheDType, KVShape, cache_shape


class KVDType(enum.Enum):
    """Element type of the KV cache (``--kv-dtype``). fp8 is vLLM's (one scale per tensor, nothing per token);
    int8 and int4 are ``kvserve serve --kv-cache-dtype``'s, float16 scales per token and head (int4: per group of
    ``kvcache.sizing.INT4_GROUP`` channels) counted in the bytes."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    FP8 = "fp8"

    @property
    def nbytes(self) -> float:
        """Bytes per element, scales not included."""
        return {KVDType.FP32: 4, KVDType.FP16: 2, KVDType.BF16: 2, KVDType.INT8: 1, KVDType.INT4: 0.5,
                KVDType.FP8: 1}[self]


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """The geometry of a Llama-style decoder, enough to size its weights and its KV cache.

    Raises:
        ValueError: from ``__post_init__`` on a non-positive size or query heads not a multiple of KV heads.
    """

    name: str
    num_layers: int
    num_heads: int            # query heads
    num_kv_heads: int         # key/value heads (fewer under GQA)
    head_dim: int
    hidden_size: int
    intermediate_size: int    # MLP width (gated: gate, up and down projections)
    vocab_size: int
    tied_embeddings: bool     # lm_head shares the embedding matrix
    qkv_bias: bool = False    # Qwen2 has biases on q, k and v
    num_params: int | None = None  # exact count (safetensors headers); None: estimated from the shapes
    max_context: int | None = None  # the model's context length (max_position_embeddings); None: unknown

    def __post_init__(self) -> None:
        sizes = (self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size,
                 self.intermediate_size, self.vocab_size)
        if min(sizes) < 1:
            raise ValueError(f"{self.name}: every size must be >= 1, got {sizes}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"{self.name}: {self.num_heads} query heads not a multiple of "
                             f"{self.num_kv_heads} KV heads")

    @property
    def params(self) -> int:
        """Parameter count: the exact one if known, else :meth:`estimate_params`."""
        return self.num_params if self.num_params is not None else self.estimate_params()

    def estimate_params(self) -> int:
        """Parameters of a Llama-architecture decoder (Touvron et al. 2023; transformers' LlamaForCausalLM).

        per layer = q, o: h x H*d each + k, v: h x H_kv*d each (+ q/k/v biases) + MLP 3 x h x I + 2 RMSNorms of h;
        total = L x per layer + embedding V x h (+ an untied lm_head V x h) + final norm h.
        Matches the published counts of the presets exactly (e.g. Llama-2-7B 6,738,415,616).
        """
        h, q_width, kv_width = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * h * q_width + 2 * h * kv_width
        if self.qkv_bias:
            attention += q_width + 2 * kv_width
        per_layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def kv_shape(self, kv_dtype: KVDType, num_kv_heads: int | None = None) -> KVShape:
        """The KV cost of one token; ``num_kv_heads`` overrides the model's (e.g. the query heads, for no GQA)."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        if kv_dtype in (KVDType.INT8, KVDType.INT4):
            return cache_shape(self.num_layers, heads, self.head_dim, KVCacheDType(kv_dtype.value), 2)
        return KVShape(self.num_layers, heads, self.head_dim, kv_dtype.nbytes)


def _preset(name: str, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, intermediate: int,
            vocab: int, context: int, tied: bool, qkv_bias: bool = False) -> ModelSpec:
    return ModelSpec(name, layers, heads, kv_heads, head_dim, hidden, intermediate, vocab, tied, qkv_bias,
                     max_context=context)


# Real configs (config.json of each model on the Hugging Face Hub): layers, heads, KV heads, head_dim, hidden,
# MLP width, vocabulary, context (max_position_embeddings).
PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _preset("smollm2-135m", 30, 9, 3, 64, 576, 1536, 49152, 8192, tied=True),
    _preset("qwen2.5-0.5b", 24, 14, 2, 64, 896, 4864, 151936, 32768, tied=True, qkv_bias=True),
    _preset("llama-2-7b", 32, 32, 32, 128, 4096, 11008, 32000, 4096, tied=False),
    _preset("mistral-7b", 32, 32, 8, 128, 4096, 14336, 32000, 32768, tied=False),
    _preset("llama-3-8b", 32, 32, 8, 128, 4096, 14336, 128256, 8192, tied=False),
    _preset("llama-2-13b", 40, 40, 40, 128, 5120, 13824, 32000, 4096, tied=False),
    _preset("llama-2-70b", 80, 64, 8, 128, 8192, 28672, 32000, 4096, tied=False),
)}
ALIASES = {"0.5b": "qwen2.5-0.5b", "7b": "llama-2-7b", "13b": "llama-2-13b", "70b": "llama-2-70b"}

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def safetensors_param_count(model_dir: Path) -> int | None:
    """Parameters summed from the headers of ``*.safetensors`` (format: u64 LE header length, JSON header).

    Returns None when there is no file or a tensor is not floating point (a quantized checkpoint's packed
    integers do not count parameters).
    """
    files = sorted(model_dir.glob("*.safetensors"))
    total = 0
    for file in files:
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _FLOAT_DTYPES:
                return None
            total += math.prod(entry["shape"])
    return total if files else None


def spec_from_hf_dir(model_dir: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a local Hugging Face model directory (its config.json and safetensors headers).

    Raises:
        FileNotFoundError: no config.json in ``model_dir``.
        ValueError: config.json lacks a required field (num_hidden_layers, num_attention_heads, hidden_size, ...).
    """
    path = Path(model_dir)
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)  # multimodal configs nest the decoder's
    try:
        return _spec_from_config(path, config)
    except KeyError as error:
        raise ValueError(f"{path / 'config.json'} has no field {error}") from error


def _spec_from_config(path: Path, config: dict[str, Any]) -> ModelSpec:
    heads = config["num_attention_heads"]
    return ModelSpec(
        name=path.name, num_layers=config["num_hidden_layers"], num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"], tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        num_params=safetensors_param_count(path), max_context=_positive_int(config.get("max_position_embeddings")))


def _positive_int(value: Any) -> int | None:
    """``value`` if it is an integer >= 1 (bool excluded), else None: a malformed field is treated as absent."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None
