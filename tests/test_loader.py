"""A checkpoint that does not match its config, or that is pickled, stops the start with one line.

Tiny random Llama checkpoints are written to a temporary directory with transformers' own config class.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.engine.loader import Device, DType, load_model
from tests.serverutil import free_port


def tiny_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def load(path, **kw):
    return load_model(str(path), DType.FLOAT32, Device.CPU, **kw)


def test_weights_that_do_not_match_the_config_stop_the_start(tmp_path):
    config = tiny_config(tied=False)
    state = LlamaForCausalLM(config).state_dict()
    del state["lm_head.weight"], state["model.norm.weight"]
    state["model.extra_proj.weight"] = torch.zeros(2, 2)
    config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as refused:
        load(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert "2 missing (lm_head.weight, model.norm.weight)" in message
    assert "1 unexpected (model.extra_proj.weight)" in message


def test_an_empty_pickled_checkpoint_is_refused_twice(tmp_path):
    # the issue's case: SmolLM2's config and an empty torch.save({}) served "ContactContactContact..."
    tiny_config(tied=True).save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as pickled:
        load(tmp_path)
    assert "pickled" in str(pickled.value) and "--allow-pickle" in str(pickled.value)
    with pytest.raises(ValueError) as empty:
        load(tmp_path, allow_pickle=True)
    assert "missing (" in str(empty.value) and "\n" not in str(empty.value)


@pytest.mark.parametrize("config, named", [
    ('{"model_type": "no-such-model"}', "model_type 'no-such-model' is not a causal language model"),
    ('{"architectures": ["LlamaForCausalLM"]}', "names no model_type"),
    ('{"model_type": ', "is not readable JSON"),
    ('["llama"]', "names no model_type"),
    ('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}', r"architectures \(BertForMaskedLM\) are not"),
    ('{"model_type": "llama", "architectures": ["LlamaModel"]}', r"architectures \(LlamaModel\) are not"),
])
def test_a_directory_kvserve_cannot_serve_is_refused_before_the_kernels_build(tmp_path, monkeypatch, config, named):
    # the first start's kernel build takes minutes; a directory it would refuse anyway must not wait for it
    from kvserve import native

    (tmp_path / "config.json").write_text(config)
    save_file({"w": torch.zeros(1)}, tmp_path / "model.safetensors")
    monkeypatch.setattr(native, "load", lambda: pytest.fail("the kernels were built before the refusal"))
    with pytest.raises(ValueError, match=named):
        load(tmp_path)


def test_a_directory_without_weights_is_refused_before_the_kernels_build(tmp_path, monkeypatch):
    from kvserve import native

    tiny_config(tied=True).save_pretrained(tmp_path)
    monkeypatch.setattr(native, "load", lambda: pytest.fail("the kernels were built before the refusal"))
    with pytest.raises(ValueError, match="holds no weights"):
        load(tmp_path)


def test_pickled_weights_are_refused_before_the_kernels_build(tmp_path, monkeypatch):
    from kvserve import native

    tiny_config(tied=True).save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(native, "load", lambda: pytest.fail("the kernels were built before the refusal"))
    with pytest.raises(ValueError, match="--allow-pickle"):
        load(tmp_path)


def test_tied_weights_are_not_missing(tmp_path, smollm2):
    model = LlamaForCausalLM(tiny_config(tied=True))
    model.save_pretrained(tmp_path)  # no lm_head.weight in the file: it is the embedding
    smollm2.tokenizer.save_pretrained(tmp_path)
    loaded = load(tmp_path)
    assert torch.equal(loaded.model.lm_head.weight, model.model.embed_tokens.weight)


class _Payload:
    def __reduce__(self):
        return (print, ("this pickle runs code",))


def test_a_refused_pickle_ends_the_start_in_one_line_not_a_traceback(tmp_path):
    tiny_config(tied=True).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"model.norm.weight": _Payload()}))
    result = subprocess.run([sys.executable, "-m", "kvserve.server.cli", "serve", "--model", str(tmp_path), "--port",
                             str(free_port()), "--allow-pickle", "--device", "cpu"], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "this pickle runs code" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot start: cannot load the weights in" in errors[0]


# Run in a fresh process: in this one, earlier tests' freed chunks would serve the allocations below from the heap.
# resident memory and glibc's malloc/free, for the probes below
_PROBE_PRELUDE = """
import ctypes, ctypes.util

def resident_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
"""
_HEAP_PROBE = _PROBE_PRELUDE + """
from kvserve.engine.heap import loading_heap

def touched(size, count):
    chunks = [libc.malloc(size) for _ in range(count)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, size)
    return chunks

def freed_kib(chunks):  # all but the last: it pins the heap's top, so only a trim gives the rest back
    before = resident_kib()
    for chunk in chunks[:-1]:
        libc.free(chunk)
    return before - resident_kib()

libc.free(libc.malloc(16 << 20))  # as a load's first big frees do: glibc's own threshold rises to 16 MiB
with loading_heap() as managed:
    copies = freed_kib(touched(512 << 10, 256))  # a layer's blocks, copied and dropped while loading
    small = touched(100 << 10, 320)  # under any threshold: heap chunks, whose frees leave resident holes
    freed_kib(small)
    held = resident_kib()
trimmed = held - resident_kib()
serving = freed_kib(touched(512 << 10, 256))
print(managed, copies, trimmed, serving)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, malloc_trim and /proc: Linux")
def test_loading_heap_gives_freed_copies_back_at_once_and_the_heap_s_holes_on_leaving():
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], capture_output=True, text=True, timeout=60, check=True)
    managed, copies, trimmed, serving = out.stdout.split()
    assert managed == "True"
    assert int(copies) > 120 << 10  # of 127.5 MiB of 512 KiB copies, freed inside: each was its own mapping
    assert int(trimmed) > 25 << 10  # leaving trims: most of the 31 MiB of holes went back
    assert int(serving) < 20 << 10  # after it, 512 KiB chunks come from the heap again, as glibc's own threshold


_GIVE_BACK_PROBE = _PROBE_PRELUDE + """
from kvserve.engine.heap import give_back
chunks = [libc.malloc(100 << 10) for _ in range(320)]  # under the threshold: heap chunks
for chunk in chunks:
    ctypes.memset(chunk, 1, 100 << 10)
for chunk in chunks[:-1]:  # the last pins the heap's top: the rest are holes only a trim gives back
    libc.free(chunk)
held = resident_kib()
print(give_back(), held - resident_kib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc: Linux")
def test_give_back_returns_the_heaps_free_pages_after_a_one_time_build():
    # what a one-time build (llguidance's tokenizer, a GGUF tokenizer's conversion) frees stays resident as holes
    # in the heap until give_back trims it
    out = subprocess.run([sys.executable, "-c", _GIVE_BACK_PROBE], capture_output=True, text=True, timeout=60,
                         check=True)
    managed, trimmed = out.stdout.split()
    assert managed == "True" and int(trimmed) > 25 << 10  # most of the 31 MiB of holes went back
