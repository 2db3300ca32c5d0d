"""Multiply-accumulates (MACs) to generate T tokens from a cold start, with and without a KV cache.

Closed form for a Llama-style decoder (L layers, hidden h, H query heads, H_kv KV heads, head dim d, MLP
width f, vocabulary V), counting every matrix product the model runs:

    per new token:   lin  = L * (h*H*d + 2*h*H_kv*d + H*d*h + 3*h*f)   (q, k, v, o, gate/up/down projections)
    attention:       2*L*H*d per (query, key) pair                      (Q K^T and P V)
    per step:        h*V for the one position whose logits are kept     (LM head)

Step t = 1..T has a context of t tokens. With a cache it computes one new token against t keys; without
one it recomputes all t tokens, and the dense score matrix is t x t (a masked kernel still multiplies it):

    with cache:    T*(lin + h*V) + 2*L*H*d * T(T+1)/2                      O(T^2)
    without:       lin * T(T+1)/2 + T*h*V + 2*L*H*d * T(T+1)(2T+1)/6     O(T^3)

``MacCounter`` counts the same products at the ATen level while the real model runs, so the closed form
can be checked against the model (tests/test_loadtest_tables.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(slots=True, frozen=True)
class Geometry:
    """Decoder shape; every field counts elements (layers, channels, heads, tokens)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def of(cls, config) -> Geometry:
        """From a transformers Llama-style config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size)

    @property
    def per_token(self) -> int:
        """MACs of the projections (all layers) for one new token."""
        g = self
        return g.layers * (g.hidden * g.heads * g.head_dim + 2 * g.hidden * g.kv_heads * g.head_dim
                           + g.heads * g.head_dim * g.hidden + 3 * g.hidden * g.ffn)

    @property
    def per_pair(self) -> int:
        """Attention MACs for one (query, key) pair across all layers and heads."""
        return 2 * self.layers * self.heads * self.head_dim


def macs_with_cache(g: Geometry, tokens: int) -> int:
    """MACs to generate ``tokens`` tokens with a KV cache: sum over t of (one token vs t keys)."""
    t = tokens
    return t * (g.per_token + g.hidden * g.vocab) + g.per_pair * t * (t + 1) // 2


def macs_without_cache(g: Geometry, tokens: int) -> int:
    """MACs to generate ``tokens`` tokens recomputing the whole context (t x t scores) at every step."""
    t = tokens
    return g.per_token * t * (t + 1) // 2 + t * g.hidden * g.vocab + g.per_pair * t * (t + 1) * (2 * t + 1) // 6


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class MacCounter(TorchDispatchMode):
    """Counts MACs of matrix products (linear, matmul, mm, bmm, addmm, baddbmm, SDPA) as ops run.

    SDPA is counted dense: ``B * H * L_q * L_k * (D + D_v)``, whatever mask it is given.
    """

    _MM = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.matmul}
    _ADD_MM = {torch.ops.aten.addmm, torch.ops.aten.baddbmm}

    def __init__(self) -> None:
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is torch.ops.aten.linear:
            x, weight = args[:2]  # [..., in], [out, in]
            self.macs += _numel(x.shape) * weight.shape[0]
        elif packet in self._MM or packet in self._ADD_MM:
            a, b = args[1:3] if packet in self._ADD_MM else args[:2]  # [.., m, k] @ [.., k, n]
            out = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) if a.dim() > 2 and b.dim() > 2 else ()
            self.macs += _numel(out) * _numel(a.shape[-2:]) * b.shape[-1]
        elif "scaled_dot_product" in packet.__name__:
            q, k, v = args[:3]  # [B, H, L_q, D], [B, H_kv, L_k, D], [B, H_kv, L_k, D_v]
            self.macs += _numel(q.shape[:-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        return func(*args, **kwargs)
