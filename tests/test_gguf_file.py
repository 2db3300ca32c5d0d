"""A GGUF file is untrusted input: malformed files end in one clear GGUFError, never a crash, a hang or an
allocation the file's size does not bound; a property test over mutated real files; the cases that once failed
kept as files (tests/data/gguf_fuzz); and the GGUF path never unpickles."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.architectures import config_from_gguf, for_gguf
from kvserve.engine.gguf_file import GGUFError, read_gguf
from kvserve.engine.gguf_model import check_tensors, floats
from kvserve.engine.gguf_tokenizer import tokenizer_values

REGRESSIONS = Path(__file__).parent / "data" / "gguf_fuzz"
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q",
            F64: "d"}
TYPE_F32, TYPE_Q8_0 = 0, 8


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(value_type: int, value) -> bytes:
    if value_type == STRING:
        return _string(value)
    if value_type == ARRAY:
        element_type, items = value
        return struct.pack("<IQ", element_type, len(items)) + b"".join(_value(element_type, v) for v in items)
    return struct.pack("<" + _FORMATS[value_type], value)


def gguf_bytes(kvs: list[tuple], tensors: list[tuple] = (), data: bytes = b"", version: int = 3,
               alignment: int = 32) -> bytes:
    """A GGUF file written by hand, so that it can be wrong in any way: ``kvs`` as ``(key, type, value)`` (an
    array's value is ``(element type, items)``), ``tensors`` as ``(name, dims, type id, offset)``."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, value_type, value in kvs:
        out += _string(key) + struct.pack("<I", value_type) + _value(value_type, value)
    for name, dims, type_id, offset in tensors:
        out += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", type_id, offset)
    if tensors or data:
        out += b"\0" * (-len(out) % alignment)
    return out + data


def read_bytes(tmp_path, raw: bytes):
    path = tmp_path / "case.gguf"
    path.write_bytes(raw)
    return read_gguf(path)


NAME = [("general.architecture", STRING, "llama")]
VECTOR = [("v.weight", (8,), TYPE_F32, 0)]
VECTOR_DATA = struct.pack("<8f", *range(8))


def test_a_well_formed_file_reads_back(tmp_path):
    file = read_bytes(tmp_path, gguf_bytes(NAME + [("a", ARRAY, (U32, [1, 2, 3]))], VECTOR, VECTOR_DATA))
    assert file.architecture == "llama" and file.metadata["a"].values() == [1, 2, 3]
    assert floats(file.tensors["v.weight"]).tolist() == list(range(8))


@pytest.mark.parametrize("raw,message", [
    (b"GGUF\3\0\0\0", "shorter than a GGUF header"),
    (b"GGML" + bytes(40), "not a GGUF file"),
    (gguf_bytes(NAME, version=1), "GGUF version 1"),
    (gguf_bytes(NAME, version=3 << 24), "GGUF version 50331648"),  # a big-endian file
    (gguf_bytes(NAME + [("x", STRING, "abc")])[:-2], "truncated: the value of x needs 3 bytes, 1 remain"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60), "metadata entries claimed"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 0) + bytes(64), "tensors claimed"),
    (gguf_bytes([("a", ARRAY, (U32, []))])[:-8] + struct.pack("<Q", 1 << 40) + bytes(16),
     "claims 1099511627776 elements"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 50) + bytes(16), "a metadata key needs"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("a") + struct.pack("<I", 13) + bytes(8),
     "has value type 13"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("a") + struct.pack("<I", 0xFFFFFFFF) + bytes(8),
     "has value type 4294967295"),
    (gguf_bytes([("a", ARRAY, (ARRAY, []))]), "array of arrays"),
    (gguf_bytes([("a", ARRAY, (0xFFFFFFFF, []))]), "element type 4294967295"),
    (gguf_bytes(NAME + [("general.architecture", STRING, "qwen2")]), "general.architecture appears twice"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string(b"\xff\xfe") + struct.pack("<IB", U8, 1),
     "a metadata key is not UTF-8"),
    (gguf_bytes(NAME + [("general.alignment", U32, 24)]), "general.alignment 24 is not a power of two"),
    (gguf_bytes(NAME, [("w", (1 << 32, 1 << 32, 1 << 32), TYPE_F32, 0)]), "overflow"),
    (gguf_bytes(NAME, [("w", (8, 0), TYPE_F32, 0)]), "has a dimension of 0"),
    (gguf_bytes(NAME, [("w", (1, 1, 1, 1, 1), TYPE_F32, 0)]), "5 dimensions"),
    (gguf_bytes(NAME, [("w", (8,), 99, 0)]), "tensor type 99"),
    (gguf_bytes(NAME, [("w", (33,), TYPE_Q8_0, 0)], bytes(64)), "not whole Q8_0 blocks of 32"),
    (gguf_bytes(NAME, [("w", (8,), TYPE_F32, 4)], bytes(64)), "offset 4 is not a multiple of the alignment 32"),
    (gguf_bytes(NAME, VECTOR, VECTOR_DATA[:-1]), "runs past the end of the file"),
    (gguf_bytes(NAME, [("w", (8,), TYPE_F32, 1 << 40)], VECTOR_DATA), "runs past the end of the file"),
    (gguf_bytes(NAME, VECTOR + VECTOR, VECTOR_DATA), "tensor v.weight appears twice"),
    (gguf_bytes(NAME, [("a", (16,), TYPE_F32, 0), ("b", (8,), TYPE_F32, 32)], bytes(64)), "b at byte .* overlaps a"),
    (gguf_bytes(NAME, [("x" * 64, (8,), TYPE_F32, 0)], VECTOR_DATA), "longer than 63 bytes"),
], ids=lambda case: case if isinstance(case, str) else None)
def test_malformed_files_are_refused_with_what_is_wrong(tmp_path, raw, message):
    with pytest.raises(GGUFError, match=message):
        read_bytes(tmp_path, raw)


TOKENIZER = [("tokenizer.ggml.model", STRING, "gpt2"),
             ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "b", "ab", "<0x0A>"])),
             ("tokenizer.ggml.merges", ARRAY, (STRING, ["a b"]))]


def _with(kvs: list[tuple], key: str, value_type: int, value) -> list[tuple]:
    return [kv for kv in kvs if kv[0] != key] + [(key, value_type, value)]


@pytest.mark.parametrize("change,message", [
    (("tokenizer.ggml.token_type", ARRAY, (I32, [1, 1, 1, 6])), None),
    (("tokenizer.ggml.token_type", ARRAY, (I32, [1, 1, 6, 1])), r"token 2 \('ab'\) is typed a byte token"),
    (("tokenizer.ggml.token_type", ARRAY, (I32, [1, 1, 1])), "one type in 0-6 per token"),
    (("tokenizer.ggml.token_type", ARRAY, (I32, [1, 1, 1, 9])), "one type in 0-6 per token"),
    (("tokenizer.ggml.scores", ARRAY, (F32, [0.0])), "one float per token"),
    (("tokenizer.ggml.merges", ARRAY, (STRING, ["ab"])), r"merge 0 \('ab'\) is not two tokens and a space"),
    (("tokenizer.ggml.eos_token_id", U32, 4), "eos_token_id 4 is outside the vocabulary of 4"),
    (("tokenizer.ggml.model", STRING, "bert"), "tokenizer.ggml.model 'bert' is not one kvserve converts"),
    (("tokenizer.ggml.tokens", STRING, "abc"), "tokenizer.ggml.tokens is not an array"),
    (("tokenizer.ggml.model", U32, 1), "tokenizer.ggml.model is a int, expected str"),
])
def test_token_tables_are_checked_before_conversion(tmp_path, change, message):
    file = read_bytes(tmp_path, gguf_bytes(NAME + _with(TOKENIZER, *change)))
    if message is None:
        assert tokenizer_values(file)[0]["token_type"] == [1, 1, 1, 6]
        return
    with pytest.raises(GGUFError, match=message):
        tokenizer_values(file)


LLAMA = NAME + TOKENIZER + [("llama.block_count", U32, 1), ("llama.embedding_length", U32, 32),
                            ("llama.feed_forward_length", U32, 64), ("llama.attention.head_count", U32, 2)]


def test_a_vocabulary_that_does_not_match_the_embedding_is_refused(tmp_path):
    raw = gguf_bytes(LLAMA, [("token_embd.weight", (32, 5), TYPE_F32, 0)], bytes(32 * 5 * 4))
    file = read_bytes(tmp_path, raw)
    arch = for_gguf(file)
    with pytest.raises(GGUFError, match="the vocabulary has 4 tokens, the embedding 5 rows"):
        check_tensors(file, arch, config_from_gguf(file, arch))


@pytest.mark.parametrize("change,message", [
    (("llama.attention.head_count", U32, 0), "head_count = 0 is out of range"),
    (("llama.attention.head_count", U32, 3), "embedding_length / head_count|key_length is missing"),
    (("llama.attention.head_count_kv", U32, 3), "2 query heads do not share 3"),
    (("llama.embedding_length", STRING, "32"), "embedding_length is a str, expected int"),
    (("llama.rope.freq_base", F32, float("nan")), "RoPE base nan"),
    (("llama.rope.scaling.type", STRING, "longrope"), "RoPE scaling 'longrope' is not served"),
    (("llama.block_count", U64, 1 << 40), "block_count = 1099511627776 is out of range"),
    (("llama.block_count", U32, (1 << 31) - 1), "block_count 2147483647 is more than the file's 0 tensors"),
])
def test_config_values_are_checked(tmp_path, change, message):
    file = read_bytes(tmp_path, gguf_bytes(_with(LLAMA, *change)))
    with pytest.raises(GGUFError, match=message):
        config_from_gguf(file, for_gguf(file))


# ---- the property: any mutation of a real file reads, or is refused with a GGUFError --------------------------

@pytest.fixture(scope="module")
def seed_file(tmp_path_factory) -> tuple[bytes, list[int]]:
    """A complete model file of ``loadtest randgguf`` (a one-layer Llama, 300 tokens; K-quant rows fall back),
    small enough to mutate thousands of times, and its fields' starts."""
    from kvserve.loadtest.fixtures.randgguf import Shape, write

    shape = Shape("llama", "fuzz", 1, 32, 2, 1, 64, 300, 16, 64, 10000.0, 1e-5, llama3_rope=(8.0, 1.0, 4.0, 32))
    path = write(shape, "Q4_K_M", tmp_path_factory.mktemp("fuzz") / "seed.gguf")
    return path.read_bytes(), field_starts(path.read_bytes(), path)


def pipeline(path: Path) -> None:
    """Everything a start runs on the file before allocating a model: the reader, the family, the config, the
    tensor checks, the token table's checks, and each tensor's values."""
    file = read_gguf(path)
    arch = for_gguf(file)
    config = config_from_gguf(file, arch)
    check_tensors(file, arch, config)
    tokenizer_values(file)
    for tensor in file.tensors.values():
        floats(tensor)


INTERESTING = (0, 1, 2, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
               1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


def field_starts(raw: bytes, path: Path) -> list[int]:
    """Where each metadata key and each tensor name of the file ``raw`` (at ``path``) begins, length first: the
    reader's decisions follow each of these (a value type, a count, dimensions, a tensor type, an offset)."""
    file = read_gguf(path)
    return sorted({raw.find(name.encode()) - 8 for name in (*file.metadata, *file.tensors)})


@st.composite
def mutations(draw, size: int, fields: list[int]):
    """1-3 edits: a byte, a 4- or 8-byte integer set to a value that matters to a reader, a cut, an inserted or a
    deleted run of bytes; at or just after a field's start, in the header (the first 8 KiB), or anywhere."""
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        near_field = st.builds(lambda start, delta: min(start + delta, size - 1), st.sampled_from(fields),
                               st.integers(0, 96))
        where = draw(st.one_of(near_field, st.integers(0, min(size, 8192) - 1), st.integers(0, size - 1)))
        kind = draw(st.sampled_from(("byte", "u32", "u64", "cut", "insert", "delete")))
        value = draw(st.sampled_from(INTERESTING) if kind in ("u32", "u64") else st.integers(0, 255))
        edits.append((kind, where, value, draw(st.integers(1, 64))))
    return edits


def mutate(raw: bytes, edits) -> bytes:
    data = bytearray(raw)
    for kind, where, value, length in edits:
        where = min(where, len(data))
        if kind == "byte" and where < len(data):
            data[where] = value
        elif kind in ("u32", "u64"):
            width = 4 if kind == "u32" else 8
            data[where:where + width] = (value % (1 << 8 * width)).to_bytes(width, "little")
        elif kind == "cut":
            del data[where:]
        elif kind == "insert":
            data[where:where] = bytes([value]) * length
        else:
            del data[where:where + length]
    return bytes(data)


@settings(max_examples=2000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mutation_of_a_real_file_reads_or_is_refused_cleanly(tmp_path, seed_file, data):
    seed, fields = seed_file
    raw = mutate(seed, data.draw(mutations(len(seed), fields)))
    path = tmp_path / "mutated.gguf"
    path.write_bytes(raw)
    try:
        pipeline(path)
    except GGUFError:
        pass
    except Exception as exc:  # keep the case, as the regression files below are kept
        failed = tmp_path.parent / f"failed-{abs(hash(raw)) % 10**8}.gguf"
        failed.write_bytes(raw)
        raise AssertionError(f"{type(exc).__name__}: {exc} (the file: {failed})") from exc


@pytest.mark.parametrize("path", sorted(REGRESSIONS.glob("*.gguf")), ids=lambda p: p.name)
def test_files_that_once_failed_are_refused_cleanly(path):
    with pytest.raises(GGUFError):
        pipeline(path)


def test_the_gguf_path_never_unpickles(tiny_gguf, monkeypatch):
    import numpy as np
    import torch

    from kvserve.engine.gguf_model import load_gguf

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling on the GGUF path")
    for owner, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                        (np, "load")):
        monkeypatch.setattr(owner, name, refuse)
    built = load_gguf(tiny_gguf("tiny-qwen3", "Q8_0"), blocks=True)
    assert built.model is not None and built.tokenizer("hello")["input_ids"]
