"""Capacity planner (``kvserve plan``): how much context, for how many users, fits in a memory size.

How one accelerator's memory is split (per memory size, per weight width)::

    memory ──┬── reserve   = fraction x memory   activations, CUDA context, fragmentation
             ├── weights   = params x bits/8
             └── KV pool   = the rest   -> blocks = pool // (block_size x bytes/token)
                                        -> tokens = blocks x block_size
                                        -> users at context c = blocks // ceil(c / block_size)

The default reserve of 10% is vLLM's default ``gpu_memory_utilization=0.9``. Users are counted as each holding
a full context of c tokens in whole blocks (PagedAttention, Kwon et al. 2023); prefix sharing only adds room.
Imports stay light (json, no torch, no model code) so the planner starts in a blink.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import struct
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvserve.kvcache.sizing import KVCacheDType, KVShape, cache_shape, parse_bytes


class WeightDType(enum.Enum):
    """Weight storage width. int4 is group-wise with group 128 and an fp16 scale and zero per group."""

    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits_per_weight(self) -> float:
        """Bits per parameter, scales included (int8's one scale per output row is under 0.1% and ignored)."""
        int4_scales = 32 / 128  # an fp16 scale and an fp16 zero per group of 128 weights
        return {WeightDType.FP16: 16.0, WeightDType.INT8: 8.0, WeightDType.INT4: 4.0 + int4_scales}[self]


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


@dataclass(slots=True)
class PlanConfig:
    """What to plan for.

    Raises:
        ValueError: from ``__post_init__`` on an empty list, a non-positive size or a reserve outside [0, 1).
    """

    memories: list[int]                 # accelerator memory sizes (bytes)
    contexts: list[int]                 # context lengths a user holds (tokens)
    kv_dtype: KVDType = KVDType.FP16
    reserve_fraction: float = 0.10      # of memory, kept off the KV pool (vLLM: gpu_memory_utilization=0.9)
    block_size: int = 16                # tokens per KV block (the server's default)

    def __post_init__(self) -> None:
        if not self.memories or min(self.memories) < 1:
            raise ValueError(f"memory sizes must be positive, got {self.memories}")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"context lengths must be positive, got {self.contexts}")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1, got {self.block_size}")


@dataclass(slots=True, frozen=True)
class PlanRow:
    """One memory size at one weight width. Bytes and tokens; ``users`` maps context length to users."""

    memory_bytes: int
    weight_dtype: str
    weights_bytes: int
    reserve_bytes: int
    kv_pool_bytes: int      # 0 when weights and reserve do not fit
    num_blocks: int
    tokens: int
    users: dict[int, int]


def plan(spec: ModelSpec, config: PlanConfig) -> list[PlanRow]:
    """Rows for every memory size x weight width (fp16, int8, int4), in that order."""
    block_bytes = spec.kv_shape(config.kv_dtype).bytes_per_token * config.block_size
    rows = []
    for memory in config.memories:
        for weight_dtype in WeightDType:
            weights = math.ceil(spec.params * weight_dtype.bits_per_weight / 8)
            reserve = int(memory * config.reserve_fraction)
            pool = max(0, memory - reserve - weights)
            blocks = pool // block_bytes
            users = {context: blocks // math.ceil(context / config.block_size) for context in config.contexts}
            rows.append(PlanRow(memory, weight_dtype.value, weights, reserve, pool, blocks,
                                blocks * config.block_size, users))
    return rows


def _comma_list(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type for a comma-separated list of ``parse``-able items."""

    def parse_list(text: str) -> list[Any]:
        try:
            return [parse(item) for item in text.split(",") if item.strip()]
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error
    return parse_list


def _parse_bytes(text: str) -> int:

    return parse_bytes(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvserve plan`` flags."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="a local Hugging Face model directory (reads config.json)")
    source.add_argument("--preset", default="smollm2-135m", choices=[*PRESETS, *ALIASES],
                        help="a built-in model config (default smollm2-135m, the served model)")
    parser.add_argument("--memory", type=_comma_list(_parse_bytes), default="8GiB,16GiB,24GiB,80GiB",
                        help="accelerator memory sizes, comma-separated (default 8GiB,16GiB,24GiB,80GiB)")
    parser.add_argument("--context", type=_comma_list(int), default="2048,8192",
                        help="context lengths per user in tokens, comma-separated (default 2048,8192)")
    parser.add_argument("--kv-dtype", type=KVDType, default=KVDType.FP16, choices=list(KVDType),
                        metavar="{" + ",".join(kind.value for kind in KVDType) + "}", help="KV cache element type")
    parser.add_argument("--reserve-fraction", type=float, default=0.10,
                        help="share of memory kept for activations and runtime (default 0.10)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def report(spec: ModelSpec, config: PlanConfig) -> dict[str, Any]:
    """Everything the planner knows, as a JSON-ready dict (what ``--json`` prints)."""
    shape = spec.kv_shape(config.kv_dtype)
    no_gqa = spec.kv_shape(config.kv_dtype, num_kv_heads=spec.num_heads)
    return {
        "model": {**asdict(spec), "params": spec.params,
                  "params_source": "safetensors headers" if spec.num_params is not None else "estimated from config"},
        "kv": {"dtype": config.kv_dtype.value, "bytes_per_token": shape.bytes_per_token, "formula": shape.formula(),
               "bytes_per_token_without_gqa": no_gqa.bytes_per_token},
        "reserve_fraction": config.reserve_fraction, "block_size": config.block_size,
        "rows": [asdict(row) for row in plan(spec, config)],
    }


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:,.1f} MiB"


def _print_tables(data: dict[str, Any], config: PlanConfig) -> None:
    console = Console(highlight=False, soft_wrap=True)
    model, kv = data["model"], data["kv"]
    console.print(f"[bold]{escape(model['name'])}[/]: {model['num_layers']} layers, {model['num_heads']} heads, "
                  f"{model['num_kv_heads']} KV heads, head_dim {model['head_dim']}, "
                  f"{model['params']:,} parameters ({model['params_source']})")
    console.print(f"KV cache ({kv['dtype']}): {kv['formula']} ({kv['bytes_per_token'] / 1024:,.1f} KiB)")
    if model["num_kv_heads"] != model["num_heads"]:
        console.print(f"  without GQA ({model['num_heads']} KV heads): {kv['bytes_per_token_without_gqa']:,} "
                      f"bytes/token, {model['num_heads'] // model['num_kv_heads']}x more")
    console.print(f"Reserved: {config.reserve_fraction:.0%} of memory for activations and runtime; "
                  f"KV in blocks of {config.block_size} tokens; int4 = {WeightDType.INT4.bits_per_weight} bits/weight "
                  "(group 128 scales and zeros)")
    for memory in config.memories:
        table = Table(title=f"{_size(memory)}: how much context, for how many users")
        for header in ("weights", "size", "KV pool", "tokens\nthat fit",
                       *(f"users at\n{context:,}" for context in config.contexts)):
            table.add_column(header, justify="right", min_width=7)
        for row in data["rows"]:
            if row["memory_bytes"] != memory:
                continue
            fits = row["kv_pool_bytes"] > 0
            table.add_row(row["weight_dtype"], _size(row["weights_bytes"]),
                          _size(row["kv_pool_bytes"]) if fits else "[red]does not fit[/]", f"{row['tokens']:,}",
                          *("-" if _beyond(context, model) else f"{users:,}"
                            for context, users in row["users"].items()))
        console.print(table)
    beyond = [f"{context:,}" for context in config.contexts if _beyond(context, model)]
    if beyond:
        console.print(f"-: {', '.join(beyond)} tokens is more than the model's context of {model['max_context']:,}")


def _beyond(context: int, model: dict[str, Any]) -> bool:
    return model.get("max_context") is not None and context > model["max_context"]


def run(args: argparse.Namespace) -> int:
    """``kvserve plan``: print the tables (or JSON); returns 0, or 2 on a bad model directory or value."""
    try:
        spec = spec_from_hf_dir(args.model) if args.model else PRESETS[ALIASES.get(args.preset, args.preset)]
        config = PlanConfig(args.memory, args.context, args.kv_dtype, args.reserve_fraction, args.block_size)
    except (OSError, ValueError) as error:
        print(f"kvserve plan: {error}", file=sys.stderr)
        return 2
    data = report(spec, config)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_tables(data, config)
    return 0
