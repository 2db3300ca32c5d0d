"""Rough edges unmodified clients hit: /tokenize against generation, pooling endpoints on a generative model,
finding the tokenizer, and a start log that says why each path was chosen."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.test_structured import WEATHER

HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
]


@pytest.mark.parametrize("extra", [
    {},
    {"tools": [WEATHER]},
    {"tools": [WEATHER], "tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": "none"},
])
@pytest.mark.parametrize("messages", [[{"role": "user", "content": "Hi"}], HISTORY], ids=["one turn", "tool turns"])
def test_tokenize_counts_what_generation_uses(server_url, messages, extra):
    counted = httpx.post(server_url + "/tokenize", json={"messages": messages} | extra, timeout=60).json()
    reply = httpx.post(server_url + "/v1/chat/completions", timeout=300,
                       json={"messages": messages, "max_tokens": 1, "temperature": 0} | extra)
    assert reply.status_code == 200, reply.text
    assert counted["count"] == reply.json()["usage"]["prompt_tokens"] == len(counted["tokens"])


def test_tokenize_with_tools_counts_the_tool_prompt_and_honours_add_generation_prompt(server_url):
    plain = httpx.post(server_url + "/tokenize", json={"messages": HISTORY[:1]}).json()["count"]
    with_tools = httpx.post(server_url + "/tokenize", json={"messages": HISTORY[:1], "tools": [WEATHER]}).json()
    assert with_tools["count"] > plain + 50  # the functions' schemas are in the prompt
    without_header = httpx.post(server_url + "/tokenize", json={"messages": HISTORY[:1], "tools": [WEATHER],
                                                                 "add_generation_prompt": False}).json()
    assert without_header["tokens"] == with_tools["tokens"][:len(without_header["tokens"])]
    assert 0 < with_tools["count"] - without_header["count"] <= 4  # "<|im_start|>assistant\n"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank", "/pooling"])
def test_pooling_endpoints_say_why_they_are_not_served(server_url, path):
    response = httpx.post(server_url + path, json={"model": "SmolLM2-135M-Instruct", "input": "hello"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert path in error["message"] and "generative model" in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_supported"


def test_model_path_command_prints_the_tokenizer_directory(smollm2, capsys):
    from pathlib import Path

    from kvserve.server.cli import main

    assert main(["model-path"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert (printed / "tokenizer.json").exists() and (printed / "config.json").exists()
    assert printed == Path(smollm2.tokenizer.name_or_path)


def test_start_log_names_the_tokenizer(smollm2, caplog, monkeypatch):
    from kvserve.server import serve
    from kvserve.server.config import ServeConfig

    monkeypatch.setattr("kvserve.engine.loader.load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr("kvserve.server.state.ServerState", lambda *a, **k: None)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        serve.build_state(ServeConfig(kv_cache_memory="16MiB", quantization="none", speculative="off"))
    assert f"tokenizer: {smollm2.tokenizer.name_or_path}" in caplog.text and "kvserve model-path" in caplog.text
    assert "--dtype auto: float32 weights" in caplog.text and "--dtype bfloat16 runs" in caplog.text  # says how to change it


def test_start_log_says_what_a_request_meets(smollm2, caplog):
    """The context a request may use, the stop tokens and whether the reasoning parser is on, in one line."""
    from kvserve.server.config import ServeConfig
    from kvserve.server.state import ServerState

    with caplog.at_level(logging.INFO, logger="kvserve"):
        state = ServerState(smollm2, ServeConfig(num_kv_blocks=8, block_size=16))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("requests: "))
    # the pool (128 tokens) is smaller than the context: the line names both, and which /v1/models reports
    assert state.max_request_tokens == 128 < state.max_model_len
    assert (f"at most 128 tokens each (prompt + completion; the KV pool's 128 tokens, under a context of "
            f"{state.max_model_len}; /v1/models' max_model_len)") in line, line
    assert "<|im_end|> (2)" in line and "reasoning parser off (--reasoning-parser auto)" in line, line
    assert "chat template default" in line, line


def test_start_log_says_why_each_forward_path_was_chosen(smollm2, caplog, monkeypatch):
    """The lean forward and its kernels: on, off by a flag, off by the weights' dtype, off by the build; each
    line says why and what changes it."""
    import copy

    from kvserve import native
    from kvserve.engine.fastpath import fast_decoder, kernels_off_reason

    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        monkeypatch.setenv("KVSERVE_FASTPATH", "0")
        assert fast_decoder(smollm2.model) is None
        monkeypatch.delenv("KVSERVE_FASTPATH")
    assert "KVSERVE_FASTPATH=0 turns the lean forward off" in caplog.text
    monkeypatch.setattr(native, "load", lambda build=True: object())  # built: the dtype is the reason
    half = copy.deepcopy(smollm2.model).bfloat16()
    assert "the weights are bfloat16" in kernels_off_reason(half) and "--dtype float32" in kernels_off_reason(half)
    monkeypatch.setattr(native, "load", lambda build=True: None)
    monkeypatch.setenv("KVSERVE_NATIVE_KERNELS", "0")
    assert "KVSERVE_NATIVE_KERNELS=0 turns them off" in kernels_off_reason(smollm2.model)
    monkeypatch.setenv("KVSERVE_NATIVE_KERNELS", "1")
    assert "could not be built" in kernels_off_reason(smollm2.model)
    # a GGUF model's table is blocks (no .weight): a failed build is said, not an AttributeError at start
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvserve.quant.ggml import GGMLEmbedding, GGMLKind
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    tiny.set_input_embeddings(GGMLEmbedding(torch.zeros(8, 34, dtype=torch.uint8), GGMLKind.Q8_0))
    assert "could not be built" in kernels_off_reason(tiny)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        fast_decoder(smollm2.model)
    assert "the C++ kernels are off because they could not be built" in caplog.text
