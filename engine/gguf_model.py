"""A GGUF file loaded directly: its config and tokenizer from its metadata, its weights from the mapped file.

    read_gguf (checked header) -> family (engine.architectures) -> config -> every tensor's name, shape and
    type checked -> tokenizer (engine.gguf_tokenizer, cached) -> the family's lean modules (engine.lean_model,
    no weights allocated) -> each weight installed from the file:

    quantized tensor, ``--quantization gguf``  GGMLLinear / GGMLEmbedding over the file's own blocks
                                              (quant.ggml: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, each
                                              on its own native kernel; any other type the gguf package reads,
                                              e.g. the IQ families, dequantized to a float layer, named in one
                                              log line with its cost)
    quantized tensor, any other scheme        dequantized (gguf.quants, bit for bit) into a float layer, which
                                              the scheme then rounds its own way
    F32 / F16 / BF16 tensor                   a float layer (the float kernels), in the model's dtype

Served with its own blocks, the model stays in the lean modules, which only engine.fastpath runs (transformers'
modeling code is never imported); dequantized (kvserve's own rounding schemes follow, whose calibration runs
transformers' forward) or with ``KVSERVE_FASTPATH=0``, the same tensors are put into transformers' model of the
family (``engine.lean_model.transformers_model``).

Nothing is converted to a float file: the blocks are read from the mapping (engine.gguf_file) and, where the
kernels keep them in their own order, packed once, after which the file's pages are given back. Unknown
architectures, tensor types, names and shapes are refused before anything is allocated.

llama.cpp's converter permutes the rows of Q and K for its RoPE layout (Llama and Mistral only); a block spans
consecutive inputs of one row, so permuting rows back moves whole blocks: the undoing applies to the bytes
exactly (transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does the same to floats).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvserve.engine.architectures import Architecture, config_from_gguf, for_gguf
from kvserve.engine.gguf_file import GGUFError, GGUFFile, GGUFTensor, read_gguf
from kvserve.quant.ggml import GGMLEmbedding, GGMLKind, GGMLLinear
from kvserve.quant.linear import Layout

log = logging.getLogger("kvserve.engine")

FLOAT_TYPES = ("F32", "F16", "BF16")
# the transformers module of each per-layer GGUF tensor (llama.cpp's names: gguf's MODEL_TENSOR names)
LAYER_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
_NAMES_SHOWN = 3
DEQUANTIZE_ROWS = 1024


def block_kind(ggml_type) -> GGMLKind | None:
    """The GGMLKind a tensor of ``ggml_type`` is served as (its own blocks), or None: no kernel for it."""
    return GGMLKind.__members__.get(ggml_type.name)


def expected_tensors(file: GGUFFile, arch: Architecture, config) -> dict[str, tuple[int, ...]]:
    """Every tensor a file of ``arch`` with ``config`` holds, and its shape in ggml's order (fastest first)."""
    hidden, vocab, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    head_dim, inner = config.head_dim, config.intermediate_size
    q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (hidden, vocab)
    if "rope_freqs.weight" in file.tensors:  # Llama 3's RoPE frequency factors
        shapes["rope_freqs.weight"] = (head_dim // 2,)
    biases = arch.qkv_bias or getattr(config, "attention_bias", False)
    for i in range(layers):
        layer = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (hidden, q_width),
                 "attn_k": (hidden, kv_width), "attn_v": (hidden, kv_width), "attn_output": (q_width, hidden),
                 "ffn_gate": (hidden, inner), "ffn_up": (hidden, inner), "ffn_down": (inner, hidden)}
        shapes.update({f"blk.{i}.{name}.weight": shape for name, shape in layer.items()})
        if biases:
            shapes.update({f"blk.{i}.attn_{p}.bias": (w,) for p, w in (("q", q_width), ("k", kv_width),
                                                                         ("v", kv_width))})
        if arch.qk_norm:
            shapes.update({f"blk.{i}.attn_q_norm.weight": (head_dim,), f"blk.{i}.attn_k_norm.weight": (head_dim,)})
    return shapes


def check_tensors(file: GGUFFile, arch: Architecture, config) -> None:
    """Refuse a file whose tensors are not exactly those of its family and config, or of a type kvserve cannot
    read; cheap (the header and one row per type), so it runs before anything is allocated.

    Raises:
        GGUFError: one line naming the missing, unexpected, misshapen or unreadable tensors (a few of each), or
            a vocabulary whose size is not the embedding's.
    """
    import gguf

    expected = expected_tensors(file, arch, config)
    rows = file.tensors["token_embd.weight"].shape[-1] if "token_embd.weight" in file.tensors else None
    if rows is not None and rows != config.vocab_size:
        raise GGUFError(f"{file.path}: the vocabulary has {config.vocab_size} tokens, the embedding {rows} rows")
    problems = []
    missing = [name for name in expected if name not in file.tensors]
    unexpected = [name for name in file.tensors if name not in expected]
    misshapen = [f"{name} {file.tensors[name].shape} (expected {shape})" for name, shape in expected.items()
                 if name in file.tensors and file.tensors[name].shape != shape]
    unreadable = {}
    for tensor in file.tensors.values():
        kind = tensor.ggml_type
        if kind.name in FLOAT_TYPES or block_kind(kind) is not None or kind.name in unreadable:
            continue
        try:
            gguf.quants.dequantize(tensor.data()[:1], kind)
        except (NotImplementedError, ValueError):
            unreadable[kind.name] = tensor.name
    for names, what in ((missing, "missing"), (unexpected, "unexpected"), (misshapen, "of the wrong shape"),
                        (sorted(unreadable), "of a tensor type kvserve cannot read")):
        if names:
            more = ", ..." if len(names) > _NAMES_SHOWN else ""
            problems.append(f"{len(names)} {what} ({', '.join(names[:_NAMES_SHOWN])}{more})")
    if problems:
        served = ", ".join([*GGMLKind.__members__, *FLOAT_TYPES])
        raise GGUFError(f"{file.path} is not a {arch.model_type} file kvserve can load: tensors {'; '.join(problems)}"
                        f" (types with kernels: {served}; others the gguf package reads are served dequantized)")


def floats(tensor: GGUFTensor) -> torch.Tensor:
    """A tensor's values, float32 ``[rows, shape[0]]`` (squeezed to 1-D for a vector): a new tensor, bit for
    bit ``gguf.quants.dequantize``, computed DEQUANTIZE_ROWS rows at a time (the package's numpy code makes
    several temporaries the size of its input's floats)."""
    import gguf

    data = tensor.data()  # [rows, row bytes]
    out = np.empty((tensor.rows, tensor.shape[0]), dtype=np.float32)
    for start in range(0, tensor.rows, DEQUANTIZE_ROWS):
        out[start:start + DEQUANTIZE_ROWS] = gguf.quants.dequantize(data[start:start + DEQUANTIZE_ROWS],
                                                                    tensor.ggml_type)
    values = torch.from_numpy(out)
    return values[0] if len(tensor.shape) == 1 else values


def unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: ``hf[i] = gguf[order[i]]``, int64 ``[rows]``.

    Per head, llama.cpp interleaves the two halves of the head's rows (``reshape(h, 2, d/2).swapaxes(1, 2)``);
    transformers' ``_reverse_permute_weights`` reshapes ``(h, d/2, 2)`` and swaps back, which is this gather.
    """
    return torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


@dataclass(slots=True)
class GGUFSummary:
    """What was installed from a GGUF file.

    Attributes:
        path: the file.
        kinds: projections per block format served by a kernel, e.g. ``{"q4_k": 96, "q6_k": 16}``.
        head: the LM head's format, or "float".
        floats: projections (and head) per float type of the file (F32, F16, BF16), served as float layers in the
            model's dtype (the float kernels).
        dequantized: projections (and head) per GGUF type served dequantized, and their ``(file bytes, float
            bytes)``.
        bytes_after: bytes of every installed block (what one decode step reads, the head included).
    """

    path: Path
    kinds: Counter = field(default_factory=Counter)
    head: str = "float"
    floats: Counter = field(default_factory=Counter)
    dequantized: dict[str, list[int]] = field(default_factory=dict)
    bytes_after: int = 0

    def describe(self) -> str:
        """One line for logs, e.g. "the GGUF's own blocks (f.gguf): projections 96 q4_k, 16 q6_k, LM head q6_k,
        713.4 MiB; kernels q4_k: kv_q4_k_avx512, q6_k: kv_q6_k_avx512 (avx512: the best this CPU supports)"."""
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items())) or "none"
        return (f"the GGUF's own blocks ({self.path.name}): projections {kinds}, LM head {self.head}, "
                f"{self.bytes_after / 2**20:.1f} MiB{self.kernels_text()}{self.floats_text()}"
                f"{self.dequantized_note()}")

    def dequantized_note(self) -> str:
        """"" or "; 3 without a kernel, as floats (their own line)": ``log_dequantized`` names them."""
        count = sum(n for n, _, _ in self.dequantized.values())
        return f"; {count} without a kernel, as floats (their own line)" if count else ""

    def kernels_text(self) -> str:
        """"; kernels q4_k: kv_q4_k_avx512, ... (the ISA path and why)": the native micro-kernel each block format
        runs on, or that none runs (the layers' reference: the blocks dequantized once, torch's GEMM)."""
        served = sorted({*self.kinds, *([self.head] if self.head != "float" else [])})
        if not served:
            return ""
        from kvserve import native

        path = native.isa()
        if native.load() is None:
            return f"; no native kernels, {path}: each block format dequantized once, torch's GEMM"
        chosen = path.split(" ", 1)[0]
        kernels = ", ".join(f"{k}: kv_{k}_{chosen}" for k in served)
        return f"; kernels {kernels} ({chosen}: {path.partition(' ')[2].strip('()')})"

    def floats_text(self) -> str:
        """"" or "; float tensors on the float kernels: 2 F16"."""
        if not self.floats:
            return ""
        return "; float tensors on the float kernels: " + ", ".join(f"{n} {t}" for t, n in sorted(self.floats.items()))

    def log_dequantized(self) -> None:
        """The one log line naming the types served dequantized and their cost, e.g. "GGUF tensors served as float
        layers, no native kernel for their type: 96 IQ4_XS, 17 IQ4_NL: 4.61 GiB of floats for the file's 0.73 GiB";
        nothing when there are none."""
        if not self.dequantized:
            return
        counts = ", ".join(f"{n} {t}" for t, (n, _, _) in sorted(self.dequantized.items()))
        stored = sum(b for _, b, _ in self.dequantized.values())
        served = sum(b for _, _, b in self.dequantized.values())
        log.info("GGUF tensors served as float layers, no native kernel for their type: %s: %s of floats for the "
                 "file's %s", counts, _size(served), _size(stored))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class _Installer:
    """Puts a GGUF file's tensors into a model of its family (engine.lean_model's modules, or transformers' of the
    same names), in place (see the module docstring).

    Args:
        file, arch, config: the checked file, its family and config.
        blocks: serve quantized tensors as their own blocks (else dequantized).
        dtype: the dtype of float layers and of the embedding's rows.
    """

    def __init__(self, file: GGUFFile, arch: Architecture, config, blocks: bool, dtype: torch.dtype) -> None:
        self.file, self.arch, self.config, self.blocks, self.dtype = file, arch, config, blocks, dtype
        self.summary = GGUFSummary(Path(file.path))
        self.heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}

    def vector(self, name: str) -> torch.Tensor:
        tensor = self.file.tensors[name]
        values = floats(tensor).to(self.dtype)
        self.file.release(tensor)
        return values

    def _rows_order(self, name: str) -> torch.Tensor | None:
        short = name.split(".")[2] if name.startswith("blk.") else ""
        if self.arch.permuted_qk and short in self.heads:
            return unpermute_rows(self.file.tensors[name].rows, self.heads[short])
        return None

    def linear(self, name: str, bias_name: str | None = None, count: bool = True) -> nn.Module:
        """The layer for weight tensor ``name`` (``[in, out]`` in ggml's order) and its optional bias."""
        tensor, order = self.file.tensors[name], self._rows_order(name)
        bias = None
        if bias_name is not None and bias_name in self.file.tensors:
            bias = self.vector(bias_name)
            bias = bias if order is None else bias[order]
        kind = block_kind(tensor.ggml_type)
        if self.blocks and kind is not None:
            data = torch.from_numpy(tensor.data())  # [out, row bytes], a view of the mapping
            data = data if order is None else data[order]
            layer = GGMLLinear(data, kind, bias)
            if not self.file.maps(layer.weight.data_ptr()):
                self.file.release(tensor)
            if count:
                self.summary.kinds[layer.kind.value] += 1
            self.summary.bytes_after += layer.weight_bytes
            return layer
        weight = floats(tensor)
        weight = (weight if order is None else weight[order]).to(self.dtype)  # [out, in]
        self.file.release(tensor)
        if self.blocks and tensor.ggml_type.name in FLOAT_TYPES:
            self.summary.floats[tensor.ggml_type.name] += 1
        elif self.blocks:
            entry = self.summary.dequantized.setdefault(tensor.ggml_type.name, [0, 0, 0])
            entry[0] += 1
            entry[1] += tensor.nbytes
            entry[2] += weight.numel() * weight.element_size()
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        return layer

    def head_and_embedding(self, model: nn.Module) -> None:
        """The LM head (``output``, or ``token_embd`` when tied) and the input embedding."""
        tied = "output.weight" not in self.file.tensors
        head = self.linear("token_embd.weight" if tied else "output.weight", count=False)
        model.lm_head = head
        self.summary.head = head.kind.value if isinstance(head, GGMLLinear) else "float"
        table = self.file.tensors["token_embd.weight"]
        kind = block_kind(table.ggml_type) if self.blocks else None
        if kind is None:
            weight = head.weight if tied and not isinstance(head, GGMLLinear) else floats(table).to(self.dtype)
            embedding = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
            embedding.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight,
                                                                                             requires_grad=False)
        else:
            if tied and isinstance(head, GGMLLinear):
                embedding = GGMLEmbedding.tied_to(head, self.dtype)  # the head's own blocks: one copy of the table
            else:
                rows = torch.from_numpy(table.data())
                self.summary.bytes_after += rows.numel()
                embedding = GGMLEmbedding(rows, kind, self.dtype)
        model.model.embed_tokens = embedding
        still_mapped = [t.data_ptr() for m in (head, embedding) for t in (*m.parameters(), *m.buffers())]
        if not any(self.file.maps(address) for address in still_mapped):
            self.file.release(table)

    def install(self, model: nn.Module) -> GGUFSummary:
        """Every weight of ``model`` (built empty, on the meta device) from the file."""
        inner = model.model
        self.head_and_embedding(model)
        inner.norm.weight = nn.Parameter(self.vector("output_norm.weight"), requires_grad=False)
        for i, block in enumerate(inner.layers):
            for short, module_name in LAYER_TENSORS.items():
                name = f"blk.{i}.{short}.weight"
                if name not in self.file.tensors:
                    continue
                parent, _, child = module_name.rpartition(".")
                owner = block.get_submodule(parent) if parent else block
                if getattr(owner, child).__class__ is nn.Linear:
                    setattr(owner, child, self.linear(name, f"blk.{i}.{short}.bias"))
                else:  # an RMSNorm
                    getattr(owner, child).weight = nn.Parameter(self.vector(name), requires_grad=False)
        if "rope_freqs.weight" in self.file.tensors:
            # Llama 3's RoPE: each frequency divided by its factor, as llama.cpp applies them
            # (convert_hf_to_gguf.py writes factors computed from the config's rope_scaling "llama3")
            rotary = inner.rotary_emb
            factors = floats(self.file.tensors["rope_freqs.weight"])
            rotary.inv_freq = rotary.inv_freq / factors.to(rotary.inv_freq.device)
            rotary.original_inv_freq = rotary.inv_freq
        left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if left:
            raise GGUFError(f"{self.file.path}: no tensor for {', '.join(left[:_NAMES_SHOWN])}")
        self.summary.log_dequantized()
        return self.summary


@dataclass(slots=True)
class GGUFModel:
    """A model built from a GGUF file (``load_gguf``)."""

    model: nn.Module  # engine.lean_model.LeanCausalLM, or transformers' model of the family
    tokenizer: object
    summary: GGUFSummary | None  # None: dequantized throughout (no blocks kept)
    general_name: str | None  # ``general.name``
    derived: Path | None  # the cached tokenizer and config (engine.gguf_tokenizer.derived_dir), if written
    identity: str  # GGUFFile.identity


STOP_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def stop_token_ids(file: GGUFFile, vocab: int) -> list[int] | None:
    """The ids that end a reply, as llama.cpp's vocabulary reads them from the file: end of sequence, end of turn
    and end of message (Llama 3's ``<|eot_id|>`` and ``<|eom_id|>`` besides ``<|end_of_text|>``), in that order,
    without repeats and ids outside the vocabulary of ``vocab`` tokens; None when the file names none."""
    ids: list[int] = []
    for key in STOP_TOKEN_KEYS:
        token_id = file.get(key, int)
        if token_id is not None and 0 <= token_id < vocab and token_id not in ids:
            ids.append(token_id)
    return ids or None


def check_gguf(path: str | Path) -> None:
    """Refuse a file kvserve cannot serve from its metadata and tensor table alone (a memory-mapped read, well
    under a second): before anything heavy runs, such as a first start's kernel build.

    Raises:
        GGUFError: as ``load_gguf`` for a malformed file, an architecture, tensor or value kvserve does not serve.
        OSError: the file cannot be read.
    """
    file = read_gguf(path)
    arch = for_gguf(file)
    check_tensors(file, arch, config_from_gguf(file, arch))


def load_gguf(path: str | Path, blocks: bool, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Load a GGUF file on the CPU (see the module docstring).

    Args:
        path: the file.
        blocks: keep quantized tensors as their own blocks (``--quantization gguf``), in the lean modules (unless
            ``KVSERVE_FASTPATH=0``); else dequantize them, in transformers' model.
        dtype: float layers' dtype (and the embedding rows').

    Raises:
        GGUFError: a malformed file (engine.gguf_file), an architecture, tokenizer, tensor or value kvserve does
            not serve; the message names what it serves.
        OSError: the file cannot be read.
    """
    from kvserve import environment
    from kvserve.engine.gguf_tokenizer import cached_tokenizer
    from kvserve.engine.lean_model import LeanCausalLM, transformers_model

    file = read_gguf(path)
    arch = for_gguf(file)
    config = config_from_gguf(file, arch)
    check_tensors(file, arch, config)
    tokenizer, derived = cached_tokenizer(file, config)
    model = LeanCausalLM(config)  # parameters on the meta device: nothing allocated until installed
    model.generation_config.eos_token_id = stop_token_ids(file, config.vocab_size)
    summary = _Installer(file, arch, config, blocks, dtype).install(model)
    if not blocks or not environment.fastpath_on():
        model = transformers_model(model)  # the same tensors in transformers' modules, for its forward
    model.eval()
    name = file.get("general.name", str)
    return GGUFModel(model, tokenizer, summary if blocks else None, name or None, derived, file.identity)


def use_gguf_blocks(model: nn.Module, path: str | Path) -> GGUFSummary:
    """Replace a float model's projections, LM head and embedding with the GGUF file's own blocks, in place.

    Args:
        model: the model ``load_gguf(path, blocks=False)`` built (float weights: the file's, dequantized).
        path: the GGUF file.

    Raises:
        GGUFError: as ``load_gguf``.
    """
    file = read_gguf(path)
    arch = for_gguf(file)
    check_tensors(file, arch, model.config)
    dtype = model.get_input_embeddings().weight.dtype
    installer = _Installer(file, arch, model.config, True, dtype)
    installer.head_and_embedding(model)
    for i, block in enumerate(model.model.layers):
        for short, module_name in LAYER_TENSORS.items():
            parent, _, child = module_name.rpartition(".")
            if isinstance(getattr(block.get_submodule(parent), child, None), nn.Linear):
                setattr(block.get_submodule(parent), child,
                        installer.linear(f"blk.{i}.{short}.weight", f"blk.{i}.{short}.bias"))
    installer.summary.log_dequantized()
    return installer.summary
