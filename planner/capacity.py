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
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvserve.engine.options import Device, DType, activation_dtype
from kvserve.kvcache.sizing import KVCacheDType, parse_bytes
from kvserve.planner.models import ALIASES, PRESETS, KVDType, ModelSpec, spec_from_hf_dir
from kvserve.server.config import ServeConfig

# kvserve serve's --kv-cache-dtype names, as the planner's element types
SERVE_KV = {KVCacheDType.FLOAT32.value: KVDType.FP32, KVCacheDType.BFLOAT16.value: KVDType.BF16,
            KVCacheDType.INT8.value: KVDType.INT8, KVCacheDType.INT4.value: KVDType.INT4}


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
    block_size: int = ServeConfig().block_size  # tokens per KV block (the server's default)

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


def kv_dtype_for(choice: str, dtype: DType, device: Device) -> KVDType:
    """The KV element type of ``--kv-cache-dtype choice``: auto is what ``kvserve serve`` allocates with these
    ``--dtype`` and ``--device`` (``engine.options.activation_dtype``: float32 on a CPU, bfloat16 on a GPU); serve's
    names map to the planner's, which also has vLLM's fp16 and fp8 caches.

    Raises:
        ValueError: a name neither knows.
    """
    if choice == KVCacheDType.AUTO.value:
        return KVDType.FP32 if activation_dtype(DType(dtype), Device(device)) is DType.FLOAT32 else KVDType.BF16
    return SERVE_KV.get(choice) or KVDType(choice)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvserve plan`` flags; the KV cache's and blocks' defaults are ``kvserve serve``'s (ServeConfig)."""
    serve = ServeConfig()
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="a local Hugging Face model directory (reads config.json)")
    source.add_argument("--preset", default="smollm2-135m", choices=[*PRESETS, *ALIASES],
                        help="a built-in model config (default smollm2-135m, the served model)")
    parser.add_argument("--memory", type=_comma_list(_parse_bytes), default="8GiB,16GiB,24GiB,80GiB",
                        help="accelerator memory sizes, comma-separated (default 8GiB,16GiB,24GiB,80GiB)")
    parser.add_argument("--context", type=_comma_list(int), default="2048,8192",
                        help="context lengths per user in tokens, comma-separated (default 2048,8192)")
    kinds = [KVCacheDType.AUTO.value, *SERVE_KV, *(kind.value for kind in KVDType)]
    parser.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default=serve.kv_cache_dtype.value,
                        choices=kinds, metavar="{" + ",".join(kinds) + "}",
                        help="KV cache element type, as kvserve serve --kv-cache-dtype (and vLLM's fp16, fp8); "
                             f"default {serve.kv_cache_dtype.value}: what kvserve serve allocates with --dtype and "
                             "--device (float32 on a CPU, bfloat16 on a GPU)")
    parser.add_argument("--dtype", default=serve.dtype.value, choices=[v.value for v in DType],
                        help=f"as kvserve serve --dtype (default {serve.dtype.value}): the auto KV cache's dtype")
    parser.add_argument("--device", default=serve.device.value, choices=[v.value for v in Device],
                        help=f"as kvserve serve --device (default {serve.device.value}: a GPU when torch sees one, "
                             "else the CPU): the auto KV cache's dtype")
    parser.add_argument("--reserve-fraction", type=float, default=0.10,
                        help="share of memory kept for activations and runtime (default 0.10)")
    parser.add_argument("--block-size", type=int, default=serve.block_size,
                        help=f"tokens per KV block (default {serve.block_size}, as kvserve serve)")
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
        kv_dtype = kv_dtype_for(args.kv_dtype, args.dtype, args.device)
        config = PlanConfig(args.memory, args.context, kv_dtype, args.reserve_fraction, args.block_size)
    except (OSError, ValueError) as error:
        print(f"kvserve plan: {error}", file=sys.stderr)
        return 2
    data = report(spec, config)
    data["kv"]["asked"] = args.kv_dtype  # auto, or the name given
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        if args.kv_dtype == KVCacheDType.AUTO.value:
            print(f"KV cache dtype auto: {kv_dtype.value}, as kvserve serve allocates it with --dtype {args.dtype} "
                  f"--device {args.device} on this machine (--kv-cache-dtype names another)")
        _print_tables(data, config)
    return 0
