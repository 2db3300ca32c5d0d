"""The live page: ``GET /`` and ``/ui`` serve it, ``/ui/static/NAME`` its assets, ``/ui/events`` its data (SSE).

Every asset ships in the package (server/ui/, the charting library vendored in server/ui/vendor/), so the page
works on a machine with no network. The page's HTML, scripts and styles hold nothing secret and are served to
anyone the Host guard lets through; the event stream is behind ``--api-key`` like /v1 (the page asks for the
key and keeps it in the tab's sessionStorage), and a key's page lists only that key's requests among the slots
(an ``--admin-key`` sees all; the pool, steps and totals are the server's, counts only, as in /metrics). Each page response carries a strict Content-Security-Policy:
scripts, styles and connections from this origin only, no inline code, no framing.

The event stream sends the hub's snapshot (server/snapshot.py) whenever it has changed, polled at most
5 times a second; an idle server sends nothing but sse_starlette's keep-alive comments.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse

from kvserve.server.errors import ApiError
from kvserve.server.snapshot import SnapshotHub
from kvserve.server.state import ServerState

ASSETS = Path(__file__).resolve().parent / "ui"
POLL_S = 0.2  # the stream's polling period (s): at most 5 snapshots a second. Live to a person's eye, and half
              # the cost of 10 a second on the server's event loop and in the browser (docs/ui.md, BENCHMARKS.md)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}


def load_assets(root: Path = ASSETS) -> dict[str, tuple[bytes, str]]:
    """The page's files, read once: path relative to ``root`` (``vendor/uPlot.iife.min.js``) -> (bytes, type).

    Only these are ever served (no path from a request touches the file system)."""
    return {path.relative_to(root).as_posix(): (path.read_bytes(), _TYPES[path.suffix])
            for path in sorted(root.rglob("*")) if path.suffix in _TYPES}


def server_info(state: ServerState) -> dict:
    """Fixed facts the page shows beside the live data."""
    config = state.config
    return {"model": state.model_name, "num_blocks": state.pool.num_blocks, "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs, "max_queue": config.max_queue,
            "max_model_len": state.max_request_tokens, "prefix_caching": config.enable_prefix_caching,
            "speculative": config.speculative.value, "speculation_per_request": False,
            "auth": bool(config.api_keys)}


def page(body: bytes, media_type: str) -> Response:
    return Response(body, media_type=media_type, headers=PAGE_HEADERS)


def register(app: FastAPI, state: ServerState, auth: list[Depends]) -> None:
    """Add the page's routes to ``app``; ``auth``: the /v1 routes' API-key dependency.

    Raises:
        RuntimeError: the server state keeps no live view (it is built with ``ServeConfig.ui`` off).
    """
    if state.live is None:
        raise RuntimeError("the live page needs the server's live view (ServeConfig.ui)")
    assets = load_assets()
    hub = SnapshotHub(state.service, state.metrics, state.live, server_info(state), POLL_S)

    @app.get("/", include_in_schema=False)
    @app.get("/ui", include_in_schema=False)
    async def index():
        return page(*assets["index.html"])

    @app.get("/ui/static/{name:path}", include_in_schema=False)
    async def static(name: str):
        if name not in assets:
            raise ApiError(404, f"no such file: {name!r}", code="not_found")
        return page(*assets[name])

    @app.get("/ui/events", dependencies=auth, include_in_schema=False)
    async def events(request: Request):
        # a key's page lists its own requests only; an admin key's (and, without keys, every page) lists all
        owner = None if request.state.key_admin else request.state.key_owner
        return EventSourceResponse(_changes(hub, owner, state.request_owners), ping=state.config.sse_ping_s or None,
                                   sep="\n", headers={"Cache-Control": "no-store"})


async def _changes(hub: SnapshotHub, owner: str | None, owners: dict[int, str]):
    """Yield the hub's snapshot (as ``owner``'s page sees it) each time it differs from the last one sent (the
    first at once)."""
    last = None
    while True:
        data = hub.latest(owner, owners)
        if data != last:
            last = data
            yield {"data": data}
        await asyncio.sleep(POLL_S)

