"""What a hostile or unusual HTTP client found (the generated attack and the hand-written kinds): stalled bodies,
Host and authority tricks, methods, compressed bodies, OpenAI shapes kvserve refused, token ids beyond the
vocabulary, and what an API key does and does not cover (/metrics, the live page)."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import time

import httpx
import pytest

from kvserve.server.config import ServeConfig
from tests.serverutil import running_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def raw(url: str, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` as is on a new connection; everything the server answers until it closes (or ``timeout``)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


# -- bodies: stalled, compressed -------------------------------------------------------------------------------

def test_stalled_bodies_are_closed_and_the_server_serves_on(smollm2):
    with running_server(smollm2, ServeConfig(num_kv_blocks=8, body_timeout_s=1.0)) as url:
        host, port = url.removeprefix("http://").split(":")
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: 100\r\n\r\n{{\"prompt\": ").encode()
        stalled = []
        for _ in range(40):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(head)  # headers and part of the body, then nothing
            stalled.append(sock)
        try:
            assert httpx.get(url + "/health", timeout=5).status_code == 200  # served while they stall
            for sock in stalled:
                answer = b""
                while chunk := sock.recv(65536):  # the server answers, then closes: recv returns b"" at the end
                    answer += chunk
                assert status_of(answer) == 408 and b"request_timeout" in answer, answer[:200]
            ok = httpx.post(url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
            assert ok.status_code == 200
        finally:
            for sock in stalled:
                sock.close()


def test_a_client_that_hangs_up_mid_body_is_logged_as_gone_not_as_a_server_error(server_url, caplog):
    """Half a body, then the connection closed: FastAPI's body read fails, and the error handler's reread meets
    the disconnect. That is a 499 in the request log (nginx's "client closed request"), never an ERROR and a 500
    (a 5xx alert for a client's hang-up), and the server serves on."""
    host, port = server_url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO, logger="kvserve.requests"):
        for path in (CHAT, COMPLETIONS):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             "Content-Length: 100\r\n\r\n{\"mess".encode())
                time.sleep(0.3)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(f"POST {p} 499" in caplog.text for p in (CHAT, COMPLETIONS)) < 2:
            time.sleep(0.05)
    assert f"POST {CHAT} 499" in caplog.text and f"POST {COMPLETIONS} 499" in caplog.text, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert " 500 " not in caplog.text
    assert httpx.post(server_url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}, timeout=30).status_code == 200


def _gzip_post(url: str, payload: bytes, encoding: str = "gzip") -> httpx.Response:
    return httpx.post(url + COMPLETIONS, content=payload, timeout=60,
                      headers={"content-type": "application/json", "content-encoding": encoding})


def test_a_gzip_body_is_decoded_within_the_limit(server_url):
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    assert _gzip_post(server_url, gzip.compress(body)).status_code == 200
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (64 << 20) + b'"}')  # 64 MiB in ~64 KiB
    refused = _gzip_post(server_url, bomb)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    broken = _gzip_post(server_url, b"not gzip at all")
    assert broken.status_code == 400 and "gzip" in broken.json()["error"]["message"]
    other = _gzip_post(server_url, body, encoding="br")
    assert other.status_code == 415 and "gzip" in other.json()["error"]["message"]


# -- Host and authority ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("host,status", [
    ("127.0.0.1:{port}@evil.example", 400),  # userinfo: a browser never sends it, a parser may read either side
    ("evil.example@127.0.0.1", 400),
    ("localhost.", 400),                       # a trailing dot: another name to a resolver
    ("127.0.0.1:{port} evil", 400),
    ("localhost:{port}", 200),
])
def test_host_is_parsed_strictly(server_url, host, status):
    port = server_url.rsplit(":", 1)[1]
    response = httpx.get(server_url + "/health", headers={"host": host.format(port=port)})
    assert response.status_code == status, response.text


def test_duplicate_hosts_and_absolute_targets_are_checked(server_url):
    twice = raw(server_url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"
                            b"Connection: close\r\n\r\n")
    assert status_of(twice) == 400 and b"Host headers" in twice
    elsewhere = raw(server_url, b"GET http://evil.example/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                b"Connection: close\r\n\r\n")
    assert status_of(elsewhere) == 421 and b"request target" in elsewhere
    here = raw(server_url, b"GET http://127.0.0.1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert status_of(here) == 200


# -- methods, CORS -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path,allow", [
    ("OPTIONS", "/health", "GET, HEAD"), ("DELETE", "/health", "GET, HEAD"),
    ("OPTIONS", CHAT, "POST"), ("PUT", "/v1/models/x", "GET, HEAD"),
])
def test_a_method_not_served_is_a_405_listing_every_allowed_method(server_url, method, path, allow):
    response = httpx.request(method, server_url + path)
    assert response.status_code == 405 and response.headers["allow"] == allow
    assert allow in response.json()["error"]["message"]


def test_cors_preflight_with_allowed_origins(smollm2):
    with running_server(smollm2, ServeConfig(num_kv_blocks=8, api_key="k",
                                             allowed_origins=("https://app.example",))) as url:
        preflight = httpx.options(url + CHAT, headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type, x-stainless-os"})
        assert preflight.status_code == 200  # answered without a key: a browser sends none on a preflight
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        call = httpx.post(url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1},
                          headers={"origin": "https://app.example", "authorization": "Bearer k"}, timeout=60)
        assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(url + CHAT, headers={"origin": "https://evil.example",
                                                   "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in other.headers


# -- OpenAI shapes, token ids ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": "Again"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c", "content": None}]}),
    (COMPLETIONS, {"prompt": ""}),
])
def test_shapes_openai_allows_are_served(server_url, path, body):
    response = httpx.post(server_url + path, json=body | {"max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text


def test_token_ids_beyond_the_vocabulary_are_refused_by_field_and_the_schema_says_so(server_url):
    for path, body, param in (("/detokenize", {"tokens": [1, 49152]}, "tokens"),
                              (COMPLETIONS, {"prompt": [1, 2**40], "max_tokens": 1}, "prompt"),
                              (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [-1], "max_tokens": 1},
                               "stop_token_ids")):
        response = httpx.post(server_url + path, json=body, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param and "[0, 49151]" in error["message"]
    schemas = httpx.get(server_url + "/openapi.json").json()["components"]["schemas"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {"type": "integer", "minimum": 0,
                                                                             "maximum": 49151}
    bias = next(o for o in schemas["CompletionRequest"]["properties"]["logit_bias"]["anyOf"] if o["type"] == "object")
    assert bias["propertyNames"] == {"pattern": "^[0-9]{1,12}$"}


# -- what a key covers --------------------------------------------------------------------------------------------

def test_metrics_follow_the_keys_only_when_asked(smollm2):
    key = {"authorization": "Bearer k"}
    with running_server(smollm2, ServeConfig(num_kv_blocks=4, api_key="k")) as url:
        assert httpx.get(url + "/metrics").status_code == 200  # open by default, as vLLM's
    with running_server(smollm2, ServeConfig(num_kv_blocks=4, api_key="k", metrics_require_key=True)) as url:
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers=key).status_code == 200
        assert "401" in httpx.get(url + "/openapi.json").json()["paths"]["/metrics"]["get"]["responses"]


def _first_snapshot(url: str, key: str) -> dict:
    with httpx.stream("GET", url + "/ui/events", headers={"authorization": f"Bearer {key}"}, timeout=30) as events:
        for line in events.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])
    raise AssertionError("no snapshot")


def test_a_keys_live_page_lists_only_its_own_requests(smollm2):
    config = ServeConfig(num_kv_blocks=64, api_keys=("alice", "bob"), admin_keys=("root",))
    with running_server(smollm2, config) as url:
        body = {"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + COMPLETIONS, json=body, headers={"authorization": "Bearer alice"},
                          timeout=120) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)  # alice's request is running (it waits for this client to read on, so it stays running)
            deadline = time.monotonic() + 30
            while not _first_snapshot(url, "root")["slots"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(_first_snapshot(url, "root")["slots"]) == 1  # an admin key sees every request
            assert len(_first_snapshot(url, "alice")["slots"]) == 1
            bob = _first_snapshot(url, "bob")
            assert bob["slots"] == [] and bob["info"]["model"]  # the server's facts, not alice's request
