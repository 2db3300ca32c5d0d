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
