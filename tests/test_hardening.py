"""Faults that well-kept servers learned about in public: an error response without its request id, forged log
lines, validation that throws, numerics at the edges, constraints that silently fail, one request that beats
the queue, unbounded headers, and CPU work on the event loop."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi.testclient import TestClient

from kvserve.server.app import create_app
from kvserve.server.config import ServeConfig
from kvserve.server.state import ServerState


@pytest.fixture(scope="module")
def bare_state(smollm2):
    return ServerState(smollm2, ServeConfig(num_kv_blocks=8, block_size=16))


def test_an_unhandled_error_still_carries_its_request_id_and_is_logged_as_500(bare_state, caplog):
    app = create_app(bare_state)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    caplog.set_level(logging.INFO, logger="kvserve.requests")
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        response = client.get("/boom", headers={"x-request-id": "trace-42"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "trace-42"
    assert response.json()["error"]["code"] == "internal_error"
    assert "a bug" not in response.text  # the exception's text stays in the log, not in the reply
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.requests"]
    assert any(line.startswith("GET /boom 500 request_id=trace-42") for line in lines), lines


def test_the_request_log_escapes_the_path(bare_state, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.requests")
    with TestClient(create_app(bare_state), base_url="http://127.0.0.1") as client:
        client.get("/v1/x%0AGET%20/v1/models%20200%20request_id=forged%0D")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.requests"]
    assert lines and all("\n" not in line and "\r" not in line for line in lines)
    assert any(line.startswith("GET /v1/x\\nGET /v1/models 200 request_id=forged\\r 404") for line in lines), lines


def _post(url: str, path: str, body) -> httpx.Response:
    import json

    return httpx.post(url + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json"})


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize("path,body,named", [
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"²": 1}}, "logit_bias"),        # isdigit() yes, int() no
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # int() refuses 4,300+ digits
    (COMPLETIONS, {"prompt": "\ud800"}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "\ud800", "text": "x"}]}]}, "messages.0.content.0"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "guided_regex": "a\ud800"}, "guided_regex"),
    ("/v1/responses", {"input": "Hi", "metadata": {"k": "\ud800"}}, "metadata.k"),
    ("/v1/responses", {"input": "Hi", "text": {"format": "json"}}, "text.format"),
    ("/v1/responses", {"input": "Hi", "text": {"format": ["x"]}}, "text.format"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"a": _nested(100)}}, "tool_choice"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c", "type": "function",
                              "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "1"}]}, "arguments"),
])
def test_validation_refuses_instead_of_throwing(server_url, path, body, named):
    response = _post(server_url, path, body | {"max_tokens": 1} if path != "/v1/responses" else body)
    assert response.status_code == 400, response.text
    assert named in response.text, response.text


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1, "n": 1.0}),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2.0, "seed": 3.0}),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1.0, "top_logprobs": 0.0}),
])
def test_integral_floats_are_integers(server_url, path, body):
    assert _post(server_url, path, body).status_code == 200


def test_a_fractional_n_is_still_refused(server_url):
    response = _post(server_url, COMPLETIONS, {"prompt": "Hi", "n": 1.5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_one_request_cannot_outgrow_the_queue(smollm2):
    from tests.serverutil import running_server

    with running_server(smollm2, ServeConfig(num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64,
                                             max_queue=12, max_prompts_per_request=10)) as url:
        many = _post(url, COMPLETIONS, {"prompt": ["Hi"] * 11, "max_tokens": 1})
        assert many.status_code == 400 and "at most 10" in many.json()["error"]["message"]
        assert many.json()["error"]["param"] == "prompt"
        wide = _post(url, COMPLETIONS, {"prompt": ["Hi"] * 2, "n": 9, "max_tokens": 1})
        error = wide.json()["error"]
        assert wide.status_code == 400 and "18 sequences" in error["message"] and "at most 16" in error["message"]
        assert _post(url, COMPLETIONS, {"prompt": ["Hi"] * 2, "n": 8, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("size", [70_000, 1 << 20])
def test_oversized_headers_get_431_and_normal_ones_pass(server_url, size):
    big = httpx.get(server_url + "/health", headers={"x-junk": "a" * size}, timeout=30)
    assert big.status_code == 431 and big.json()["error"]["code"] == "request_header_fields_too_large"
    assert "x-request-id" in big.headers
    assert httpx.get(server_url + "/health", headers={"x-junk": "a" * 30_000}).status_code == 200


def test_a_large_body_is_not_counted_as_headers(server_url):
    prompt = "word " * 60_000  # ~300 KB of body arrives with the headers in the first reads
    response = httpx.post(server_url + "/tokenize", json={"prompt": prompt}, timeout=60)
    assert response.status_code == 200 and response.json()["count"] > 50_000


def test_long_prompts_are_tokenized_off_the_event_loop(bare_state, monkeypatch):
    import threading

    import kvserve.server.app as app_module

    threads: list[str] = []
    real = app_module.text_prompt_ids

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(app_module, "text_prompt_ids", recording)
    with TestClient(create_app(bare_state), base_url="http://127.0.0.1") as client:
        short = client.post("/tokenize", json={"prompt": "Hi"})
        long = client.post("/tokenize", json={"prompt": "word " * 10_000})
    assert short.status_code == long.status_code == 200 and long.json()["count"] >= 10_000
    loop_thread, worker = threads
    assert worker != loop_thread  # the long one ran on a worker thread, the loop kept serving
