"""What a kvserve stream means to a client: chunks in, text deltas and timings out. No I/O here.

The sync and async clients feed each parsed SSE ``data:`` object to one :class:`StreamAccumulator`; it joins
the text per choice, keeps the finish reasons, the server's ``timings`` and ``usage``, and stamps the client
clock at the first and last text delta so TTFT and decode speed can be measured from this side too.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


class KVServeError(Exception):
    """An error the server reported, as an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.

    Attributes:
        message: the server's message (the OpenAI ``error.message``), or the raw body if it was not JSON.
        status_code: the HTTP status; None when the error arrived as an event after the stream started.
        error_type: the OpenAI ``error.type`` (e.g. ``invalid_request_error``), if given.
        code: the OpenAI ``error.code``, if given.
        param: the request field the error names, if given.
        retry_after_s: the ``Retry-After`` header in seconds (429/503), if given.
    """

    def __init__(self, message: str, status_code: int | None = None, error_type: str | None = None,
                 code: str | int | None = None, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"HTTP {self.status_code}" if self.status_code is not None else "error during the stream"
        text = f"{where}: {self.message}"
        if self.error_type:
            text += f" ({self.error_type})"
        already_said = "retry after" in self.message.lower()  # kvserve's 429 message names the delay itself
        if self.retry_after_s is not None and not already_said:
            text += f"; retry after {self.retry_after_s:g} s"
        return text

    @classmethod
    def from_body(cls, body: Any, status_code: int | None, retry_after_s: float | None = None) -> KVServeError:
        """Build from a decoded error body: OpenAI's ``{"error": {...}}``, FastAPI's ``{"detail": ...}``, or text."""
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            error = body["error"]
            return cls(str(error.get("message", "")), status_code, error.get("type"), error.get("code"),
                       error.get("param"), retry_after_s)
        if isinstance(body, dict) and "detail" in body:
            return cls(str(body["detail"]), status_code, retry_after_s=retry_after_s)
        return cls(str(body) if body else "(empty body)", status_code, retry_after_s=retry_after_s)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header, which is either delay-seconds or an HTTP-date (RFC 9110 10.2.3)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(slots=True, frozen=True)
class ServerTimings:
    """The server's own measurements: the ``timings`` field of the final chunk (or of a non-streamed body)."""

    queue_ms: float            # admission wait in the scheduler queue (ms)
    ttft_ms: float             # arrival to first token, measured in the server (ms)
    decode_tokens_per_s: float  # tokens after the first, per second of decoding
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int         # prompt tokens served from the prefix cache

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerTimings:
        """Parse the ``timings`` object; missing numbers read as 0."""
        return cls(queue_ms=float(data.get("queue_ms", 0.0)), ttft_ms=float(data.get("ttft_ms", 0.0)),
                   decode_tokens_per_s=float(data.get("decode_tokens_per_s", 0.0)),
                   prompt_tokens=int(data.get("prompt_tokens", 0)),
                   completion_tokens=int(data.get("completion_tokens", 0)),
                   cached_tokens=int(data.get("cached_tokens", 0)))


@dataclass(slots=True)
class StreamResult:
    """One finished request as the client saw it.

    Attributes:
        texts: the joined text of each choice, by choice index.
        finish_reasons: ``stop`` | ``length`` per choice (None if the stream ended without one).
        id: the stream's id (the same on every chunk).
        server_timings: the server's ``timings`` of choice 0, if it sent them.
        usage: the OpenAI ``usage`` object, if sent (``stream_options.include_usage``).
        ttft_s: client clock, request sent to first non-empty text delta (s).
        elapsed_s: client clock, request sent to end of stream (s).
        last_token_s: client clock, request sent to last non-empty text delta (s).
    """

    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    id: str | None = None
    server_timings: ServerTimings | None = None
    usage: dict[str, Any] | None = None
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    last_token_s: float | None = None
    text_deltas: int = 0        # non-empty text deltas of choice 0 (a stand-in for tokens if none are reported)

    @property
    def text(self) -> str:
        """Text of choice 0."""
        return self.texts[0] if self.texts else ""

    @property
    def finish_reason(self) -> str | None:
        """Finish reason of choice 0."""
        return self.finish_reasons[0] if self.finish_reasons else None

    @property
    def completion_tokens(self) -> int:
        """Generated tokens of choice 0: the server's count, else usage's, else the number of text deltas."""
        if self.server_timings is not None:
            return self.server_timings.completion_tokens
        if self.usage is not None and len(self.texts) == 1:
            return int(self.usage.get("completion_tokens", 0))
        return self.text_deltas

    @property
    def tokens_per_s(self) -> float | None:
        """Client-measured decode speed: (tokens - 1) / (last token time - first token time), tokens/s.

        The first token is excluded because its time is the TTFT (vLLM's benchmark defines TPOT the same way);
        None with fewer than two tokens or no time between them.
        """
        if self.ttft_s is None or self.last_token_s is None:
            return None
        span_s = self.last_token_s - self.ttft_s
        if self.completion_tokens < 2 or span_s <= 0:
            return None
        return (self.completion_tokens - 1) / span_s


class StreamAccumulator:
    """Folds parsed chunks of one stream into a :class:`StreamResult`.

    Args:
        started: ``time.perf_counter()`` when the request was sent (s).
        chat: True reads ``choices[i].delta.content`` (chat), False reads ``choices[i].text`` (completions).
    """

    def __init__(self, started: float, chat: bool) -> None:
        self.started = started
        self.chat = chat
        self.result = StreamResult()
        self.finished = False

    def add(self, chunk: dict[str, Any], now: float) -> str:
        """Fold one chunk in; return the text it adds to choice 0 ('' if none).

        Raises:
            KVServeError: the chunk is an error event (``{"error": {...}}``), sent after the stream started.
        """
        if "error" in chunk:
            raise KVServeError.from_body(chunk, status_code=None)
        result = self.result
        result.id = result.id or chunk.get("id")
        if chunk.get("usage"):
            result.usage = chunk["usage"]
        delta_0 = ""
        final_0 = False
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index", 0))
            while len(result.texts) <= index:
                result.texts.append("")
                result.finish_reasons.append(None)
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if text:
                result.texts[index] += text
                if index == 0:
                    delta_0 = text
            if choice.get("finish_reason") is not None:
                result.finish_reasons[index] = choice["finish_reason"]
                final_0 = final_0 or index == 0
        # Timings ride on each choice's final chunk; keep choice 0's, or any if the server sent them elsewhere.
        if chunk.get("timings") and (final_0 or result.server_timings is None):
            result.server_timings = ServerTimings.from_json(chunk["timings"])
        if delta_0:
            result.text_deltas += 1
            result.last_token_s = now - self.started
            if result.ttft_s is None:
                result.ttft_s = result.last_token_s
        return delta_0

    def finish(self, now: float) -> StreamResult:
        """Stamp the end of the stream and return the result."""
        self.result.elapsed_s = now - self.started
        self.finished = True
        return self.result

    def deltas(self, chunks: Iterable[dict[str, Any]]) -> Iterator[str]:
        """Fold every chunk in, yielding choice 0's non-empty text deltas, then stamp the end."""
        for chunk in chunks:
            delta = self.add(chunk, time.perf_counter())
            if delta:
                yield delta
        self.finish(time.perf_counter())

    def final(self) -> StreamResult:
        """The finished result. Raises RuntimeError before the stream has been read to its end."""
        if not self.finished:
            raise RuntimeError("the stream has not been read to its end")
        return self.result
