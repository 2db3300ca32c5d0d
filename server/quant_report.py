"""``kvserve quant report``: load the served model and print quant.report's quality tables for it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvserve quant report``."""
    parser.add_argument("--model", default=None,
                        help="local HF model directory or GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--kv-only", action="store_true",
                        help="only the KV cache section (int8 and int4 caches against the model's own)")


KV_REPORTED = ("int8", "int4")  # the cache dtypes of the KV section


def register_kv_caches(config) -> dict[str, tuple[str, int]]:
    """A transformers attention implementation per cache dtype in ``KV_REPORTED``: SDPA over the keys and values
    as that cache gives them back (``kvserve.kvcache.pool.KVPool.roundtrip``'s rule), for quant.report.

    Returns:
        ``{cache dtype: (implementation name, KV bytes per token of ``config``'s model)}``.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvserve.engine.loader import kv_shape_of
    from kvserve.kvcache.pool import KVPool, storage_dtype
    from kvserve.kvcache.sizing import KVCacheDType

    import torch

    caches = {}
    for name in KV_REPORTED:
        shape = kv_shape_of(config, torch.float32, KVCacheDType(name))
        pool = KVPool(shape, 1, 1, storage_dtype(shape, torch.float32))  # one slot: only its rule is used

        def attention(module, query, key, value, attention_mask, _pool=pool, **kwargs):
            return sdpa_attention_forward(module, query, _pool.roundtrip(key), _pool.roundtrip(value),
                                          attention_mask, **kwargs)
        AttentionInterface.register(f"kvserve-kv-{name}", attention)
        caches[name] = (f"kvserve-kv-{name}", shape.bytes_per_token)
    return caches


def run(args: argparse.Namespace) -> int:
    """Load the model in float32 on CPU, measure, print (and write) the report."""
    import copy

    from kvserve.engine.gguf_model import use_gguf_blocks
    from kvserve.engine.loader import Device, DType, gguf_file, load_model
    from kvserve.quant.report import collect, render

    loaded = load_model(args.model, DType.FLOAT32, Device.CPU)
    model = copy.deepcopy(loaded.model)
    model.set_attn_implementation("sdpa")  # plain forward/generate; the paged hook needs serving metadata
    path = gguf_file(args.model)
    own_blocks = None if path is None else (lambda m: use_gguf_blocks(m, path))  # a GGUF: its own blocks too
    data = collect(model, loaded.tokenizer, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                   own_blocks=own_blocks, kv_caches=register_kv_caches(model.config), kv_only=args.kv_only)
    text = json.dumps(data, indent=2) if args.json else render(data)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0
