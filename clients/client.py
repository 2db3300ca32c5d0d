"""HTTP client for kvserve (httpx + httpx-sse): stream chat and completion text, get timings.

    with KVServeClient("http://127.0.0.1:8000") as client:
        with client.stream_chat("Name three rivers.", max_tokens=64) as stream:
            for delta in stream:
                print(delta, end="", flush=True)
        print(stream.result.ttft_s, stream.result.tokens_per_s, stream.result.server_timings)

The asyncio twin is :mod:`clients.async_client`. HTTP only: nothing here imports torch or the server, so the
package installs and runs on any machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import connect_sse

from kvserve.clients.stream import KVServeError, StreamAccumulator, StreamResult, parse_retry_after

DEFAULT_URL = "http://127.0.0.1:8000"
# Long generations stream for minutes; the read timeout is per chunk, so it only fires on a stalled server.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)

Messages = str | list[dict[str, Any]]


def error_from_response(response: httpx.Response) -> KVServeError:
    """The :class:`KVServeError` for a 4xx/5xx response whose body has been read."""
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return KVServeError.from_body(body, response.status_code, parse_retry_after(response.headers.get("retry-after")))


def decode_event(data: str) -> dict[str, Any] | None:
    """One SSE ``data:`` payload as a chunk; None at ``[DONE]``."""
    if data.strip() == "[DONE]":
        return None
    return json.loads(data)


def truncated_error() -> KVServeError:
    """The error for a stream that ended without ``data: [DONE]``."""
    return KVServeError("the stream ended before data: [DONE] (server stopped or connection lost)")


class ClientBase:
    """Request bodies and headers shared by the sync and async clients."""

    def __init__(self, base_url: str, api_key: str | None, model: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model  # None: the first id of /v1/models, looked up on first use
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @staticmethod
    def chat_body(model: str, messages: Messages, system: str | None, params: dict[str, Any]) -> dict[str, Any]:
        """A streamed ``/v1/chat/completions`` body; a str ``messages`` is one user turn."""
        turns = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        if system is not None:
            turns.insert(0, {"role": "system", "content": system})
        return ClientBase._stream_body({"model": model, "messages": turns}, params)

    @staticmethod
    def completion_body(model: str, prompt: str | list[int], params: dict[str, Any]) -> dict[str, Any]:
        """A streamed ``/v1/completions`` body; ``prompt`` is text or a list of token ids."""
        return ClientBase._stream_body({"model": model, "prompt": prompt}, params)

    @staticmethod
    def _stream_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        body.update({key: value for key, value in params.items() if value is not None})
        body.update(stream=True, stream_options={"include_usage": True})
        return body


class TextStream:
    """A streamed response: iterate for choice 0's text deltas; read ``result`` once the iteration ends.

    The request is sent when the iteration starts. Iterating raises :class:`KVServeError` on an HTTP error
    (before any text) or on an error event mid-stream; ``httpx.TransportError`` if the server cannot be reached.
    """

    def __init__(self, client: httpx.Client, path: str, body: dict[str, Any], chat: bool) -> None:
        self._accumulator = StreamAccumulator(time.perf_counter(), chat)
        self._chunks = self._iter_chunks(client, path, body)

    def _iter_chunks(self, client: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self._accumulator.started = time.perf_counter()
        with connect_sse(client, "POST", path, json=body) as source:
            if source.response.is_error:
                source.response.read()
                raise error_from_response(source.response)
            for event in source.iter_sse():
                chunk = decode_event(event.data)
                if chunk is None:
                    return
                yield chunk
        raise truncated_error()

    def __iter__(self) -> Iterator[str]:
        return self._accumulator.deltas(self._chunks)

    @property
    def result(self) -> StreamResult:
        """The finished result. Raises RuntimeError before the stream has been read to its end."""
        return self._accumulator.final()

    def close(self) -> None:
        """Drop the connection (an unfinished request is aborted by the server on disconnect)."""
        self._chunks.close()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class KVServeClient(ClientBase):
    """Blocking client.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        api_key: sent as ``Authorization: Bearer <key>`` when the server runs with ``--api-key``.
        model: the ``model`` field; None asks ``/v1/models`` once and uses its first id.
        timeout: httpx timeout (s); the read timeout applies per chunk.
    """

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, model: str | None = None,
                 timeout: httpx.Timeout | float = DEFAULT_TIMEOUT) -> None:
        super().__init__(base_url, api_key, model)
        self.http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def _get(self, path: str) -> Any:
        response = self.http.get(path)
        if response.is_error:
            raise error_from_response(response)
        return response.json()

    def models(self) -> list[str]:
        """Ids listed by ``GET /v1/models``."""
        return [entry["id"] for entry in self._get("/v1/models")["data"]]

    def health(self) -> dict[str, Any]:
        """``GET /health``; raises :class:`KVServeError` on 503 (engine loop dead)."""
        return self._get("/health")

    def _model(self) -> str:
        if self.model is None:
            self.model = self.models()[0]
        return self.model

    def stream_chat(self, messages: Messages, *, system: str | None = None, max_tokens: int | None = None,
                    temperature: float | None = None, **params: Any) -> TextStream:
        """Stream a chat completion; extra OpenAI/vLLM fields (top_p, seed, stop, ignore_eos, ...) pass through."""
        params.update(max_tokens=max_tokens, temperature=temperature)
        body = self.chat_body(self._model(), messages, system, params)
        return TextStream(self.http, "/v1/chat/completions", body, chat=True)

    def stream_completion(self, prompt: str | list[int], *, max_tokens: int | None = None,
                          temperature: float | None = None, **params: Any) -> TextStream:
        """Stream a text completion of ``prompt`` (text or token ids)."""
        params.update(max_tokens=max_tokens, temperature=temperature)
        body = self.completion_body(self._model(), prompt, params)
        return TextStream(self.http, "/v1/completions", body, chat=False)

    def chat(self, messages: Messages, **kwargs: Any) -> StreamResult:
        """Stream a chat completion to its end and return the result."""
        with self.stream_chat(messages, **kwargs) as stream:
            for _ in stream:
                pass
        return stream.result

    def complete(self, prompt: str | list[int], **kwargs: Any) -> StreamResult:
        """Stream a text completion to its end and return the result."""
        with self.stream_completion(prompt, **kwargs) as stream:
            for _ in stream:
                pass
        return stream.result

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def __enter__(self) -> KVServeClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
