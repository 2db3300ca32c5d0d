"""Paged attention plugged into transformers through its attention interface.

``paged_attention`` writes the step's K/V into the pool at the slot mapping, then attends each query token to its
own sequence's cached context; engine.fastpath calls it. transformers' model classes compute Q, K, V (RoPE
applied) and call ``ALL_ATTENTION_FUNCTIONS[impl]``: ``register`` puts it there as ``"kvserve"`` where such a
model is built (a Hugging Face directory, ``engine.lean_model.transformers_model``), importing transformers'
modeling code only then.

Every step is flattened to batch 1 (``[1, num_tokens]``), so the batch is ragged, never padded:

    tokens:  | seq A prefill (5) | seq B decode (1) | seq C decode (1) | seq D prefill chunk (3) |

Decodes are attended together (one SDPA call; contexts gathered to the longest decode context with a
mask); each prefill is attended on its own with a causal mask offset by its cached prefix.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from kvserve.kvcache.pool import KVPool
from kvserve import native

ATTN_IMPLEMENTATION = "kvserve"


@dataclass(slots=True)
class PrefillSpan:
    """One sequence computing several tokens this step.

    Attributes:
        start, end: its rows in the flattened token axis.
        block_table: ``[blocks]`` blocks holding its whole context after this step (empty if start_pos is 0).
        start_pos: position of its first new token (0 means no cached prefix).
    """

    start: int
    end: int
    block_table: torch.Tensor
    start_pos: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # per sliding window, built once a step

    @property
    def context_len(self) -> int:
        return self.start_pos + self.end - self.start

    def causal_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[new_tokens, context_len]`` bool, shared by every layer with the same window."""
        if sliding_window not in self.masks:
            self.masks[sliding_window] = _causal_mask(self.end - self.start, self.start_pos, sliding_window,
                                                      self.block_table.device)
        return self.masks[sliding_window]


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch metadata, built once and read by every layer.

    Attributes:
        pool: the KV pool.
        slot_mapping: ``[num_tokens]`` pool slot for each new token.
        decode_rows: ``[num_decodes]`` rows of single-token sequences in the flattened batch.
        decode_tables: ``[num_decodes, max_blocks]`` block tables of the decodes, padded with block 0.
        decode_lens: ``[num_decodes]`` context lengths (tokens).
        prefills: multi-token sequences.
        all_decodes: True when there are no prefills (the decode rows are then every row, in order).
        max_position: the step's largest token position, where the caller knows it (None: unknown).
    """

    pool: KVPool
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    prefills: list[PrefillSpan]
    all_decodes: bool = False  # every token is a decode, in row order (decode_rows is 0..n-1)
    max_position: int | None = None
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # per sliding window, built once a step

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[num_decodes, 1, 1, max_blocks * block_size]`` bool: True where a decode may attend."""
        if sliding_window not in self.masks:
            self.masks[sliding_window] = self._build_decode_mask(sliding_window)
        return self.masks[sliding_window]

    def _build_decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        num_keys = self.decode_tables.shape[1] * self.pool.block_size
        key_pos = torch.arange(num_keys, device=self.decode_tables.device)  # [max_blocks * block_size]
        query_pos = (self.decode_lens - 1)[:, None]  # [num_decodes, 1]
        allowed = key_pos[None, :] <= query_pos
        if sliding_window is not None:
            allowed &= key_pos[None, :] > query_pos - sliding_window
        return allowed[:, None, None, :]


def _causal_mask(num_queries: int, start_pos: int, sliding_window: int | None,
                 device: torch.device) -> torch.Tensor:
    """``[num_queries, start_pos + num_queries]`` bool: query i (position start_pos+i) sees keys <= it."""
    query_pos = torch.arange(start_pos, start_pos + num_queries, device=device)[:, None]
    key_pos = torch.arange(start_pos + num_queries, device=device)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    return allowed


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None) -> torch.Tensor:
    """Scaled dot-product attention with GQA; q ``[..., H, t, D]``, k/v ``[..., H_kv, L, D]``."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(groups, dim=-3)
    v = v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., H, t, L]
    scores = softcap * torch.tanh(scores / softcap)  # Gemma 2's attention logit soft-capping
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)


def op_label(name: str):
    """A torch.profiler label around a C++ op call (they are not aten ops, so the profiler would not see them)."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _fused_ops(q: torch.Tensor, k_cache: torch.Tensor):
    """native/csrc/decode_ops.cpp's ops (kv_quant.cpp's for an int8 / int4 cache, attend_bf16.h's attention for a
    bfloat16 one) when this step can use them (float32 queries on CPU over a float32, bfloat16 or int8 / int4
    cache), else None."""
    if (q.dtype is not torch.float32 or not q.is_cpu
            or k_cache.dtype not in (torch.float32, torch.bfloat16, torch.int8, torch.uint8)):
        return None
    return native.load_ops()


def _write(ops, pool: KVPool, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """This step's K/V into the pool: the C++ write (quantizing for an int8 / int4 cache) or torch's."""
    if ops is None:
        pool.write(layer_idx, slots, k, v)
        return
    k_cache, v_cache = pool.layer(layer_idx)
    with op_label("kvserve::kv_write"):
        if pool.quantized:
            k_scales, v_scales = pool.layer_scales(layer_idx)
            ops.write_kv_quant(k_cache, k_scales, v_cache, v_scales, slots, k, v, pool.bits)
        else:
            ops.write_kv(k_cache, v_cache, slots, k, v)


def _decode_in_place(ops, pool: KVPool, layer_idx: int, q: torch.Tensor, meta: AttentionMetadata, scale: float,
                     sliding_window: int | None, out: torch.Tensor) -> None:
    """The decode rows of ``out`` by the C++ paged attention, reading each context through its block table in
    place (no gathered copy, no mask; codes dequantized in registers for a quantized cache)."""
    k_blocks, v_blocks = pool.layer_blocks(layer_idx)  # [num_blocks, block_size, H_kv, row]
    window = sliding_window or 0
    with op_label("kvserve::paged_attention"):
        if pool.quantized:
            k_scales, v_scales = pool.layer_scale_blocks(layer_idx)
            ops.paged_decode_attention_quant(q, meta.decode_rows, meta.decode_tables, meta.decode_lens, k_blocks,
                                             k_scales, v_blocks, v_scales, pool.bits, scale, window, out)
        else:
            ops.paged_decode_attention(q, meta.decode_rows, meta.decode_tables, meta.decode_lens, k_blocks,
                                       v_blocks, scale, window, out)


def paged_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Write this step's K/V into the pool at the slot mapping, then attend each token to its own context.

    Args:
        layer_idx: which layer's cache to use.
        q: ``[num_tokens, num_heads, head_dim]`` queries (RoPE applied; any strides).
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` this step's keys (RoPE applied) and values.
        meta: the step's AttentionMetadata.
        scale: softmax scale (usually head_dim ** -0.5).
        sliding_window: the layer's window (tokens), if any.
        softcap: attention logit soft-cap (Gemma 2), if any.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` attention output (contiguous).

    float32 queries on CPU use the C++ ops (native/csrc/decode_ops.cpp) for the KV write and the decode rows;
    prefill spans and other dtypes/devices use torch (SDPA). Every token attends to what the cache gives back
    (``KVPool.roundtrip``: its codes, for a quantized cache), its own step's keys included, so a prompt computed
    whole, in chunks or over a cached prefix sees the same keys.
    """
    pool = meta.pool
    k_cache, _ = pool.layer(layer_idx)  # [num_slots, H_kv, row]
    ops = _fused_ops(q, k_cache) if softcap is None else None
    _write(ops, pool, layer_idx, meta.slot_mapping, k, v)

    out = q.new_empty(q.shape)  # [num_tokens, H, D], contiguous
    if meta.decode_rows.numel() and ops is not None:
        _decode_in_place(ops, pool, layer_idx, q, meta, scale, sliding_window, out)
        if meta.all_decodes:
            return out
    q = q.transpose(0, 1)  # [H, num_tokens, D]
    if meta.decode_rows.numel() and ops is None:
        q_dec = (q.transpose(0, 1) if meta.all_decodes else q[:, meta.decode_rows].transpose(0, 1))[:, :, None, :]
        # whole blocks are gathered (one copy per block, not per token); the mask hides what lies past a context
        k_dec, v_dec = pool.gather(layer_idx, meta.decode_tables, q.dtype)  # [B_dec, keys, H_kv, D]
        o_dec = _attend(q_dec, k_dec.transpose(1, 2), v_dec.transpose(1, 2), meta.decode_mask(sliding_window),
                        scale, softcap)  # [B_dec, H, 1, D]
        if meta.all_decodes:
            return o_dec.reshape(out.shape)
        out[meta.decode_rows] = o_dec[:, :, 0, :]  # [B_dec, H, D]
    for span in meta.prefills:
        q_i = q[:, span.start:span.end]  # [H, t, D]
        if span.start_pos == 0:
            # the whole context is new: this step's keys as the cache gives them back
            k_i = pool.roundtrip(k[span.start:span.end]).transpose(0, 1)  # [H_kv, t, D]
            v_i = pool.roundtrip(v[span.start:span.end]).transpose(0, 1)
        else:
            context = span.context_len
            k_i, v_i = pool.gather(layer_idx, span.block_table[None], q.dtype)  # [1, n * block_size, H_kv, D]
            k_i, v_i = k_i[0, :context].transpose(0, 1), v_i[0, :context].transpose(0, 1)  # [H_kv, context, D]
        if span.start_pos == 0 and sliding_window is None and softcap is None:
            # a whole prompt from position 0: SDPA's own causal kernel, no mask tensor
            out[span.start:span.end] = F.scaled_dot_product_attention(
                q_i, k_i, v_i, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
            continue
        mask = span.causal_mask(sliding_window)
        out[span.start:span.end] = _attend(q_i, k_i, v_i, mask, scale, softcap).transpose(0, 1)
    return out


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function for the paged KV cache (adapts shapes for ``paged_attention``).

    Args:
        module: the attention module (gives ``layer_idx``).
        query: ``[1, num_heads, num_tokens, head_dim]``.
        key, value: ``[1, num_kv_heads, num_tokens, head_dim]``, RoPE already applied to key.
        attention_mask: ignored (the mask comes from the metadata).
        scaling: softmax scale; defaults to head_dim ** -0.5.
        sliding_window: the layer's window (tokens), if any.
        softcap: attention logit soft-cap (Gemma 2), if any.
        kwargs: must hold ``kvserve`` (AttentionMetadata).

    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)`` as transformers expects.

    Raises:
        KeyError: called without kvserve metadata (e.g. by ``generate``).
    """
    meta: AttentionMetadata = kwargs["kvserve"]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), meta, scale, sliding_window, softcap)
    return out[None], None


def _no_mask(*args, **kwargs) -> None:
    """The mask lives in AttentionMetadata; transformers need not build a [T, T] one."""
    return None


def register() -> None:
    """Register ``"kvserve"`` with transformers' attention and mask interfaces (idempotent). Imports transformers'
    modeling code (about 120 MiB resident): call it only where a transformers model is built."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
