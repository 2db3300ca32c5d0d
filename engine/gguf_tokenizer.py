"""A GGUF file's tokenizer and chat template, converted once from its ``tokenizer.ggml.*`` metadata and cached.

The conversion is transformers' own (``convert_gguf_tokenizer``: byte-level BPE for ``gpt2`` vocabularies,
sentencepiece for ``llama`` ones, the pre-tokenizer split named by ``tokenizer.ggml.pre``), fed with the values
kvserve's checked reader (engine.gguf_file) decoded, after the checks below. The result is saved with the
model's config under ``cache_dir()/gguf/<file stem>-<identity>`` (a few MB; the identity is a hash of the
file's header, so another file, or the same name with other metadata, gets its own directory), which is also
what ``kvserve model-path`` prints for clients that tokenize locally. Later starts load it from there.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from kvserve import environment
from kvserve.engine.gguf_file import GGUFArray, GGUFError, GGUFFile
from kvserve.engine.heap import give_back

log = logging.getLogger("kvserve.engine")

TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, sentencepiece: the vocabularies of the families served
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # how llama.cpp spells a byte token (token type 6)
TOKEN_TYPES = range(0, 7)  # llama.cpp's llama_token_type: undefined .. byte
_BYTE_TYPE = 6
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}
_CONFIG_KEYS = {"chat_template": "tokenizer.chat_template", "add_bos_token": "tokenizer.ggml.add_bos_token",
                "add_eos_token": "tokenizer.ggml.add_eos_token"}


def derived_dir(file: GGUFFile) -> Path:
    """Where what kvserve derives from ``file`` is cached: ``cache_dir()/gguf/<stem>-<identity>``."""
    return environment.cache_dir() / "gguf" / f"{file.path.stem}-{file.identity}"


def _array(file: GGUFFile, key: str, required: bool = False) -> list | None:
    value = file.metadata.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, GGUFArray):
        raise GGUFError(f"{file.path}: metadata {key} is {'missing' if value is None else 'not an array'}")
    return value.values()


def tokenizer_values(file: GGUFFile) -> tuple[dict, dict]:
    """``(tokenizer_dict, tokenizer_config)`` as transformers' GGUF tokenizer conversion takes them, checked.

    Raises:
        GGUFError: an unknown tokenizer model; token types, scores or merges whose count or contents do not
            fit the vocabulary (a byte token not spelled ``<0xHH>``, a type outside 0-6, a merge that is not
            two tokens); a special token id outside the vocabulary.
    """
    path = file.path
    model = file.get("tokenizer.ggml.model", str)
    if model not in TOKENIZER_MODELS:
        raise GGUFError(f"{path}: tokenizer.ggml.model {model!r} is not one kvserve converts "
                        f"({', '.join(TOKENIZER_MODELS)})")
    tokens = _array(file, "tokenizer.ggml.tokens", required=True)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens is not a list of strings")
    values = {"tokenizer_type": model, "tokens": tokens}
    types = _array(file, "tokenizer.ggml.token_type")
    if types is not None:
        if len(types) != len(tokens) or any(not isinstance(t, int) or t not in TOKEN_TYPES for t in types):
            raise GGUFError(f"{path}: tokenizer.ggml.token_type does not give one type in 0-6 per token")
        bad = next((i for i, (t, kind) in enumerate(zip(tokens, types))
                    if kind == _BYTE_TYPE and not BYTE_TOKEN.fullmatch(t)), None)
        if bad is not None:
            raise GGUFError(f"{path}: token {bad} ({tokens[bad][:40]!r}) is typed a byte token but is not <0xHH>")
        values["token_type"] = types
    scores = _array(file, "tokenizer.ggml.scores")
    if scores is not None:
        if len(scores) != len(tokens) or not all(isinstance(s, float) for s in scores):
            raise GGUFError(f"{path}: tokenizer.ggml.scores does not give one float per token")
        values["scores"] = scores
    merges = _array(file, "tokenizer.ggml.merges")
    if merges is not None:
        bad = next((i for i, m in enumerate(merges)
                    if not isinstance(m, str) or m.count(" ") != 1 or m.startswith(" ") or m.endswith(" ")), None)
        if bad is not None:
            raise GGUFError(f"{path}: merge {bad} ({str(merges[bad])[:40]!r}) is not two tokens and a space")
        values["merges"] = merges
    elif model == "gpt2":
        raise GGUFError(f"{path}: a byte-level BPE vocabulary without tokenizer.ggml.merges")
    pre = file.get("tokenizer.ggml.pre", str)
    if pre is not None:
        values["pre_tokenizer_type"] = pre
    config = {name: file.get(key, bool if name != "chat_template" else str) for name, key in _CONFIG_KEYS.items()
              if key in file.metadata}
    if model == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocabulary by default
    for name, key in _SPECIAL_TOKENS.items():
        token_id = file.get(f"tokenizer.ggml.{key}", int)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise GGUFError(f"{path}: tokenizer.ggml.{key} {token_id} is outside the vocabulary of {len(tokens)}")
        values[name + "_id"] = token_id
        config[name] = tokens[token_id] if token_id is not None else None
    return values, config


def convert(file: GGUFFile):
    """The file's tokenizer (a transformers ``TokenizersBackend``), converted from its metadata now.

    Raises:
        GGUFError: as ``tokenizer_values``, or transformers' conversion refuses the vocabulary.
    """
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import convert_gguf_tokenizer

    values, config = tokenizer_values(file)
    try:
        backend, _ = convert_gguf_tokenizer(file.architecture, values)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own types; any is the file's fault
        raise GGUFError(f"{file.path}: its tokenizer does not convert: {type(exc).__name__}: {exc}") from None
    return TokenizersBackend(tokenizer_object=backend, **config)


def cached_tokenizer(file: GGUFFile, config):
    """The file's tokenizer, from ``derived_dir(file)``; on the first start converted (``convert``) and saved
    there with ``config`` (config.json), so clients that tokenize locally can load the directory. Where the
    cache cannot be written, converted in memory at every start (and the log says why).

    Returns:
        ``(tokenizer, directory or None)``.

    Raises:
        GGUFError: as ``convert``.
    """
    # the class ``convert`` builds, by name: AutoTokenizer would read config.json and import transformers' config
    # class of the family, and with it its weight-loading code (about 65 MiB resident; engine.architectures)
    from transformers import TokenizersBackend

    target = derived_dir(file)
    if (target / "tokenizer.json").exists() and (target / "config.json").exists():
        return TokenizersBackend.from_pretrained(target), target
    tokenizer = convert(file)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        tokenizer.save_pretrained(partial)
        config.save_pretrained(partial)
        try:
            os.rename(partial, target)  # whole or absent: a start killed while writing leaves no half directory
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)  # another start got there first
            if not (target / "tokenizer.json").exists():
                raise
    except OSError as exc:
        log.warning("cannot cache the tokenizer of %s in %s (%s): converted again at each start", file.path.name,
                    target.parent, exc.strerror or exc)
        return tokenizer, None
    log.info("tokenizer of %s converted once into %s", file.path.name, target)
    del tokenizer
    give_back()  # the conversion's transients (tens of MiB for a 128k vocabulary): not kept past the first start
    return TokenizersBackend.from_pretrained(target), target
