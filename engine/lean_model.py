"""The modules a GGUF file's own blocks are served in: plain torch modules, built from the file's config for each
family of engine.architectures, without transformers' model classes.

    LeanCausalLM                  .config: engine.architectures.ModelConfig (transformers' names, config_from_gguf)
                                  .generation_config.eos_token_id: the ids that end a reply
      .model.embed_tokens         nn.Embedding or GGMLEmbedding   [vocab, hidden]
      .model.layers[i]            .input_layernorm, .post_attention_layernorm: RMSNorm
                                  .self_attn: q_proj, k_proj, v_proj, o_proj; q_norm, k_norm (qk_norm families);
                                              scaling, layer_idx, sliding_window
                                  .mlp: gate_proj, up_proj, down_proj, act_fn (SiLU)
      .model.norm                 RMSNorm
      .model.rotary_emb           Rotary: inv_freq, attention_scaling, rope_type; (x, position_ids) -> cos, sin
      .lm_head                    nn.Linear or GGMLLinear   [vocab, hidden]

The names and shapes are transformers' Llama ones: engine.gguf_model installs the file's tensors by them, and
engine.fastpath (``FastDecoder``) and engine.kernelbind read them as they read a transformers model, so the lean
forward is the same code on both. It is the only forward here: calling the model raises. Serving needs nothing
more, and transformers' modeling code (with torch.distributed, torch._dynamo, sympy, accelerate: about 120 MiB
resident) is never imported. ``transformers_model`` puts the same modules into transformers' model of the family,
for what needs transformers' own forward (kvserve's own rounding schemes, ``KVSERVE_FASTPATH=0``, the tests'
reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.engine.architectures import for_model_type


class RMSNorm(nn.Module):
    """An RMSNorm's weight ``[n]`` and epsilon (``variance_epsilon``, transformers' name); engine.fastpath
    computes it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"), requires_grad=False)
        self.variance_epsilon = eps


class Rotary(nn.Module):
    """RoPE's inverse frequencies for the config's ``rope_parameters`` and their cos/sin, as transformers'
    ``LlamaRotaryEmbedding`` computes them (its ``forward``, bit for bit: engine.rope.RopeTable fills its table
    with this).

    Attributes:
        inv_freq: ``[head_dim / 2]`` float32 (Llama 3's frequency factors are applied by the installer).
        attention_scaling: cos and sin are scaled by it (YaRN's; 1.0 otherwise).
        rope_type: the config's ``rope_type`` ("default", "linear", "yarn").
    """

    def __init__(self, config) -> None:
        super().__init__()
        params = config.rope_parameters
        self.rope_type = params["rope_type"]
        if self.rope_type == "default":
            dim = config.head_dim
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:  # transformers' own formulas, which read transformers' config class
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            made = config.to_transformers() if hasattr(config, "to_transformers") else config
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](made)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[B, T, head_dim]`` in ``x``'s dtype for ``position_ids`` ``[B, T]``."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.attention_scaling).to(dtype=x.dtype),
                (emb.sin() * self.attention_scaling).to(dtype=x.dtype))


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An ``nn.Linear`` whose weight ``[out, in]`` (and bias) lie on the meta device, never initialized: its
    ``reset_parameters`` on meta tensors goes through torch's reference ops, which import torch._dynamo (and
    sympy: tens of MiB resident)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
    layer.register_parameter("bias", nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False)
                             if bias else None)
    return layer


class Attention(nn.Module):
    """One layer's attention projections (and q/k norms), its softmax scale and sliding window."""

    def __init__(self, config, layer_idx: int, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        q_width, kv_width = config.num_attention_heads * d, config.num_key_value_heads * d
        self.layer_idx = layer_idx
        self.scaling = d ** -0.5
        self.sliding_window = None  # a family with a window reads it from the config (engine.fastpath._window)
        self.q_proj, self.k_proj = _linear(hidden, q_width, bias), _linear(hidden, kv_width, bias)
        self.v_proj, self.o_proj = _linear(hidden, kv_width, bias), _linear(q_width, hidden, False)
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d, config.rms_norm_eps), RMSNorm(d, config.rms_norm_eps)


class MLP(nn.Module):
    """One layer's gated MLP: ``down(act(gate(h)) * up(h))``."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = _linear(hidden, inner, False), _linear(hidden, inner, False)
        self.down_proj = _linear(inner, hidden, False)
        self.act_fn = nn.SiLU()


class DecoderLayer(nn.Module):
    """One decoder layer's norms, attention and MLP."""

    def __init__(self, config, layer_idx: int, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Decoder(nn.Module):
    """The embedding, the layers, the final norm and RoPE."""

    def __init__(self, config, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        shape = (config.vocab_size, config.hidden_size)  # a given weight: not initialized (see _linear)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape, device="meta"), _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i, bias, qk_norm) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Rotary(config)


@dataclass(slots=True)
class GenerationSettings:
    """What transformers' ``generation_config`` says that kvserve reads: the ids that end a reply."""

    eos_token_id: list[int] | int | None = None


class LeanCausalLM(nn.Module):
    """A decoder of engine.architectures' families in the layout above, its parameters on the meta device until
    engine.gguf_model installs them.

    Args:
        config: the model's config (engine.architectures.ModelConfig, or transformers' config of the family).

    Raises:
        ValueError: a model type engine.architectures does not list.
    """

    def __init__(self, config) -> None:
        super().__init__()
        arch = for_model_type(config.model_type)
        if arch is None:
            raise ValueError(f"no lean modules for model type {config.model_type!r}")
        self.config = config
        self.generation_config = GenerationSettings(getattr(config, "eos_token_id", None))
        bias = arch.qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = Decoder(config, bias, arch.qk_norm)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm_head = head

    def forward(self, *args, **kwargs):
        """Refused: these modules run only through engine.fastpath's FastDecoder (``transformers_model`` gives
        a transformers model over the same modules)."""
        raise TypeError("a GGUF model's lean modules run through engine.fastpath.FastDecoder only "
                        "(engine.lean_model.transformers_model gives transformers' forward over the same weights)")


def transformers_model(lean: LeanCausalLM) -> nn.Module:
    """transformers' model of ``lean``'s family over ``lean``'s own modules (the same tensors, not copies), wired
    to kvserve's paged attention (engine.attention): what runs transformers' forward on a GGUF file's weights.
    Imports transformers' modeling code (lazily: serving a GGUF file's blocks never calls this).

    Raises:
        ValueError: a parameter of the transformers model that ``lean`` does not provide.
        engine.gguf_file.GGUFError: transformers refuses the config (``ModelConfig.to_transformers``).
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from kvserve.engine import attention

    attention.register()
    inner = lean.model
    config = lean.config.to_transformers() if hasattr(lean.config, "to_transformers") else lean.config
    with init_empty_weights():  # parameters on the meta device: every one is then ``lean``'s
        model = AutoModelForCausalLM.from_config(config, dtype=inner.norm.weight.dtype,
                                                 attn_implementation=attention.ATTN_IMPLEMENTATION)
    model.lm_head, model.model.embed_tokens = lean.lm_head, inner.embed_tokens
    model.model.norm.weight = inner.norm.weight
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.original_inv_freq = inner.rotary_emb.inv_freq
    for ours, theirs in zip(inner.layers, model.model.layers):
        for name, module in ours.named_modules():
            parent, _, child = name.rpartition(".")
            if isinstance(module, RMSNorm):
                theirs.get_submodule(name).weight = module.weight
            elif name and not list(module.children()) and not isinstance(module, nn.SiLU):
                setattr(theirs.get_submodule(parent) if parent else theirs, child, module)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the lean model has no tensor for {', '.join(left[:3])}")
    model.generation_config.eos_token_id = lean.generation_config.eos_token_id
    return model.eval()
