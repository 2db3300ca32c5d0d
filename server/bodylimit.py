"""A request body size limit: bodies over ``--max-request-bytes`` get a 413 before they cost anything.

Without it a client could send a 50 MB prompt: the server would read it, parse the JSON and spend a CPU core
for about a minute tokenizing it before answering 400 (too long for the context), and on a 2-core machine that
core is taken from the engine, so every other stream slows down.
"""

from __future__ import annotations

from kvserve.server.errors import ApiError


class BodyLimit:
    """ASGI middleware answering 413 (an OpenAI-style error body) to a request body over ``limit`` bytes.

    A declared ``Content-Length`` over the limit is refused before any of the body is read. A chunked body is
    counted as it arrives; once past the limit the app is told the client went away (so it stops reading)
    and the client gets the 413 instead of whatever the app would have answered.

    Args:
        app: the ASGI app to guard.
        limit: most body bytes a request may send.
    """

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

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
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, int(declared))
            return
        seen = 0
        over = False
        started = False

        async def counted_receive():
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if over:
                return  # the app's answer to a "disconnected" client: replaced by the 413 below
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._refuse(scope, receive, send, None)
