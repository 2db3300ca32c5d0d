"""Asyncio client for kvserve (httpx + httpx-sse): the twin of :mod:`clients.client`, with awaited methods.

    async with AsyncKVServeClient("http://127.0.0.1:8000") as client:
        stream = await client.stream_chat("Name three rivers.", max_tokens=64)
        async with stream:
            async for delta in stream:
                print(delta, end="", flush=True)
        print(stream.result.server_timings)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from kvserve.clients.client import (DEFAULT_TIMEOUT, DEFAULT_URL, ClientBase, Messages, decode_event,
                            error_from_response, truncated_error)
from kvserve.clients.stream import StreamAccumulator, StreamResult


class AsyncTextStream:
    """The async twin of :class:`TextStream`: ``async for delta in stream``, then ``stream.result``."""

    def __init__(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], chat: bool) -> None:
        self._accumulator = StreamAccumulator(time.perf_counter(), chat)
        self._chunks = self._iter_chunks(client, path, body)

    async def _iter_chunks(self, client: httpx.AsyncClient, path: str,
                           body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self._accumulator.started = time.perf_counter()
        async with aconnect_sse(client, "POST", path, json=body) as source:
            if source.response.is_error:
                await source.response.aread()
                raise error_from_response(source.response)
            async for event in source.aiter_sse():
                chunk = decode_event(event.data)
                if chunk is None:
                    return
                yield chunk
        raise truncated_error()

    async def __aiter__(self) -> AsyncIterator[str]:
        async for chunk in self._chunks:
            delta = self._accumulator.add(chunk, time.perf_counter())
            if delta:
                yield delta
        self._accumulator.finish(time.perf_counter())

    @property
    def result(self) -> StreamResult:
        """The finished result. Raises RuntimeError before the stream has been read to its end."""
        return self._accumulator.final()

    async def aclose(self) -> None:
        """Drop the connection."""
        await self._chunks.aclose()

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class AsyncKVServeClient(ClientBase):
    """Asyncio client; same arguments and methods as :class:`KVServeClient`, awaited."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, model: str | None = None,
                 timeout: httpx.Timeout | float = DEFAULT_TIMEOUT) -> None:
        super().__init__(base_url, api_key, model)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout)

    async def _get(self, path: str) -> Any:
        response = await self.http.get(path)
        if response.is_error:
            raise error_from_response(response)
        return response.json()

    async def models(self) -> list[str]:
        """Ids listed by ``GET /v1/models``."""
        return [entry["id"] for entry in (await self._get("/v1/models"))["data"]]

    async def health(self) -> dict[str, Any]:
        """``GET /health``; raises :class:`KVServeError` on 503."""
        return await self._get("/health")

    async def _model(self) -> str:
        if self.model is None:
            self.model = (await self.models())[0]
        return self.model

    async def stream_chat(self, messages: Messages, *, system: str | None = None, max_tokens: int | None = None,
                          temperature: float | None = None, **params: Any) -> AsyncTextStream:
        """Stream a chat completion (``stream = await client.stream_chat(...)``, then ``async for``)."""
        params.update(max_tokens=max_tokens, temperature=temperature)
        body = self.chat_body(await self._model(), messages, system, params)
        return AsyncTextStream(self.http, "/v1/chat/completions", body, chat=True)

    async def stream_completion(self, prompt: str | list[int], *, max_tokens: int | None = None,
                                temperature: float | None = None, **params: Any) -> AsyncTextStream:
        """Stream a text completion of ``prompt`` (text or token ids)."""
        params.update(max_tokens=max_tokens, temperature=temperature)
        body = self.completion_body(await self._model(), prompt, params)
        return AsyncTextStream(self.http, "/v1/completions", body, chat=False)

    async def chat(self, messages: Messages, **kwargs: Any) -> StreamResult:
        """Stream a chat completion to its end and return the result."""
        async with await self.stream_chat(messages, **kwargs) as stream:
            async for _ in stream:
                pass
        return stream.result

    async def complete(self, prompt: str | list[int], **kwargs: Any) -> StreamResult:
        """Stream a text completion to its end and return the result."""
        async with await self.stream_completion(prompt, **kwargs) as stream:
            async for _ in stream:
                pass
        return stream.result

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()

    async def __aenter__(self) -> AsyncKVServeClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
