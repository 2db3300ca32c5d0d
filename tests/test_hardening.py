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
