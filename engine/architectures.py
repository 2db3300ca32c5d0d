"""The decoder families kvserve serves, and what each changes in the common Llama-style forward.

The common forward (engine.fastpath; transformers' own modules as the reference) is a Llama decoder:

    x = embed(ids)
    per layer:  x += o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms_norm(x)
                x += down_proj(silu(gate_proj(n)) * up_proj(n))                      n = rms_norm(x)
    logits = lm_head(rms_norm(x))            (lm_head may be the embedding: tied)

An ``Architecture`` says what one family changes there, as data, and how its GGUF metadata names things; a
GGUF file's config (``config_from_gguf``) is the common keys plus those changes. Adding a family is one entry
in ``ARCHITECTURES`` (and, if it changes the forward in a new way, the one place in engine.fastpath that reads
the new field).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.gguf_file import GGUFError, GGUFFile


@dataclass(slots=True, frozen=True)
class Architecture:
    """One decoder family.

    Attributes:
        model_type: transformers' model type (its config and ``...ForCausalLM`` classes), kvserve's key.
        gguf_name: ``general.architecture`` in llama.cpp's files; its metadata keys start with it.
        permuted_qk: llama.cpp's converter permuted the rows of Q and K for its RoPE layout (pairs of rotated
            dimensions side by side, convert_hf_to_gguf.py's LlamaModel); undone at load.
        qkv_bias: q, k and v projections carry biases (``blk.N.attn_q.bias``...).
        qk_norm: q and k are RMS-normalized per head before RoPE (``blk.N.attn_q_norm.weight``).
        sliding_window: the config's sliding window applies (None in a GGUF file that does not state one).
    """

    model_type: str
    gguf_name: str
    permuted_qk: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: bool = False


LLAMA = Architecture("llama", "llama", permuted_qk=True)  # Llama 2 / 3.x, SmolLM
# llama.cpp writes Mistral 7B as a "llama" file; transformers tells them apart by the name, and so do we
MISTRAL = Architecture("mistral", "llama", permuted_qk=True, sliding_window=True)
QWEN2 = Architecture("qwen2", "qwen2", qkv_bias=True)
QWEN3 = Architecture("qwen3", "qwen3", qk_norm=True)
ARCHITECTURES = {arch.model_type: arch for arch in (LLAMA, MISTRAL, QWEN2, QWEN3)}
SUPPORTED = "llama (Llama 2/3.x, SmolLM), mistral, qwen2, qwen3"

ROPE_SCALINGS = ("none", "linear", "yarn")


class ModelConfig:
    """A decoder's configuration under transformers' attribute names (``model_type``, ``hidden_size``,
    ``num_key_value_heads``, ``rope_parameters``, ...), as plain attributes.

    Why not transformers' config class: importing one (``LlamaConfig``...) imports transformers' weight-loading
    code with it (torch.distributed.tensor, sympy: about 65 MiB resident), which a server of a GGUF file's own
    blocks never runs. ``to_transformers`` gives that class where a transformers model is built.

    Args:
        model_type: transformers' model type (engine.architectures' key).
        source: where the values come from (the GGUF file), for error messages.
        values: the config's keys (those ``config_from_gguf`` sets), as attributes.
    """

    def __init__(self, model_type: str, source: object = None, **values) -> None:
        self.model_type = model_type
        self._source = source
        self._values = values
        self.__dict__.update(values)

    def to_dict(self) -> dict:
        """config.json's content: ``architectures`` (transformers' ``...ForCausalLM`` class), ``model_type`` and
        the values; transformers' ``AutoConfig`` reads it, defaulting what it does not name."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return {"architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.model_type]], "model_type": self.model_type,
                **self._values}

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``directory/config.json`` (``to_dict``)."""
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def to_transformers(self):
        """transformers' config of the family with these values (imports its config class).

        Raises:
            GGUFError: transformers' own validation refuses a value (its first line named).
        """
        from transformers import AutoConfig

        values = self.to_dict()
        values.pop("model_type")
        try:
            made = AutoConfig.for_model(self.model_type, **values)
        except Exception as exc:  # noqa: BLE001 - transformers' own validation (its error types vary by version)
            first_line = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else type(exc).__name__
            raise GGUFError(f"{self._source}: its {self.model_type} config is refused: {first_line}") from None
        return made

    def __repr__(self) -> str:
        return f"ModelConfig({self.model_type!r}, {self._values!r})"


def for_model_type(model_type: str) -> Architecture | None:
    """The family of a transformers model type, or None when kvserve's lean forward does not take it."""
    return ARCHITECTURES.get(model_type)


def for_gguf(file: GGUFFile) -> Architecture:
    """The family a GGUF file holds.

    Raises:
        GGUFError: an architecture kvserve does not serve (the message names those it does).
    """
    name = file.architecture
    if name == "llama" and "mistral" in str(file.metadata.get("general.name", "")).lower():
        return MISTRAL
    for arch in ARCHITECTURES.values():
        if arch.gguf_name == name and arch is not MISTRAL:
            return arch
    if name == "mistral":  # some converters write the name itself
        return MISTRAL
    raise GGUFError(f"{file.path}: architecture {name!r} is not served by kvserve (it serves {SUPPORTED})")


def config_from_gguf(file: GGUFFile, arch: Architecture) -> ModelConfig:
    """The config of ``file`` (``ModelConfig``, transformers' names): llama.cpp's metadata keys (``{arch}.block_count``, ...) mapped to
    transformers' names, the special token ids, and ``tie_word_embeddings`` when the file has no
    ``output.weight``. Values llama.cpp defaults when absent are defaulted the same way (head_count_kv to
    head_count, key_length to embedding_length / head_count, rope.freq_base to 10000).

    Raises:
        GGUFError: a required key is missing or of the wrong type, a value out of range, key and value head
            sizes that differ, a partial rotary dimension, or a RoPE scaling kvserve does not compute.
    """
    prefix = f"{arch.gguf_name}."
    path = file.path

    def positive(key: str, default: int | None = None) -> int:
        value = file.get(prefix + key, int, default)
        if value is None:
            raise GGUFError(f"{path}: metadata {prefix + key} is missing")
        if not 0 < value < 1 << 31:
            raise GGUFError(f"{path}: metadata {prefix + key} = {value} is out of range")
        return value

    hidden, heads = positive("embedding_length"), positive("attention.head_count")
    kv_heads = positive("attention.head_count_kv", heads)
    head_dim = positive("attention.key_length", hidden // heads if hidden % heads == 0 else None)
    if positive("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{path}: key and value heads of different sizes are not served")
    if heads % kv_heads:
        raise GGUFError(f"{path}: {heads} query heads do not share {kv_heads} key/value heads evenly")
    if positive("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(f"{path}: RoPE over part of a head (rope.dimension_count) is not served")
    eps = float(file.get(prefix + "attention.layer_norm_rms_epsilon", (float, int), 1e-6))
    theta = float(file.get(prefix + "rope.freq_base", (float, int), 10000.0))
    if not (0 < eps < 1 and math.isfinite(theta) and theta > 1):
        raise GGUFError(f"{path}: RMSNorm epsilon {eps} or RoPE base {theta} is out of range")
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None and not isinstance(tokens, (str, int, float)) else None
    if vocab is None:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens (kvserve serves files that carry their tokenizer)")
    config = {
        "num_hidden_layers": positive("block_count"),
        "hidden_size": hidden,
        "intermediate_size": positive("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": positive("context_length", 2048),
        "rms_norm_eps": eps,
        "rope_parameters": _rope(file, prefix, theta),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "hidden_act": "silu",
    }
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        token_id = file.get(f"tokenizer.ggml.{key}", int)
        if token_id is not None:
            if not 0 <= token_id < vocab:
                raise GGUFError(f"{path}: tokenizer.ggml.{key} {token_id} is outside the vocabulary of {vocab}")
            config[name] = token_id
    if arch is LLAMA or arch is MISTRAL:
        config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    if arch.sliding_window:
        window = config["sliding_window"] = file.get(prefix + "attention.sliding_window", int)
        if window is not None and not 0 < window < 1 << 31:
            raise GGUFError(f"{path}: metadata {prefix}attention.sliding_window = {window} is out of range")
    if arch is QWEN2 or arch is QWEN3:
        config["use_sliding_window"] = False
    if config["num_hidden_layers"] > len(file.tensors):  # each layer has tensors: more is a lie (and long loops)
        raise GGUFError(f"{path}: {prefix}block_count {config['num_hidden_layers']} is more than the file's "
                        f"{len(file.tensors)} tensors")
    return ModelConfig(arch.model_type, path, **config)


def _rope(file: GGUFFile, prefix: str, theta: float) -> dict:
    """transformers' ``rope_parameters`` for the file's ``rope.scaling.*`` keys (Llama 3's frequency factors are
    a tensor, ``rope_freqs.weight``, applied to the rotary module at load: engine.gguf_model)."""
    scaling = file.get(prefix + "rope.scaling.type", str, "none")
    if scaling not in ROPE_SCALINGS:
        raise GGUFError(f"{file.path}: RoPE scaling {scaling!r} is not served (kvserve computes "
                        f"{', '.join(ROPE_SCALINGS)}, and Llama 3's frequency factors)")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(file.get(prefix + "rope.scaling.factor", (float, int), 1.0))
    if not 1 <= factor <= 1024:
        raise GGUFError(f"{file.path}: RoPE scaling factor {factor} is out of range")
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    original = file.get(prefix + "rope.scaling.original_context_length", int)
    if original is None or original < 1:
        raise GGUFError(f"{file.path}: YaRN scaling without rope.scaling.original_context_length")
    return {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": original}
