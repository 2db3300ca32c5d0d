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
    parser.add_argument("--kv-caches", default=",".join(KV_REPORTED),
                        help=f"the KV section's cache dtypes, a comma list of {', '.join(KV_CACHES)} "
                             f"(default {','.join(KV_REPORTED)})")


KV_CACHES = ("int8", "int4", "bfloat16")  # the cache dtypes the KV section can measure
KV_REPORTED = ("int8", "int4")  # the ones it measures by default


def _bf16_cache_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """A bfloat16 cache's attention as native/csrc/attend_bf16.h computes it, in torch: query, keys and values
    rounded to bfloat16, scores and softmax in float32, the weights rounded to bfloat16 before the sum over values
    (float32). The roundings are the kernel's; the order of the sums is torch's (close, not its bits).
    query [B, H, T, D], key/value [B, H_kv, S, D]; returns ([B, T, H, D], None) as transformers expects."""
    import torch

    def rounded(x):
        return x.to(torch.bfloat16).float()

    groups = query.shape[1] // key.shape[1]
    q, k, v = rounded(query), rounded(key).repeat_interleave(groups, 1), rounded(value).repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if attention_mask is not None:
        scores = (scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype is torch.bool
                  else scores + attention_mask[..., :k.shape[-2]])
    elif query.shape[2] > 1:  # causal, the queries the last positions
        t, s = query.shape[2], k.shape[2]
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(s - t + 1), float("-inf"))
    out = rounded(scores.softmax(-1)) @ v
    return out.transpose(1, 2).contiguous(), None


def register_kv_caches(config, names: tuple[str, ...] = KV_REPORTED) -> dict[str, tuple[str, int]]:
    """A transformers attention implementation per cache dtype of ``names``: for int8 / int4, SDPA over the keys
    and values as that cache gives them back (``kvserve.kvcache.pool.KVPool.roundtrip``'s rule); for bfloat16,
    ``_bf16_cache_attention`` (the query and the weights rounded too, as its kernel does); for quant.report.

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
    for name in names:
        shape = kv_shape_of(config, torch.float32, KVCacheDType(name))
        if name == "bfloat16":
            AttentionInterface.register("kvserve-kv-bfloat16", _bf16_cache_attention)
            caches[name] = ("kvserve-kv-bfloat16", shape.bytes_per_token)
            continue
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

    names = tuple(c.strip() for c in args.kv_caches.split(",") if c.strip())
    unknown = sorted(set(names) - set(KV_CACHES))
    if unknown:
        print(f"--kv-caches: {', '.join(unknown)} not among {', '.join(KV_CACHES)}", file=sys.stderr)
        return 2
    loaded = load_model(args.model, DType.FLOAT32, Device.CPU)
    model = copy.deepcopy(loaded.model)
    model.set_attn_implementation("sdpa")  # plain forward/generate; the paged hook needs serving metadata
    path = gguf_file(args.model)
    own_blocks = None if path is None else (lambda m: use_gguf_blocks(m, path))  # a GGUF: its own blocks too
    data = collect(model, loaded.tokenizer, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                   own_blocks=own_blocks, kv_caches=register_kv_caches(model.config, names), kv_only=args.kv_only)
    text = json.dumps(data, indent=2) if args.json else render(data)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0
