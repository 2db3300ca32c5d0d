"""A lean forward pass for Llama-family decoders (engine.architectures: Llama and SmolLM, Mistral, Qwen2, Qwen3).

Why: at batch 1 on a CPU, transformers' module stack costs about as much as the projections themselves
(per layer: ~15 module calls, separate q/k/v GEMMs, RoPE applied twice, the attention
interface's reshapes). This module runs the same arithmetic with the same weights, in fewer ops:

    x = embed(ids)                                          [T, hidden]
    per layer:  h = rms_norm(x)
                qkv = h @ W_qkv^T        (q, k, v fused)    [T, (H + 2 H_kv) d]
                q, k = rms_norm(q), rms_norm(k)   per head, where the family says (Qwen3)
                q, k = rope(q, k)        (one call for both)
                x += o_proj(paged_attention(q, k, v))
                h = rms_norm(x)
                x += down_proj(act(gate_proj(h)) * up_proj(h))
    logits = lm_head(rms_norm(x[keep]))                     [K, vocab]

The layers run one of two ways, chosen once per step (``FastDecoder.forward``):

- the layer stack (``DecodeLayers``, native/csrc/decode_layers.cpp): on a step of decodes only (prompt rows
  count as decode rows where engine.runner's ``_rows_alone`` holds), float32 on a CPU, of a model whose every
  projection has a kernel handle (GGUF blocks), SiLU and no bias but q/k/v's (Qwen2's, which the stack adds; it
  applies Qwen3's q/k norms too), one C++ call runs the whole step: the embedding lookup (where the table is
  float32 or GGUF blocks), the cos/sin rows of the RoPE table, every layer, the final norm of the kept rows and the LM head (where it has a handle);
  the same ops as the loop below in the same order (the same bits), without a Python frame, a dispatch or an
  allocation between them (a SmolLM2 step at batch 1 made ~270 calls from Python);
- otherwise the layer loop (``FastDecoder._layer_loop``), whose calls are chosen per step (``_LayerCalls``):
  float32 on a CPU, the C++ ops of native/csrc/decode_ops.cpp (RMSNorm fused with the residual add, SwiGLU),
  and on a step of decodes only one call per layer for RoPE, the KV write and attention; for the projections
  (engine.kernelbind), on such an all-decode step of a model without projection biases and with SiLU, each
  projection's bare C++ kernel, otherwise the checked Projections, which pick a kernel or the module per call.

Under torch.profiler every C++ call carries a ``kvserve::...`` label (they are not aten ops), the layer stack's
parts included.

RoPE's cos/sin and rotation are engine.rope's. The model is a GGUF file's own blocks in engine.lean_model's modules,
for which this is the only forward, or a transformers model of the same names (a Hugging Face directory; a GGUF
file dequantized); weights are shared with the model, not copied (engine.kernelbind.fuse). transformers' forward
stays the reference; tests check that both give the same greedy tokens, and ``KVSERVE_FASTPATH=0`` (read by
``fast_decoder``, when the runner is built, and by engine.gguf_model, which then builds transformers' modules
for a GGUF file's blocks) turns this path off.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.architectures import ARCHITECTURES, for_model_type
from kvserve.engine.attention import AttentionMetadata, paged_attention
from kvserve.engine.kernelbind import PROFILE_LABEL, LayerKernels, LayerProjections, Projection, labelled, profiling
from kvserve.engine.rope import Rope, RopeTable
from kvserve.quant.ggml import GGMLEmbedding
from kvserve import environment, native

log = logging.getLogger("kvserve.engine")

SUPPORTED_MODEL_TYPES = frozenset(ARCHITECTURES)

# The pool dtypes the fused decode attention and the layer stack read in place (a bfloat16 pool through
# native/csrc/attend_bf16.h); an int8 / int4 pool takes the per-layer loop's kv_quant ops.
_STACK_POOLS = (torch.float32, torch.bfloat16)


@dataclass(slots=True, frozen=True)
class _Layer:
    """One decoder layer's weights and settings other than its projections."""

    in_norm: torch.Tensor  # [hidden] input RMSNorm weight
    in_eps: float
    post_norm: torch.Tensor  # [hidden] post-attention RMSNorm weight
    post_eps: float
    scale: float  # attention softmax scale
    window: int | None  # sliding window (tokens), None: full attention
    intermediate: int  # I, the MLP width
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None  # q and k RMSNorm weights [d] and eps, or None


@dataclass(slots=True, frozen=True)
class _Step:
    """What one step calls, chosen once for the step (see the module docstring)."""

    layers: Callable  # (x [T, hidden]) -> None: every decoder layer, x (the residual stream) updated in place
    rms_norm: Callable  # (x [T, n], weight [n], eps) -> [T, n]
    lm_head: Callable  # [K, hidden] -> [K, vocab]


@dataclass(slots=True, frozen=True)
class _LayerCalls:
    """What the layer loop calls, chosen once for the step (see the module docstring)."""

    projections: list[LayerKernels]  # per layer
    rms_norm: Callable  # (x [T, n], weight [n], eps) -> [T, n]
    add_rms_norm: Callable  # (x [T, n] residual, updated in place, update [T, n], weight, eps) -> rms_norm(x)
    act_mul: Callable  # (gate [T, I], up [T, I]) -> act(gate) * up  [T, I]
    attention: Callable  # (layer index, qkv [T, (H + 2 H_kv) d], scale, window) -> [T, H, d]; writes K/V


class FastDecoder:
    """The lean forward over a Llama-family model's own weights.

    Args:
        model: an engine.lean_model ``LeanCausalLM`` or a ``LlamaForCausalLM``-like transformers model (checked
            with ``unsupported_reason``), possibly quantized.

    Raises:
        ValueError: the model is not supported.
    """

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fast path unsupported: {reason}")
        config, inner = model.config, model.model
        self.embed = inner.embed_tokens
        self.rope = RopeTable(inner.rotary_emb)
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = Projection(model.lm_head)
        self.vocab_size = model.lm_head.out_features
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        blocks = inner.layers[:config.num_hidden_layers]
        qk_norm = for_model_type(config.model_type).qk_norm
        self.layers = [_Layer(b.input_layernorm.weight, b.input_layernorm.variance_epsilon,
                              b.post_attention_layernorm.weight, b.post_attention_layernorm.variance_epsilon,
                              b.self_attn.scaling, _window(config, b), b.mlp.gate_proj.out_features,
                              _qk_norm(b) if qk_norm else None)
                       for b in blocks]
        self.projections = [LayerProjections(b) for b in blocks]
        self.act = blocks[0].mlp.act_fn
        self.silu = getattr(config, "hidden_act", None) == "silu"  # then ops.silu_mul applies SwiGLU in one call
        self.checked = [p.checked() for p in self.projections]
        # the bare kernels, for all-decode steps of up to direct_max_rows sequences; None: not this model (a bias,
        # a projection without a kernel, or an activation silu_mul does not compute)
        direct = [p.direct() for p in self.projections]
        self.direct = direct if self.silu and all(k is not None for k in direct) else None
        self.direct_max_rows = min(p.max_rows for p in self.projections)
        self.stack_embeds = self.stack_head = False  # the stack looks the ids up / applies the LM head itself
        self.stack_rope_positions = 0  # positions below this: the stack reads cos/sin from its RoPE table
        self.layer_stack = self._layer_stack(config) if self.silu else None
        self._torch_projections = False  # aten_ops: every projection runs its module
        self._stack_off = False  # layer_loop_only: all-decode steps run the layer loop

    def reserve(self, rows: int) -> None:
        """Make the layer stack's workspace (one float32 row of each intermediate per token row: 37 KB a row on a
        1B Llama) for steps of up to ``rows`` token rows now. Grown step by step instead (a decode row, then a
        501-token prompt, then a 512-token chunk), each larger workspace left the freed smaller ones as holes
        in the C heap that the resident set keeps (BENCHMARKS.md, section ready-avx2). Nothing without a stack.

        Raises:
            RuntimeError: ``rows`` < 1.
        """
        if self.layer_stack is not None:
            self.layer_stack.reserve(rows)

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
        if (self.layer_stack is not None and meta.all_decodes and meta.pool.data.dtype in _STACK_POOLS
                and input_ids.shape[0] <= self.direct_max_rows and not self._torch_projections and not self._stack_off):
            return self._stack_step(input_ids, positions, meta, keep)
        x = self.embed(input_ids)  # [T, hidden], the residual stream (updated in place)
        step = self._step(x, positions, meta)
        step.layers(x)
        if keep.numel() == 0:
            return x.new_empty(0, self.vocab_size)
        return step.lm_head(step.rms_norm(x.index_select(0, keep), self.norm, self.norm_eps))  # [K, vocab]

    def _stack_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    keep: torch.Tensor) -> torch.Tensor:
        """``forward`` of an all-decode float32 CPU step in one C++ call (``DecodeLayers.decode``): the rows
        embedded, cos/sin gathered, the layers, the final norm and the LM head, each where the stack has them
        (``_layer_stack``), else here; the bits of the layer loop's step."""
        x = cos = sin = None
        if not self.stack_embeds:
            x = self.embed(input_ids).contiguous()  # [T, hidden]
        if meta.max_position is None or meta.max_position >= self.stack_rope_positions:  # past the stack's table
            cos, sin = self.rope.cos_sin(self.norm, positions)  # the norm weight gives the dtype
            cos, sin = cos.contiguous(), sin.contiguous()
        out = self.layer_stack.decode(input_ids, positions, meta.slot_mapping, meta.decode_rows, meta.decode_tables,
                                      meta.decode_lens, meta.pool.data, keep, x, cos, sin)
        if self.stack_head:
            return out  # [K, vocab]
        if keep.numel() == 0:
            return out.new_empty(0, self.vocab_size)
        return (labelled(self.lm_head, PROFILE_LABEL) if profiling() else self.lm_head)(out)  # [K, vocab]

    def _layer_loop(self, calls: _LayerCalls, x: torch.Tensor) -> None:
        """Every decoder layer on ``x`` ``[T, hidden]`` (updated in place), one layer at a time from Python."""
        num_tokens, width = x.shape[0], self.num_heads * self.head_dim
        layers = self.layers
        h = calls.rms_norm(x, layers[0].in_norm, layers[0].in_eps)
        for index, (layer, proj) in enumerate(zip(layers, calls.projections)):
            qkv = proj.qkv(h)  # [T, (H + 2 H_kv) d]
            if layer.qk_norm is not None:
                self._norm_qk(calls.rms_norm, qkv, *layer.qk_norm)
            attn = calls.attention(index, qkv, layer.scale, layer.window)  # [T, H, d]
            h = calls.add_rms_norm(x, proj.o_proj(attn.view(num_tokens, width)), layer.post_norm, layer.post_eps)
            if proj.gate_up is not None:
                gate_up = proj.gate_up(h)  # [T, 2I]
                gate, up = gate_up[:, :layer.intermediate], gate_up[:, layer.intermediate:]
            else:
                gate, up = proj.gate(h), proj.up(h)  # [T, I] each
            mlp_out = proj.down(calls.act_mul(gate, up))  # [T, hidden]
            if index + 1 < len(layers):
                h = calls.add_rms_norm(x, mlp_out, layers[index + 1].in_norm, layers[index + 1].in_eps)
            else:
                x += mlp_out

    def _step(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> _Step:
        """Choose this step's calls: the layer stack or the layer loop; C++ ops or torch's, fused decode
        attention or not, which projections."""
        # fused RMSNorm / RoPE / SwiGLU ops for float32 CPU steps; None: torch's ops
        ops = native.load_ops() if x.dtype is torch.float32 and x.is_cpu else None
        label = labelled if profiling() else _unlabelled
        cos, sin = self.rope.cos_sin(x, positions)
        # an all-decode float32 CPU step: RoPE, the KV write and attention in one C++ call per layer
        fused_decode = ops is not None and meta.all_decodes and meta.pool.data.dtype in _STACK_POOLS
        direct = (fused_decode and self.direct is not None and x.shape[0] <= self.direct_max_rows
                  and not self._torch_projections)
        lm_head = self.lm_head.module if self._torch_projections else self.lm_head
        lm_head = labelled(lm_head, PROFILE_LABEL) if label is labelled else lm_head
        rms_norm = label(ops.rms_norm, "kvserve::rms_norm") if ops is not None else _rms_norm
        if self._torch_projections:
            projections = [p.torch() for p in self.projections]
        elif direct:
            projections = self.direct  # inputs are fresh contiguous float32 rows
        else:
            projections = self.checked
        if label is labelled:
            projections = [k.labelled() for k in projections]
        add_rms_norm = label(ops.add_rms_norm_, "kvserve::rms_norm") if ops is not None else _add_rms_norm
        act_mul = label(ops.silu_mul, "kvserve::silu_mul") if ops is not None and self.silu else self._act_mul
        if fused_decode:
            attention = self._decode_attention(label(ops.decode_attention_, "kvserve::decode_attention"),
                                               cos.contiguous(), sin.contiguous(), meta)
        else:
            rope = Rope(cos, sin, None if ops is None else label(ops.rope_, "kvserve::rope"))
            attention = self._paged_attention(rope, meta, x.shape[0])
        calls = _LayerCalls(projections, rms_norm, add_rms_norm, act_mul, attention)
        return _Step(functools.partial(self._layer_loop, calls), rms_norm, lm_head)

    def _layer_stack(self, config) -> object | None:
        """The C++ layer stack (``DecodeLayers``) over this model's layers, or None where it does not apply: no
        decode ops, activations other than float32, or a projection without a kernel handle (float32, int8, int4
        or 16-bit weights: their kernels have none; the layer loop runs them) or with a bias the stack does not add
        (it adds q/k/v's, Qwen2's; it norms q and k where the layer does, Qwen3's). It also gets, once, what
        a step needs besides the layers: the RoPE table, the final norm, and where it can take them the embedding
        table (float32, or GGUF blocks) and the LM head's handle (``stack_embeds``, ``stack_head``)."""
        ops = native.load_ops()
        handles = [p.handles() for p in self.projections]
        if (ops is None or not hasattr(ops, "DecodeLayers") or any(h is None for h in handles)
                or _activation_dtype(self.embed) is not torch.float32 or self.norm.dtype is not torch.float32
                or not self.norm.is_cpu or not self.norm.is_contiguous()):
            return None
        intermediate = self.layers[0].intermediate
        stack = ops.DecodeLayers(self.num_heads, self.num_kv_heads, self.head_dim, config.hidden_size, intermediate)
        for layer, projections, (qkv, o_proj, gate_up, down) in zip(self.layers, self.projections, handles):
            bias = projections.qkv_bias()
            q_norm, k_norm, qk_eps = layer.qk_norm if layer.qk_norm is not None else (None, None, 0.0)
            if layer.intermediate != intermediate or any(
                    w is not None and (w.dtype is not torch.float32 or not w.is_contiguous())
                    for w in (layer.in_norm, layer.post_norm, bias, q_norm, k_norm)):
                return None
            stack.add_layer(layer.in_norm, layer.in_eps, layer.post_norm, layer.post_eps, qkv, o_proj, gate_up, down,
                            layer.scale, layer.window or 0, qkv_bias=bias, q_norm=q_norm, k_norm=k_norm,
                            qk_eps=qk_eps)
        rope = self.rope.table(torch.float32)  # None: cos/sin depend on more than the position
        if rope is not None:
            stack.set_rope(*rope)
            self.stack_rope_positions = rope[0].shape[0]
        table = _embedding_table(self.embed)
        if table is not None:
            stack.set_embedding(*table)
        # the head's kernel serves the stack's rows only if it serves as many as every layer's
        head = self.lm_head.handle() if self.lm_head.max_rows >= self.direct_max_rows else None
        stack.set_head(self.norm, self.norm_eps, head)
        self.stack_embeds, self.stack_head = table is not None, head is not None
        return stack

    def _decode_attention(self, decode_attention: Callable, cos: torch.Tensor, sin: torch.Tensor,
                          meta: AttentionMetadata) -> Callable:
        """``_Step.attention`` for an all-decode float32 CPU step (``cos``, ``sin``: ``[T, d]``, contiguous)."""
        heads, kv_heads, pool, slots = self.num_heads, self.num_kv_heads, meta.pool, meta.slot_mapping
        rows, tables, lens = meta.decode_rows, meta.decode_tables, meta.decode_lens

        def attention(index: int, qkv: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
            k_blocks, v_blocks = pool.layer_blocks(index)
            return decode_attention(qkv, heads, kv_heads, cos, sin, slots, k_blocks, v_blocks, rows, tables, lens,
                                    scale, window or 0)
        return attention

    def _paged_attention(self, rope: Rope, meta: AttentionMetadata, num_tokens: int) -> Callable:
        """``_Step.attention`` for any step: RoPE on q and k, then engine.attention's paged attention."""
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_width = (heads + kv_heads) * head_dim

        def attention(index: int, qkv: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
            qk = rope(qkv[:, :qk_width].view(num_tokens, heads + kv_heads, head_dim))
            v = qkv[:, qk_width:].view(num_tokens, kv_heads, head_dim)
            return paged_attention(index, qk[:, :heads], qk[:, heads:], v, meta, scale, window)
        return attention

    def _act_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up

    def _norm_qk(self, rms_norm: Callable, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float) -> None:
        """RMSNorm over each head of q and of k, in place in ``qkv`` ``[T, (H + 2 H_kv) d]`` (Qwen3's q_norm and
        k_norm, before RoPE), with the step's ``rms_norm`` (``_LayerCalls.rms_norm``: the C++ op on float32 CPU
        rows, whose bits the layer stack's norms have, else transformers' RMSNorm, ``_rms_norm``)."""
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, :heads * d].view(-1, heads, d)  # [T, H, d], a view into qkv
        k = qkv[:, heads * d:(heads + kv_heads) * d].view(-1, kv_heads, d)  # [T, H_kv, d]
        if any(w.dtype is not torch.float32 or not w.is_contiguous() for w in (q_weight, k_weight)):
            rms_norm = _rms_norm  # the C++ op takes contiguous float32 weights only
        q.copy_(rms_norm(q.reshape(-1, d).contiguous(), q_weight, eps).view_as(q))  # heads as rows: [T H, d]
        k.copy_(rms_norm(k.reshape(-1, d).contiguous(), k_weight, eps).view_as(k))

    @contextlib.contextmanager
    def aten_ops(self):
        """Within the block every projection runs torch's own ops instead of a C++ kernel, and so do the norms,
        RoPE and attention, so dispatch-level tools (``loadtest.engine.macs.MacCounter``) see every product."""
        self._torch_projections = True
        try:
            with native.torch_ops_only():
                yield
        finally:
            self._torch_projections = False

    @contextlib.contextmanager
    def layer_loop_only(self):
        """Within the block all-decode steps run the layer loop instead of the layer stack: the same bits, the
        calls from Python (``loadtest profile --layers both`` times one against the other)."""
        self._stack_off = True
        try:
            yield
        finally:
            self._stack_off = False

    def all_projections(self) -> list[Projection]:
        """Every layer's Projections, in call order (the LM head not included)."""
        return [p for layer in self.projections for p in layer.all()]


def _unlabelled(fn: Callable, label: str) -> Callable:
    return fn


def _activation_dtype(embed: nn.Module) -> torch.dtype | None:
    """The dtype of the rows ``embed`` returns (the model's activations), or None if unknown."""
    if isinstance(embed, GGMLEmbedding):
        return embed.dtype
    weight = getattr(embed, "weight", None)
    return weight.dtype if type(embed) is nn.Embedding and weight is not None else None


def _embedding_table(embed: nn.Module) -> tuple[torch.Tensor, str, int, int] | None:
    """``embed``'s table as ``DecodeLayers.set_embedding`` takes it (the table, its kind, its panels' rows or 0,
    its rows), or None where the stack cannot look rows up in it the way ``embed`` does (a max_norm, another
    device). It looks rows up in every GGMLKind, in rows or in a tied head's panels: the tied Q6_K table of a
    Q4_K_M file (128,256 rows of Llama 3's vocabulary) would otherwise be dequantized from Python, a dozen tensor
    ops each step."""
    if isinstance(embed, GGMLEmbedding):
        blocks = embed.table()
        if embed.dtype is torch.float32 and blocks.is_cpu and blocks.is_contiguous():
            return blocks, embed.kind.value, embed.panel_rows, embed.num_embeddings
        return None
    weight = getattr(embed, "weight", None)
    if (type(embed) is nn.Embedding and embed.max_norm is None and weight.dtype is torch.float32 and weight.is_cpu
            and weight.is_contiguous()):
        return weight, "f32", 0, weight.shape[0]
    return None


def _qk_norm(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float]:
    attn = layer.self_attn
    return attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon


def _window(config, layer: nn.Module) -> int | None:
    if for_model_type(config.model_type).sliding_window:
        return getattr(config, "sliding_window", None)
    return getattr(layer.self_attn, "sliding_window", None)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' LlamaRMSNorm computes it (float32 statistics; Zhang & Sennrich 2019), torch ops.

    float32: torch's fused ``rms_norm`` (bit-identical to transformers). For 16-bit input transformers rounds
    the normalized value before the weight, so that path is spelled out. (float32 CPU steps call the C++ op:
    torch's ``rms_norm`` is composite there, several ops per call.)
    """
    if x.dtype is torch.float32 and weight.dtype is torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += update`` in place (the residual stream), then ``rms_norm(x)``, torch ops."""
    x += update
    return _rms_norm(x, weight, eps)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the fast path, or None if it can."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (fast path: {sorted(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "unexpected module layout"
    return None


def fast_decoder(model: nn.Module) -> FastDecoder | None:
    """A FastDecoder over ``model``, or None if it is unsupported or ``KVSERVE_FASTPATH=0`` turns it off.

    The runner calls this once, when it is built: the only place the switch is read.
    """
    if not environment.fastpath_on():
        log.info("engine: transformers forward (KVSERVE_FASTPATH=0 turns the lean forward off; unset it to use it)")
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("engine: transformers forward: the lean forward does not take this model (%s)", reason)
        return None
    decoder = FastDecoder(model)
    with_kernels = any(p.kernel is not None for p in decoder.all_projections())
    log.info("engine: lean Llama-family forward (%s; fused q/k/v; KVSERVE_FASTPATH=0 turns it off); %s",
             model.config.model_type,
             f"C++ kernels ({native.isa()}) for decode-sized projections" if with_kernels
             else f"torch's ops for the projections: the C++ kernels are off because {kernels_off_reason(model)}")
    return decoder


def kernels_off_reason(model: nn.Module) -> str:
    """Why no projection of ``model`` runs a C++ kernel, and what would turn them on (for the start log)."""
    embed = model.get_input_embeddings()
    # a GGUF model's table is GGMLEmbedding's blocks (a buffer, or a tied head's: no .weight)
    weight = embed.table() if isinstance(embed, GGMLEmbedding) else next(itertools.chain(embed.parameters(),
                                                                                        embed.buffers()))
    if weight.device.type != "cpu":
        return f"the model runs on {weight.device.type} (the kernels are CPU code; --device cpu runs them)"
    if native.load(build=False) is None:
        if not environment.native_kernels_on():
            return "KVSERVE_NATIVE_KERNELS=0 turns them off (unset it to use them)"
        return "they could not be built (the warning above says why; `python -m kvserve.native --build` retries)"
    if isinstance(embed, nn.Embedding) and weight.dtype is not torch.float32:
        return (f"the weights are {str(weight.dtype).removeprefix('torch.')} (the kernels take float32 or quantized "
                "weights: --dtype float32 or --quantization int8/int4/nf4)")
    return "no projection is an nn.Linear or a quantized layer they know"
