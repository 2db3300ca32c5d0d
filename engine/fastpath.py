"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2 and SmolLM, which is a Llama).

Why: at batch 1 on a CPU, transformers' module stack costs about as much as the projections themselves
(per layer: ~15 module calls, separate q/k/v GEMMs, RoPE applied twice, the attention
interface's reshapes). This module runs the same arithmetic with the same weights, in fewer ops, and sends
decode-sized projections to C++ kernels that read each weight row once for the whole batch (``Projection``):

    x = embed(ids)                                          [T, hidden]
    per layer:  h = rms_norm(x)
                qkv = h @ W_qkv^T        (q, k, v fused)    [T, (H + 2 H_kv) d]
                q, k = rope(q, k)        (one call for both)
                x += o_proj(paged_attention(q, k, v))
                h = rms_norm(x)
                x += down_proj(act(gate_proj(h)) * up_proj(h))
    logits = lm_head(rms_norm(x[keep]))                     [K, vocab]

Weights are shared with the transformers model, not copied: each fused matrix owns the storage and the
original projections become views of its rows. Quantized gate and up projections are fused too. A step of
decodes only (float32 on a CPU, the serving case) of a model without projection biases and with SiLU runs
``_decode_layers``: the same calls as the general loop ``_layers``, but each projection is its bare C++ kernel
bound to its weights, with no Python between calls beyond the loop itself (a SmolLM2 step at batch 1 makes
~270 C++ calls, so each Python frame saved counts). Other steps and models run ``_layers``. The transformers
path stays the reference; tests check that both give the same greedy tokens, and ``KVSERVE_FASTPATH=0`` turns
this path off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, op_label, paged_attention
import kernels
from quant.linear import QuantLinear, concat_outputs

log = logging.getLogger("kvserve.engine")

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# Up to this many rows (decode batches, and steps mixing a short prefill with decodes), float32 CPU projections
# use kernels/csrc/linear_f32.cpp, which reads each weight row once for all rows; it beats torch's GEMM up to
# about 64 rows and loses beyond (BENCHMARKS.md, "Kernel crossovers", `python -m loadtest.kernelbench`).
# Longer prefill chunks stay on torch's GEMM.
DENSE_MAX_ROWS = 64
PROFILE_LABEL = "kvserve::projection"  # what torch.profiler shows for a projection (kernel time is its self time)
# RoPE types whose cos/sin depend on the position alone (others, e.g. "dynamic", rescale with the length)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
ROPE_TABLE_POSITIONS = 8192  # positions in the cos/sin table (2 x 8192 x d x 4 bytes: 4 MiB at d = 64)


class Projection:
    """A projection as the fast path calls it: ``[T, in]`` -> ``[T, out]``.

    On CPU with float32 rows, calls go straight to a C++ kernel: ``f32_linear`` for float32 weights (up to
    DENSE_MAX_ROWS rows), the layer's own kernel for a QuantLinear (up to its ``kernel_max_rows``: every call
    for the integer kernels). Anything else calls the module (torch's GEMM, or a bf16 ``nn.Linear``).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.bias = getattr(module, "bias", None)
        self.kernel = None
        self.dense = False
        self.max_rows = 0
        weight = getattr(module, "weight", None)
        if (type(module) is nn.Linear and weight.dtype is torch.float32 and weight.is_cpu
                and weight.is_contiguous() and kernels.load() is not None):
            self.kernel, self.dense, self.max_rows = kernels.load().bind_f32(weight), True, DENSE_MAX_ROWS
        elif isinstance(module, QuantLinear):
            limit = module.kernel_max_rows
            self.kernel, self.max_rows = module.decode_kernel(), (limit if limit is not None else sys.maxsize)
        # The kernel alone, for callers that know their input is contiguous float32 with <= max_rows rows
        # (FastDecoder's all-decode steps): no checks, no Python frame. None where a bias must be added.
        self.direct = self.kernel if self.bias is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
            with torch.profiler.record_function(PROFILE_LABEL):  # C++ kernels are not aten ops: label them
                return self._forward(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype is torch.float32 and x.shape[0] <= self.max_rows:
            y = self.kernel(x if x.is_contiguous() else x.contiguous())
            return y if self.bias is None else y + self.bias
        return self.module(x)


def _fuse(linears: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``linears`` side by side (rows stacked), sharing storage; None if they differ."""
    first = linears[0]
    if all(type(m) is nn.Linear for m in linears):
        weight = torch.cat([m.weight.detach() for m in linears])  # [sum(out), in]
        biases = [m.bias for m in linears if m.bias is not None]
        fused = nn.Linear(first.in_features, weight.shape[0], bias=bool(biases), device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if biases:
            fused.bias = nn.Parameter(torch.cat([m.bias.detach() if m.bias is not None
                                                 else biases[0].new_zeros(m.out_features) for m in linears]),
                                      requires_grad=False)
        start = 0
        for m in linears:
            m.weight.data = weight[start:start + m.out_features]  # the original layer now reads the fused rows
            start += m.out_features
        return fused
    if all(isinstance(m, QuantLinear) for m in linears):
        try:
            return concat_outputs(linears)
        except ValueError:
            return None
    return None


class _Layer:
    """One decoder layer's weights, fused where possible."""

    def __init__(self, layer: nn.Module, config, sliding_window: int | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm, self.in_eps = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.post_norm = layer.post_attention_layernorm.weight
        self.post_eps = layer.post_attention_layernorm.variance_epsilon
        fused = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qkv = None if fused is None else Projection(fused)
        # unfused fallback (e.g. q/k/v quantized with different group sizes): three calls
        self.separate_qkv = (None if fused is not None
                             else [Projection(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
        self.o_proj = Projection(attn.o_proj)
        # float32 gate and up stay separate: a fused [2I, hidden] GEMM was not faster on this CPU (its weights
        # no longer fit the cache together), unlike q/k/v, which gain from one call. Quantized ones are fused:
        # their kernels stream the codes either way, and one call quantizes the activations once.
        self.intermediate = mlp.gate_proj.out_features
        fused_mlp = _fuse([mlp.gate_proj, mlp.up_proj]) if isinstance(mlp.gate_proj, QuantLinear) else None
        self.gate_up = None if fused_mlp is None else Projection(fused_mlp)
        self.gate_proj, self.up_proj = ((None, None) if fused_mlp is not None
                                        else (Projection(mlp.gate_proj), Projection(mlp.up_proj)))
        self.down_proj = Projection(mlp.down_proj)
        self.act = mlp.act_fn
        self.silu = getattr(config, "hidden_act", None) == "silu"  # then ops.silu_mul applies SwiGLU in one call
        self.scale = attn.scaling
        self.sliding_window = sliding_window
        # (qkv, o, gate/up, down) as bare kernels, for all-decode steps (FastDecoder.forward); None if any lacks one
        mlp_in = (self.gate_up,) if self.gate_up is not None else (self.gate_proj, self.up_proj)
        needed = (self.qkv, self.o_proj, *mlp_in, self.down_proj)
        self.direct = None
        if self.silu and all(p is not None and p.direct is not None for p in needed):
            gate_up, gate, up = ((self.gate_up.direct, None, None) if self.gate_up is not None
                                 else (None, self.gate_proj.direct, self.up_proj.direct))
            self.direct = (self.qkv.direct, self.o_proj.direct, gate_up, gate, up, self.down_proj.direct)
        self.direct_max_rows = min(p.max_rows for p in self.projections())

    def direct_labelled(self) -> tuple:
        """``direct`` with each kernel under the projections' profiler label (None entries stay None)."""
        return tuple(None if fn is None else _labelled(fn, PROFILE_LABEL) for fn in self.direct)

    def projections(self) -> list[Projection]:
        return [p for p in (self.qkv, *(self.separate_qkv or []), self.o_proj, self.gate_up, self.gate_proj,
                            self.up_proj, self.down_proj) if p is not None]

    def qkv_states(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, (H + 2 H_kv) d]``."""
        if self.qkv is not None:
            return self.qkv(h)
        return torch.cat([proj(h) for proj in self.separate_qkv], dim=-1)

    def mlp(self, h: torch.Tensor, ops=None) -> torch.Tensor:
        """SwiGLU: ``down(act(gate(h)) * up(h))``, ``[T, hidden]`` -> ``[T, hidden]``; ``ops``: the fused C++ ops."""
        if self.gate_up is not None:
            gate_up = self.gate_up(h)  # [T, 2I]
            gate, up = gate_up[:, :self.intermediate], gate_up[:, self.intermediate:]
        else:
            gate, up = self.gate_proj(h), self.up_proj(h)
        if ops is not None and self.silu and gate.dtype is torch.float32:
            with op_label("kvserve::silu_mul"):
                return self.down_proj(ops.silu_mul(gate, up))
        return self.down_proj(self.act(gate) * up)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops=None) -> torch.Tensor:
    """RMSNorm as transformers' LlamaRMSNorm computes it (float32 statistics; Zhang & Sennrich 2019).

    float32 on CPU: the fused C++ op when ``ops`` is given (one call; torch's ``rms_norm`` is composite here
    and took ~40 us for a 576-vector), else torch's fused ``rms_norm`` (bit-identical to transformers). For
    16-bit input transformers rounds the normalized value before the weight, so that path is spelled out.
    """
    if x.dtype is torch.float32 and weight.dtype is torch.float32:
        if ops is not None:
            with op_label("kvserve::rms_norm"):
                return ops.rms_norm(x if x.is_contiguous() else x.contiguous(), weight, eps)
        return F.rms_norm(x, weight.shape, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, ops=None) -> torch.Tensor:
    """``x += update`` in place (the residual stream), then ``rms_norm(x)``; one C++ call with ``ops``."""
    if ops is not None and weight.dtype is torch.float32 and update.dtype is torch.float32:
        with op_label("kvserve::rms_norm"):
            return ops.add_rms_norm_(x, update if update.is_contiguous() else update.contiguous(), weight, eps)
    x += update
    return _rms_norm(x, weight, eps)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the fast path, or None if it can."""
    if os.environ.get("KVSERVE_FASTPATH", "1") == "0":
        return "KVSERVE_FASTPATH=0"
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (fast path: {sorted(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "unexpected module layout"
    return None


class FastDecoder:
    """The lean forward over a transformers Llama-family model's own weights.

    Args:
        model: a ``LlamaForCausalLM``-like model (checked with ``unsupported_reason``), possibly quantized.

    Raises:
        ValueError: the model is not supported.
    """

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fast path unsupported: {reason}")
        config, inner = model.config, model.model
        self.signature = module_signature(model)
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.rope_static = getattr(self.rotary, "rope_type", None) in STATIC_ROPE_TYPES
        self._rope_table: tuple | None = None  # ((dtype, device), cos [P, d], sin [P, d]), built on first use
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = Projection(model.lm_head)
        self.vocab_size = model.lm_head.out_features
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.layers = [_Layer(layer, config, self._window(config, layer))
                       for layer in inner.layers[:config.num_hidden_layers]]
        # all-decode steps of up to this many sequences take _decode_layers (0: none, a layer lacks kernels)
        self.direct_max_rows = (min(layer.direct_max_rows for layer in self.layers)
                                if all(layer.direct is not None for layer in self.layers) else 0)

    @contextlib.contextmanager
    def aten_ops(self):
        """Within the block every projection runs torch's own ops instead of a C++ kernel, and so do the norms,
        RoPE and attention, so dispatch-level tools (``loadtest.macs.MacCounter``) see every product."""
        projections = [p for layer in self.layers for p in layer.projections()] + [self.lm_head]
        saved = [p.max_rows for p in projections]
        for p in projections:
            p.max_rows = 0
        try:
            with kernels.torch_ops_only():
                yield
        finally:
            for p, rows in zip(projections, saved):
                p.max_rows = rows

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin ``[T, d]`` for ``positions`` ``[T]``, as the model's rotary module gives them.

        On a CPU, where they depend on the position alone (static RoPE types), rows of a table the module
        filled once for positions below ROPE_TABLE_POSITIONS: the same values (each is an elementwise function
        of one position) for one index_select each instead of the module's ~10 ops.
        """
        if self.rope_static and x.is_cpu:
            key = (x.dtype, x.device)
            if self._rope_table is None or self._rope_table[0] != key:
                every = torch.arange(ROPE_TABLE_POSITIONS, device=x.device)
                cos, sin = self.rotary(x[:0][None], every[None])  # [1, P, d] each
                self._rope_table = (key, cos[0], sin[0])
            _, cos, sin = self._rope_table
            if positions.numel() and int(positions.max()) < ROPE_TABLE_POSITIONS:
                return cos.index_select(0, positions), sin.index_select(0, positions)
        cos, sin = self.rotary(x[None], positions[None])  # [1, T, d] each
        return cos[0], sin[0]

    @staticmethod
    def _window(config, layer: nn.Module) -> int | None:
        if config.model_type == "mistral":
            return getattr(config, "sliding_window", None)
        return getattr(layer.self_attn, "sliding_window", None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor) -> torch.Tensor:
        """Compute one step's tokens, write their K/V, and return logits for the kept rows.

        Args:
            input_ids: ``[T]`` token ids (the ragged batch, flattened).
            positions: ``[T]`` their positions.
            meta: paged-attention metadata of this step.
            keep: ``[K]`` rows whose logits are needed (may be empty).

        Returns:
            ``[K, vocab]`` logits in the model dtype.
        """
        x = self.embed(input_ids)  # [T, hidden]
        # fused RMSNorm / RoPE ops (kernels/csrc/decode_ops.cpp) for float32 CPU steps; None: torch ops
        ops = kernels.load_ops() if x.dtype is torch.float32 and x.is_cpu else None
        rope = _Rope(*self._cos_sin(x, positions), ops)
        # an all-decode float32 CPU step: RoPE, the KV write and attention in one C++ call per layer
        all_decodes = ops is not None and meta.all_decodes and meta.pool.data.dtype is torch.float32
        if all_decodes and self.direct_max_rows >= x.shape[0]:
            self._decode_layers(x, rope, meta, ops)
        else:
            self._layers(x, rope, meta, ops, all_decodes)
        if keep.numel() == 0:
            return x.new_empty(0, self.vocab_size)
        return self.lm_head(_rms_norm(x.index_select(0, keep), self.norm, self.norm_eps, ops))  # [K, vocab]

    def _layers(self, x: torch.Tensor, rope: _Rope, meta: AttentionMetadata, ops, all_decodes: bool) -> None:
        """Every decoder layer on the residual stream ``x`` ``[T, hidden]`` (updated in place), any step."""
        num_tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_width = (heads + kv_heads) * head_dim
        layers = self.layers
        h = _rms_norm(x, layers[0].in_norm, layers[0].in_eps, ops)
        for index, layer in enumerate(layers):
            qkv = layer.qkv_states(h)  # [T, (H + 2 H_kv) d]
            if all_decodes:
                k_blocks, v_blocks = meta.pool.layer_blocks(index)
                with op_label("kvserve::decode_attention"):
                    attn = ops.decode_attention_(qkv, heads, kv_heads, rope.cos, rope.sin, meta.slot_mapping,
                                                 k_blocks, v_blocks, meta.decode_rows, meta.decode_tables,
                                                 meta.decode_lens, layer.scale, layer.sliding_window or 0)
            else:
                qk = rope(qkv[:, :qk_width].view(num_tokens, heads + kv_heads, head_dim))
                v = qkv[:, qk_width:].view(num_tokens, kv_heads, head_dim)
                attn = paged_attention(index, qk[:, :heads], qk[:, heads:], v, meta, layer.scale,
                                       layer.sliding_window)  # [T, H, d]
            h = _add_rms_norm(x, layer.o_proj(attn.view(num_tokens, heads * head_dim)), layer.post_norm,
                              layer.post_eps, ops)  # x += attention output
            mlp_out = layer.mlp(h, ops)
            if index + 1 < len(layers):
                h = _add_rms_norm(x, mlp_out, layers[index + 1].in_norm, layers[index + 1].in_eps, ops)
            else:
                x += mlp_out

    def _decode_layers(self, x: torch.Tensor, rope: _Rope, meta: AttentionMetadata, ops) -> None:
        """``_layers`` for an all-decode float32 CPU step whose layers all have ``direct`` kernels.

        The same calls in the same order, so the same bits, minus the Python around them: each projection is
        its bare C++ kernel (its input here is always a fresh contiguous float32 ``[T, in]``), with profiler
        labels only while a profiler runs.
        """
        num_tokens = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        attn_width = heads * self.head_dim
        profiling = _profiling()
        attention, add_rms_norm, silu_mul = ops.decode_attention_, ops.add_rms_norm_, ops.silu_mul
        if profiling:
            attention = _labelled(attention, "kvserve::decode_attention")
            add_rms_norm = _labelled(add_rms_norm, "kvserve::rms_norm")
            silu_mul = _labelled(silu_mul, "kvserve::silu_mul")
        cos, sin, slots = rope.cos, rope.sin, meta.slot_mapping
        rows, tables, lens = meta.decode_rows, meta.decode_tables, meta.decode_lens
        layers, pool = self.layers, meta.pool
        rms_norm = _labelled(ops.rms_norm, "kvserve::rms_norm") if profiling else ops.rms_norm
        h = rms_norm(x, layers[0].in_norm, layers[0].in_eps)
        for index, layer in enumerate(layers):
            qkv, o_proj, gate_up, gate, up, down = layer.direct if not profiling else layer.direct_labelled()
            k_blocks, v_blocks = pool.layer_blocks(index)
            attn = attention(qkv(h), heads, kv_heads, cos, sin, slots, k_blocks, v_blocks, rows, tables, lens,
                             layer.scale, layer.sliding_window or 0)  # [T, H, d]
            h = add_rms_norm(x, o_proj(attn.view(num_tokens, attn_width)), layer.post_norm, layer.post_eps)
            if gate_up is not None:
                both = gate_up(h)  # [T, 2I]
                mlp_out = down(silu_mul(both[:, :layer.intermediate], both[:, layer.intermediate:]))
            else:
                mlp_out = down(silu_mul(gate(h), up(h)))
            if index + 1 < len(layers):
                following = layers[index + 1]
                h = add_rms_norm(x, mlp_out, following.in_norm, following.in_eps)
            else:
                x += mlp_out


def _profiling() -> bool:
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", False)


def _labelled(fn, label: str):
    """``fn`` inside a torch.profiler label (C++ calls are not aten ops: unlabelled, a profile would not see them)."""
    def call(*args):
        with torch.profiler.record_function(label):
            return fn(*args)
    return call


class _Rope:
    """RoPE (RoFormer, Su et al. 2021) in transformers' rotate_half layout, for one step's positions.

    With the fused ops (float32 CPU) it rotates ``[T, heads, d]`` in place in one call; otherwise
    ``x * cos + roll(x, d / 2) * [-sin_1, sin_2]`` (one call for q and k together; the sign moves onto sin).
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, ops) -> None:  # cos, sin: [T, d]
        self.ops = ops
        if ops is not None:
            self.cos, self.sin = cos.contiguous(), sin.contiguous()
            return
        self.half = cos.shape[-1] // 2
        self.cos = cos[:, None, :]  # [T, 1, d]: broadcast over heads
        self.sin = torch.cat((-sin[:, :self.half], sin[:, self.half:]), dim=-1)[:, None, :]

    def __call__(self, qk: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            with op_label("kvserve::rope"):
                self.ops.rope_(qk, self.cos, self.sin)
            return qk
        return qk * self.cos + qk.roll(self.half, -1) * self.sin


def module_signature(model: nn.Module) -> tuple[int, ...]:
    """Identity of the model's projection layers: changes when they are replaced (e.g. by quantization)."""
    return tuple(id(m) for m in model.modules() if isinstance(m, (nn.Linear, QuantLinear)))


def fast_decoder(model: nn.Module) -> FastDecoder | None:
    """The model's FastDecoder (built once per set of layers and kept on the model), or None if unsupported."""
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("engine: transformers forward (%s)", reason)
        return None
    cached = getattr(model, "_kvserve_fast", None)
    if cached is not None and cached.signature == module_signature(model):
        return cached
    decoder = FastDecoder(model)
    model._kvserve_fast = decoder
    with_kernels = any(p.kernel is not None for layer in decoder.layers for p in layer.projections())
    log.info("engine: lean Llama-family forward (fused q/k/v; %s)",
             "C++ kernels for decode-sized projections" if with_kernels else "torch's ops: the C++ kernels are off")
    return decoder
