"""``x-request-id`` on every response, and vLLM's ``GET /tokenizer_info``.

Request ids: a client's own ``x-request-id`` (a proxy's trace id, say) is kept, so one id follows a request
through the proxy's logs and ours; otherwise one is made. The openai SDK exposes it as ``response._request_id``.
The id is in ``request.state.request_id`` for handlers and in one log line per request. A client that hangs up
before its request body has arrived whole is logged with status 499 (nginx's "client closed request"), not as
a server error: nothing is sent, there is no one to send it to.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.requests import ClientDisconnect

from kvserve.server.errors import ApiError

log = logging.getLogger("kvserve.requests")

HEADER = b"x-request-id"
CLIENT_CLOSED = 499  # the log line's status of a request whose client hung up before it was read (nginx's)
# a client's id is echoed in a header and a log line: printable ASCII only, bounded, so neither can be forged
_USABLE = re.compile(r"[\x21-\x7e]{1,128}")


def new_request_id() -> str:
    """A fresh id: 32 hex digits (a random UUID)."""
    return uuid.uuid4().hex


class RequestIds:
    """Pure ASGI middleware: takes or makes the request id, sets ``x-request-id`` on the response, logs it.

    Args:
        app: the ASGI app to wrap.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(HEADER, b"").decode("latin-1").strip()
        request_id = given if _USABLE.fullmatch(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 0

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": headers + [(HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # raised where a handler reads the body the client stopped sending
            status = status or CLIENT_CLOSED
        except Exception as exc:
            # the last resort, here so that its 500 carries the id and the log line its status: a bug, never
            # the client's fault, still answered with an OpenAI-shaped body
            log.exception("unhandled error in %s %s request_id=%s", scope["method"], _escaped(scope["path"]),
                          request_id)
            if status:
                raise  # the response has begun: nothing can be sent now; the server closes the connection
            await ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()(
                scope, receive, send_with_id)
        finally:
            log.info("%s %s %d request_id=%s %.1f ms", scope["method"], _escaped(scope["path"]), status, request_id,
                     (time.perf_counter() - started) * 1000)


def _escaped(path: str) -> str:
    """The path as a log may show it: control characters and backslashes escaped (``\\n``, ``\\x1b``), so a
    ``%0A`` in a URL can never start a forged line of the log."""
    return path.encode("unicode_escape", "backslashreplace").decode("ascii")


def tokenizer_info(tokenizer) -> dict:
    """vLLM's ``/tokenizer_info`` body: the tokenizer's init kwargs (file paths dropped, special tokens as their
    text), ``tokenizer_class`` and the ``chat_template`` when there is one. lm-eval's ``tokenizer_backend=remote``
    reads ``eos_token``, ``bos_token`` and ``chat_template`` from it."""
    config = {key: _plain(value) for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in ("vocab_file", "merges_file", "tokenizer_file", "gguf_file", "name_or_path")}
    config = {key: value for key, value in config.items() if value is not _UNSERIALIZABLE}
    config["tokenizer_class"] = type(tokenizer).__name__
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    return config


_UNSERIALIZABLE = object()


def _plain(value):
    """A JSON-ready copy: AddedToken -> its text; containers recursively; other objects left out."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        items = {str(k): _plain(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _UNSERIALIZABLE}
    if isinstance(value, (list, tuple)):
        return [v for v in map(_plain, value) if v is not _UNSERIALIZABLE]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return _UNSERIALIZABLE
