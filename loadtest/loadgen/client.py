"""One streamed request against an OpenAI-compatible server, timed on the client.

Times are taken with ``time.perf_counter`` around the SSE stream (httpx-sse):

    send ──── first content chunk ──── chunk ── chunk ── ... ── [DONE]
    |<- ttft (queue + prefill) ->|<- itl ->|<- itl ->|
    |<----------------------------- e2e ---------------------------->|

Output tokens come from the server's usage chunk (``stream_options.include_usage``), else from kvserve's
``timings`` or llama.cpp's ``timings.predicted_n``, else from the count of content chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx
from httpx_sse import aconnect_sse

from kvserve.loadtest.loadgen.workloads import RequestSpec

STATUS_CLIENT_ERROR = 0  # transport failure or timeout: no HTTP status


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as the client saw it.

    Attributes:
        index: position of the request in the run.
        start_s: send time, seconds since the run started.
        status: HTTP status (0 for a transport error or timeout).
        ttft_s: send to first content chunk (queue + prefill), seconds; None if no content came.
        e2e_s: send to end of stream, seconds.
        itl_s: gaps between consecutive content chunks, seconds.
        output_tokens: tokens generated (from usage when the server sends it).
        prompt_tokens: prompt tokens (from usage), or None.
        server_queue_ms, server_ttft_ms: kvserve's own ``timings`` (None from other servers).
        error: error text for a failed request.
    """

    index: int
    start_s: float
    status: int = STATUS_CLIENT_ERROR
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    server_queue_ms: float | None = None
    server_ttft_ms: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def rejected(self) -> bool:
        """The server refused the request because its queue was full (429)."""
        return self.status == 429

    def to_json(self) -> dict:
        return asdict(self)


def _chunk_text(chunk: dict) -> str:
    """The generated text in one streamed chunk (completions ``text`` or chat ``delta.content``)."""
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        parts.append((delta.get("content") if delta else choice.get("text")) or "")
    return "".join(parts)


def _read_counts(chunk: dict, record: RequestRecord) -> None:
    """Take token counts and server timings from usage / timings fields when present."""
    usage = chunk.get("usage")
    if usage:
        record.output_tokens = int(usage.get("completion_tokens", record.output_tokens))
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    timings = chunk.get("timings")
    if timings:
        if "completion_tokens" in timings:  # kvserve
            record.server_queue_ms = timings.get("queue_ms")
            record.server_ttft_ms = timings.get("ttft_ms")
            if not usage:
                record.output_tokens = int(timings["completion_tokens"])
        elif "predicted_n" in timings and not usage:  # llama.cpp
            record.output_tokens = int(timings["predicted_n"])


async def stream_request(client: httpx.AsyncClient, spec: RequestSpec, model: str, index: int,
                         run_start: float, timeout_s: float) -> RequestRecord:
    """Send ``spec`` streamed and time it; never raises for HTTP or transport errors (they are recorded).

    Args:
        client: a client whose base_url is the server.
        spec: the request.
        model: the model name to send.
        index: the request's number in the run.
        run_start: ``perf_counter()`` at the start of the run.
        timeout_s: limit for the whole request (s).
    """
    sent = time.perf_counter()
    record = RequestRecord(index=index, start_s=sent - run_start)
    content_chunks = 0
    last = sent
    try:
        async with aconnect_sse(client, "POST", spec.endpoint.value, json=spec.body(model),
                                timeout=httpx.Timeout(timeout_s, connect=10.0)) as source:
            record.status = source.response.status_code
            if record.status != 200:
                body = await source.response.aread()
                record.error = body.decode(errors="replace")[:300]
                record.e2e_s = time.perf_counter() - sent
                return record
            async for event in source.aiter_sse():
                if event.data.strip() == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(event.data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:300]
                    break
                if _chunk_text(chunk):
                    if record.ttft_s is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    content_chunks += 1
                _read_counts(chunk, record)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.e2e_s = time.perf_counter() - sent
    if record.output_tokens == 0:
        record.output_tokens = content_chunks
    return record

