"""Serve a GGUF file's own quantized blocks: its projections and LM head become ``GGMLLinear`` layers.

The model skeleton (config, tokenizer, norms) is the one ``engine.loader`` builds from the file; this module then
reads each projection's tensor (engine.gguf_index) and, where its type is one kvserve computes with
(Q4_1, Q4_0 as Q4_1, Q8_0), installs the file's bytes as they are. A tensor of any other type keeps the loaded
float weights (the file's own dequantization), and the log says so per type.

llama.cpp's converter permutes the rows of Q and K for its RoPE layout (pairs of rotated dimensions next to
each other); transformers' GGUF loader undoes it (``LlamaTensorProcessor._reverse_permute_weights``). A block
spans 32 consecutive inputs of one row, so permuting rows moves whole blocks: the same undoing applies to
the bytes exactly.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvserve.engine.gguf_index import read_index
from kvserve.quant.ggml import GGMLEmbedding, GGMLKind, GGMLLinear, q4_0_as_q4_1
from kvserve.quant.linear import Layout
from kvserve.quant.model import projection_names

log = logging.getLogger("kvserve.engine")

# llama.cpp permutes Q and K rows only for these architectures (convert_hf_to_gguf.py's LlamaModel and its
# subclasses; transformers' GGUF loader undoes it for the same ones)
PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})


@dataclass(slots=True, frozen=True)
class NativeSummary:
    """What ``use_gguf_blocks`` installed.

    Attributes:
        path: the GGUF file.
        kinds: projections per block format, e.g. ``{"q4_1": 210}``.
        head: the LM head's format ("q8_0"), or "float" where it kept the loaded weights (the input embedding
            is looked up in the file's ``token_embd`` blocks where kvserve reads their type).
        kept: projections (and head) per GGUF type that kvserve does not compute with, kept as float weights.
        bytes_after: bytes of every installed block (what one decode step reads, the head included).
    """

    path: Path
    kinds: dict[str, int]
    head: str
    kept: dict[str, int]
    bytes_after: int

    def describe(self) -> str:
        """One line for logs."""
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items())) or "none"
        kept = "; kept as float (the file's dequantization): " + ", ".join(
            f"{n} {t}" for t, n in sorted(self.kept.items())) if self.kept else ""
        return (f"the GGUF's own blocks ({self.path.name}): projections {kinds}, LM head {self.head}, "
                f"{self.bytes_after / 2**20:.1f} MiB{kept}")


def unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: ``hf[i] = gguf[order[i]]``, int64 ``[rows]``.

    Per head, llama.cpp interleaves the two halves of the head's rows (``reshape(h, 2, d/2).swapaxes(1, 2)``);
    transformers' ``_reverse_permute_weights`` reshapes ``(h, d/2, 2)`` and swaps back, which is this gather.
    """
    return torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def tensor_blocks(tensor) -> tuple[torch.Tensor, GGMLKind] | None:
    """A GGUF tensor's bytes ``[rows, bytes_per_row]`` and format where kvserve computes with it, else None."""
    import gguf

    kind = {gguf.GGMLQuantizationType.Q4_1: GGMLKind.Q4_1, gguf.GGMLQuantizationType.Q4_0: GGMLKind.Q4_1,
            gguf.GGMLQuantizationType.Q8_0: GGMLKind.Q8_0}.get(tensor.tensor_type)
    if kind is None:
        return None
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # a copy: the reader's memmap is read-only
    if tensor.tensor_type is gguf.GGMLQuantizationType.Q4_0:
        blocks = q4_0_as_q4_1(blocks)
    return blocks, kind


def gguf_name_map(architecture: str, num_layers: int):
    """gguf's map from transformers module names to a file's tensor names, for its architecture (e.g. "llama")."""
    import gguf

    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    return gguf.get_tensor_name_map(arch, num_layers)


def use_gguf_blocks(model: nn.Module, path: Path) -> NativeSummary:
    """Replace ``model``'s projections, LM head and embedding with the GGUF file's own blocks, in place.

    Args:
        model: the transformers causal LM loaded from ``path`` (its float weights are the file's dequantized).
        path: the GGUF file.

    Returns:
        What was installed (``NativeSummary``).

    Raises:
        ValueError: the file has no tensor for a projection, or a tensor of another shape than the layer's.
    """
    index = read_index(path)
    config = model.config
    names = gguf_name_map(index.architecture, config.num_hidden_layers)
    tensors = {name.removesuffix(".weight"): t for name, t in index.tensors.items()}
    permuted = index.architecture in PERMUTED_ARCHITECTURES
    heads = {"q_proj": config.num_attention_heads,
             "k_proj": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    kinds, kept, total = Counter(), Counter(), 0

    def install(name: str) -> GGMLLinear | None:
        nonlocal total
        module = model.get_submodule(name)
        tensor = tensors.get(names.get_name(name))
        if tensor is None and name == "lm_head":  # a tied head: the file stores only the embedding
            tensor = tensors.get("token_embd")
        if tensor is None:
            raise ValueError(f"{path.name} has no tensor for {name}")
        found = tensor_blocks(tensor)
        if found is None:
            kept[tensor.tensor_type.name] += 1
            return None
        blocks, kind = found
        if blocks.shape[0] != module.out_features or blocks.shape[1] // kind.block_bytes * 32 != module.in_features:
            raise ValueError(f"{tensor.name} holds {blocks.shape[0]} rows of {tensor.shape[0]} weights, {name} is "
                             f"[{module.out_features}, {module.in_features}]")
        short = name.rpartition(".")[2]
        if permuted and short in heads:
            blocks = blocks[unpermute_rows(blocks.shape[0], heads[short])]
        layer = GGMLLinear(blocks, kind, module.bias).to(module.weight.device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        total += layer.weight_bytes
        return layer

    for name in projection_names(model):
        layer = install(name)
        if layer is not None:
            kinds[layer.kind.value] += 1
    head = install("lm_head")
    embedding = tensor_blocks(tensors["token_embd"]) if "token_embd" in tensors else None
    if embedding is not None:
        blocks, kind = embedding
        shares_head = head is not None and names.get_name("lm_head") not in tensors  # the head is token_embd
        if shares_head and head.layout is Layout.ROWS:
            blocks = head.weight  # one copy; where the kernel holds the head in its own order, a second one
        else:
            total += blocks.numel()
        model.model.embed_tokens = GGMLEmbedding(blocks, kind, model.model.embed_tokens.weight.dtype)
    summary = NativeSummary(path=Path(path), kinds=dict(kinds), head="float" if head is None else head.kind.value,
                            kept=dict(kept), bytes_after=total)
    for kind, count in sorted(kept.items()):
        log.info("GGUF tensors of type %s: %d kept as float weights (kvserve computes with Q4_1, Q4_0, Q8_0 "
                 "blocks; the rest dequantized, then as --quantization asks)", kind, count)
    return summary
