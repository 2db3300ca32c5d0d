"""uvicorn, configured the one way both ``kvserve serve`` and the tests run it: C event loop and parser when
installed, and a deadline on reading a request's headers.

uvicorn closes a keep-alive connection that stays idle after a response (``timeout_keep_alive``), but it sets no
timer on a new connection, and it cancels the keep-alive timer at the first byte of the next request: a client
that connects and sends nothing, or half a request line and headers (slowloris), holds its socket and a file
descriptor for as long as it likes. ``header_deadline_protocol`` adds that missing timer: a connection that has
not completed a request's headers ``header_timeout_s`` after it opened (or after its last response) is closed.
Bodies are timed by the app's body guard (server.bodylimit, ``--body-timeout-seconds``), responses not at all: a
stream may rightly last minutes. The same class keeps an absolute-form request target's authority for the Host
guard (server.hostguard).

Nor does httptools bound a request's headers (h11 does, at 16 KiB): megabytes of headers would be buffered, and
kept. The same protocol class counts a request's header bytes and answers more than ``max_header_bytes`` with
431 Request Header Fields Too Large (RFC 6585), then closes the connection.
"""

from __future__ import annotations

import importlib.util
import json
import re

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.server.hostguard import TARGET_AUTHORITY

KEEP_ALIVE_S = 5  # uvicorn's default: an idle keep-alive connection closes this long after its last response
MAX_HEADER_BYTES = 65_536  # request line and headers of one request (bytes); nginx's large buffers hold 4 x 8 KiB


def uvicorn_impls() -> dict[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools (both C) when installed, else asyncio and h11.

    Every streamed token costs the event loop an SSE write, and on a 2-core machine that CPU time competes with
    the engine's 2 OpenMP threads; the C implementations spend less of it per token (``uvicorn[standard]``'s
    choice). uvloop does not exist on Windows, where asyncio stays.
    """
    have = {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools")}
    return {"loop": "uvloop" if have["uvloop"] else "asyncio", "http": "httptools" if have["httptools"] else "h11"}


def header_deadline_protocol(http: str, header_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES) -> type:
    """uvicorn's ``http`` protocol class (``"httptools"`` or ``"h11"``) with a deadline on request headers and a
    bound on their size.

    The deadline is armed when the connection opens and again at the first byte after a completed response;
    it is disarmed once a request's headers are complete (uvicorn then has a request cycle running). Bytes up to
    the blank line that ends the headers count against ``max_header_bytes``; body bytes do not.
    """
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        base = H11Protocol

    class HeaderDeadline(base):
        _header_timer = None
        _header_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # reading a request's line and headers
                end = data.find(b"\r\n\r\n")
                self._header_bytes += len(data) if end < 0 else end + 4
                if self._header_bytes > max_header_bytes:
                    self._headers_too_large()
                    return
            super().data_received(data)
            in_request = self.cycle is not None and not self.cycle.response_complete
            if in_request:
                self._header_bytes = 0
            if in_request and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            elif not in_request and self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def on_headers_complete(self) -> None:  # httptools' callback (h11 keeps the whole target in the path)
            # an absolute-form target (GET http://host/path): httptools keeps only the path, so its authority, which
            # the Host guard must check (RFC 9112 3.2.2), is kept in the scope
            if b"://" in self.url[:16] and not self.url.startswith(b"/"):
                rest = self.url.split(b"://", 1)[1]
                self.scope[TARGET_AUTHORITY] = re.split(rb"[/?#]", rest, maxsplit=1)[0].decode("latin-1")
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _headers_too_large(self) -> None:
            if not self.transport.is_closing():
                self.transport.write(_too_large_response(max_header_bytes))
                self.transport.close()

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            in_request = self.cycle is not None and not self.cycle.response_complete
            if not in_request and not self.transport.is_closing():
                self.transport.close()

    HeaderDeadline.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline


def _too_large_response(limit: int) -> bytes:
    """The raw 431 (the app never sees such a request), with an OpenAI error body and a request id."""
    from kvserve.server.requestids import new_request_id

    body = json.dumps({"error": {"message": f"the request's headers are larger than {limit:,} bytes",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_header_fields_too_large"}}).encode()
    head = (f"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\nx-request-id: {new_request_id()}\r\n\r\n")
    return head.encode() + body


def uvicorn_config(app, host: str, port: int, header_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES,
                   **kwargs) -> uvicorn.Config:
    """A uvicorn Config for ``app`` with kvserve's loop, parser, header deadline and header bound (``kwargs`` go to
    uvicorn)."""
    impls = uvicorn_impls()
    return uvicorn.Config(app, host=host, port=port, loop=impls["loop"],
                          http=header_deadline_protocol(impls["http"], header_timeout_s, max_header_bytes),
                          timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=2 * max_header_bytes,
                          **kwargs)
