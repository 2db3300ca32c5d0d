"""A request body size limit: bodies over ``--max-request-bytes`` get a 413 before they cost anything; and
compressed bodies, decoded within that limit.

Without it a client could send a 50 MB prompt: the server would read it, parse the JSON and spend a CPU core
for about a minute tokenizing it before answering 400 (too long for the context), and on a 2-core machine that
core is taken from the engine, so every other stream slows down.

A body sent with ``Content-Encoding: gzip`` (RFC 9110 8.4; OpenAI's SDKs and proxies may compress large bodies)
is decompressed as it arrives, and the limit counts the decompressed bytes, so a small "gzip bomb" is a 413 after
at most ``limit`` bytes of output, never gigabytes in memory. Other encodings are a 415 naming the ones served.

And a body must arrive whole within ``timeout_s`` of the app's first read (uvicorn times neither a body nor its
pauses): a client that sends headers and then stalls, or trickles the body a byte at a time, gets 408 Request
Timeout and its connection is closed, so a thousand of them cannot hold a thousand sockets and file descriptors.
Once the body is complete nothing is timed: a stream's reply may rightly last minutes.
"""

from __future__ import annotations

import asyncio
import time
import zlib

from kvserve.server.errors import ApiError

SERVED_ENCODINGS = ("gzip", "identity")  # Content-Encoding values a request body may carry


class BodyLimit:
    """ASGI middleware answering 413 (an OpenAI-style error body) to a request body over ``limit`` bytes.

    A declared ``Content-Length`` over the limit is refused before any of the body is read. A chunked body is
    counted as it arrives; once past the limit the app is told the client went away (so it stops reading)
    and the client gets the 413 instead of whatever the app would have answered.

    Args:
        app: the ASGI app to guard.
        limit: most body bytes a request may send (decompressed).
        timeout_s: longest wait for a whole body, from the app's first read (s).
    """

    def __init__(self, app, limit: int, timeout_s: float = 30.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    def _error(self, length: int | None) -> ApiError:
        size = f"{length:,} bytes" if length is not None else f"more than {self.limit:,} bytes"
        return ApiError(413, f"the request body is {size}; this server takes at most {self.limit:,} "
                             "(--max-request-bytes)", code="request_too_large")

    async def _refuse(self, scope, receive, send, length: int | None) -> None:
        response = self._error(length).response()
        response.headers["Connection"] = "close"  # the unread rest of the body must not be parsed as a request
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, int(declared))
            return
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        has_body = declared not in (b"", b"0") or b"transfer-encoding" in headers
        if encoding not in SERVED_ENCODINGS and has_body:
            error = ApiError(415, f"Content-Encoding {encoding!r} is not served; send the body as is or with "
                                  f"Content-Encoding: gzip", param="Content-Encoding", code="unsupported_media_type")
            response = error.response()
            response.headers["Accept-Encoding"] = ", ".join(SERVED_ENCODINGS)  # RFC 9110 12.5.3: what is accepted
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        inflate = None
        if encoding == "gzip" and has_body:
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # 16 +: the gzip wrapper, not raw zlib
            # the app reads the decoded body: its length is no longer the header's
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"]
                                         if k not in (b"content-encoding", b"content-length")])
        seen = 0
        over = False
        bad_gzip: str | None = None
        slow = False
        body_done = False
        deadline: float | None = None
        started = False

        async def counted_receive():
            nonlocal seen, over, bad_gzip, slow, body_done, deadline
            if over or bad_gzip is not None or slow:
                return {"type": "http.disconnect"}
            if body_done:  # after the body only a disconnect can come: wait for it as long as the reply lasts
                return await receive()
            deadline = deadline or time.monotonic() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                slow = True
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                body = message.get("body", b"")
                if inflate is not None:
                    try:  # at most limit + 1 bytes out of this chunk: enough to know it is over
                        body = inflate.decompress(body, self.limit + 1 - seen)
                        if inflate.unconsumed_tail:  # more output than the limit leaves
                            body += b"\0"
                        elif not message.get("more_body", False) and not inflate.eof:
                            raise zlib.error("the gzip stream ends early")
                    except zlib.error as exc:
                        bad_gzip = str(exc)
                        return {"type": "http.disconnect"}
                    message = dict(message, body=body)
                seen += len(body)
                if seen > self.limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if over or bad_gzip is not None or slow:
                return  # the app's answer to a "disconnected" client: replaced by the 413, 400 or 408 below
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not (over or bad_gzip is not None or slow):
                raise
        if started:
            return
        if slow:
            response = ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                code="request_timeout").response()
            response.headers["Connection"] = "close"  # the rest of a stalled body must not be read as a request
            await response(scope, receive, send)
        elif over:
            await self._refuse(scope, receive, send, None)
        elif bad_gzip is not None:
            response = ApiError(400, f"the request body is not valid gzip data ({bad_gzip})",
                                param="Content-Encoding").response()
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
