"""Run a real kvserve server in-process (uvicorn in a thread) on a free 127.0.0.1 port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from kvserve.engine.loader import LoadedModel
from kvserve.server.app import create_app
from kvserve.server.config import ServeConfig
from kvserve.server.httpserver import uvicorn_config
from kvserve.server.state import ServerState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(loaded: LoadedModel, config: ServeConfig | None = None, draft: LoadedModel | None = None):
    """Yield the base URL of a live server for ``loaded`` (and ``draft``, the draft model of ``--speculative
    draft``); the models' weights are shared, not copied.

    The server gets its own KV pool, scheduler and metrics; it stops when the block exits.
    """
    with serving(ServerState(loaded, config or ServeConfig(), draft=draft)) as url:
        yield url


@contextlib.contextmanager
def serving(state: ServerState):
    """Yield the base URL of a live server around an existing ServerState (tests that inspect its state)."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(create_app(state), "127.0.0.1", port, state.config.header_timeout_s,
                                           log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        raise RuntimeError("server did not become healthy within 30 s")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
