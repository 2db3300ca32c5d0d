"""``POST /v1/responses``: the stateless subset of OpenAI's Responses API, over the chat pipeline.

Served: ``input`` (a string, or message items with text parts), ``instructions`` (a system message first),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``metadata``/``user`` (echoed). Nothing is
stored, so ``previous_response_id``, ``store: true``, ``conversation`` and ``background`` are 400s naming the
field, as are tools, structured ``text.format``, reasoning and non-text inputs: they would change the output.

Streaming sends OpenAI's event sequence (each with ``sequence_number``)::

    response.created, response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done, response.completed (response.incomplete when max_output_tokens cut it)

A thinking model's reasoning (server.reasoning) comes first as a ``reasoning`` item with a ``reasoning_text``
part (``response.output_item.added``, ``response.reasoning_text.delta`` ..., ``response.reasoning_text.done``,
``response.output_item.done``), as vLLM's Responses API sends it; the message is then output 1.
"""

from __future__ import annotations

import json
import re
import time
from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field, StrictBool, ValidationError, ValidationInfo, field_validator, model_validator
from sse_starlette.sse import EventSourceResponse

from kvserve.server.admission import admit
from kvserve.server.drain import Drain
from kvserve.server.errors import ApiError
from kvserve.server.generation import Generation, until_done_or_gone
from kvserve.server.reasoning import ReasoningSplit
from kvserve.server.schemas import ChatCompletionRequest, ServiceTier, StreamOptions, check_text_parts
from kvserve.server.validation import BodyError, RequestModel, checked_required
from kvserve.server.state import ServerState


def _only(*schemas: dict) -> dict:
    """``json_schema_extra`` saying in /openapi.json which values a field takes (the validators below refuse the
    others by name, with a clearer message than a schema error would give)."""
    return {"anyOf": [*schemas, {"type": "null"}]}


_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class InputPart(RequestModel):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(json_schema_extra={"enum": list(_TEXT_PARTS)})
    text: str | None = checked_required()  # the message's check says which part lacks it


class InputMessage(RequestModel):
    """A message item of ``input``; other item types (function call outputs, ...) are 400s."""

    model_config = ConfigDict(extra="ignore")
    type: str = Field(default="message", json_schema_extra={"enum": ["message"]})
    role: str = Field(default="user", json_schema_extra={"enum": list(_ROLES)})
    # required, as on chat (a missing, null or empty content is a 400 naming it, never an empty turn)
    content: str | list[InputPart] | None = checked_required()

    @field_validator("content")
    @classmethod
    def _content_given(cls, value, info: ValidationInfo):
        if info.data.get("type", "message") != "message":
            return value  # another item type: refused as such (below), content or not
        if value is None:
            raise ValueError("content is required: a string or a list of text parts")
        if isinstance(value, list):
            check_text_parts(value, _TEXT_PARTS)
        return value

    @model_validator(mode="after")
    def _text_messages_only(self):
        if self.type != "message":
            raise ValueError(f"input items of type {self.type!r} are not supported by kvserve (only messages)")
        if self.role not in _ROLES:
            raise ValueError(f"role {self.role!r} is not supported")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ResponsesRequest(RequestModel):
    """The request body of ``POST /v1/responses`` (fields as OpenAI's API reference)."""

    # an unknown field is a 400 naming it, as on chat and completions (OpenAI answers "unknown parameter")
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _is_body: ClassVar[bool] = True

    model: str | None = None
    # the list first: its errors (a non-text part) are the ones reported; a list is not empty (minItems applies to
    # arrays only, so the string may be "")
    input: list[InputMessage] | str = Field(json_schema_extra={"minItems": 1})
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: StrictBool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: see server.schemas
    priority: int = Field(default=0, ge=-2**31, lt=2**31)       # vLLM's: see server.schemas
    # accepted without effect: kvserve runs every request at once, and there is one tier
    parallel_tool_calls: bool | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None   # the prefix cache needs no key
    safety_identifier: str | None = None
    stream_options: StreamOptions | None = None  # include_obfuscation false only (server.schemas.StreamOptions)
    max_tool_calls: int | None = Field(default=None, json_schema_extra=_only())
    truncation: str | None = Field(default=None, json_schema_extra=_only({"const": "disabled"}))
    # refused when used: they need stored state, tools or structured decoding (see _refuse_unsupported); the
    # schema says which values are served
    previous_response_id: str | None = Field(default=None, json_schema_extra=_only())
    store: bool | None = Field(default=None, json_schema_extra=_only({"const": False}))
    conversation: str | dict | None = Field(default=None, json_schema_extra=_only())
    background: bool | None = Field(default=None, json_schema_extra=_only({"const": False}))
    tools: list | None = Field(default=None, json_schema_extra=_only({"type": "array", "maxItems": 0}))
    tool_choice: str | dict | None = Field(default=None, json_schema_extra=_only({"enum": ["none", "auto"]}))
    text: dict | None = Field(default=None, json_schema_extra=_only({"type": "object", "properties": {"format": {
        "anyOf": [{"type": "object", "properties": {"type": {"const": "text"}}}, {"type": "null"}]}}}))
    reasoning: dict | None = Field(default=None, json_schema_extra=_only({"type": "object", "maxProperties": 0}))
    include: list | None = Field(default=None, json_schema_extra=_only({"type": "array", "maxItems": 0}))
    prompt: dict | None = Field(default=None, json_schema_extra=_only())
    top_logprobs: int | None = Field(default=None, json_schema_extra=_only({"const": 0}))

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        text_format = (self.text or {}).get("format") or {}
        if not isinstance(text_format, dict):
            raise BodyError("text.format must be an object, e.g. {\"type\": \"text\"}", "text.format")
        unknown = sorted(set(self.text or {}) - {"format", "verbosity"})
        if unknown:
            raise BodyError(f"text.{unknown[0]}: unrecognized request argument", f"text.{unknown[0]}")
        if (self.text or {}).get("verbosity") not in (None, "medium"):  # medium: OpenAI's default
            raise BodyError("text.verbosity: not supported by kvserve other than \"medium\" (the model's own "
                            "length)", "text.verbosity")
        if self.stream_options is not None and not self.stream:
            raise BodyError("stream_options is only allowed when stream is true", "stream_options")
        unsupported = [name for name, used in (
            ("previous_response_id", self.previous_response_id is not None),
            ("store", bool(self.store)),
            ("conversation", self.conversation is not None),
            ("background", bool(self.background)),
            ("tools", bool(self.tools)),
            ("tool_choice", self.tool_choice not in (None, "none", "auto")),
            ("text.format", text_format.get("type", "text") != "text"),
            ("reasoning", bool(self.reasoning)),
            ("include", bool(self.include)),
            ("prompt", self.prompt is not None),
            ("top_logprobs", bool(self.top_logprobs)),
            ("max_tool_calls", self.max_tool_calls is not None),
            ("truncation", self.truncation not in (None, "disabled")),
        ) if used]
        if unsupported:  # named by the first (the 400's param), all of them in the message
            stored = {"previous_response_id", "store", "conversation", "background"} & set(unsupported)
            why = ("kvserve stores nothing; send the whole conversation as input, with store false or left out"
                   if stored else "kvserve does not implement it")
            raise BodyError(f"not supported by kvserve: {', '.join(unsupported)} ({why})", unsupported[0])
        if isinstance(self.input, list) and not self.input:
            raise BodyError("input must not be empty", "input")
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The same generation as a chat request: instructions first as a system message, then ``input``."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [{"role": m.role, "content": m.text} for m in self.input]
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                                     user=self.user, cache_salt=self.cache_salt, priority=self.priority)


_STATUS = {"length": "incomplete", "abort": "incomplete", "error": "failed"}  # finish reason -> response status
_INCOMPLETE = {"length": {"reason": "max_output_tokens"}, "abort": {"reason": "server_shutdown"}}


class _ResponseBuilder:
    """The response object and its stream events for one request: one message with one text part, after one
    reasoning item when a reasoning parser split the model's thinking off (server.reasoning)."""

    def __init__(self, body: ResponsesRequest, generation: Generation, request_id: str, model: str) -> None:
        self.body = body
        self.generation = generation
        self.id = "resp_" + request_id
        self.item_id = "msg_" + request_id
        self.reasoning_id = "rs_" + request_id
        self.model = model
        self.created_at = int(time.time())
        self.sequence = 0
        self.thinking = generation.prepared.thinking  # None: no reasoning parser
        self.reasoning: str | None = None  # the reasoning item's text, once it has one
        self.message_open = False
        self.text = ""  # the message's text so far (streamed)

    @property
    def where(self) -> dict:
        """The message's text part: its item, output index (after a reasoning item) and content index."""
        return {"item_id": self.item_id, "output_index": int(self.reasoning is not None), "content_index": 0}

    def reasoning_item(self, status: str) -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": self.reasoning or ""}]}

    def reasoning_events(self, delta: str):
        """Open the reasoning item at its first text, then one delta event per piece."""
        if not delta:
            return
        if self.reasoning is None:
            self.reasoning = ""
            yield self.event("response.output_item.added", output_index=0, item=self.reasoning_item("in_progress")
                             | {"content": []})
        self.reasoning += delta
        yield self.event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0, content_index=0,
                         delta=delta)

    def text_events(self, reasoning: str, answer: str):
        """The events of new text, its reasoning and its answer (either may be empty); the answer joins ``text``."""
        yield from self.reasoning_events(reasoning)
        if answer:
            yield from self.open_message()
            self.text += answer
            yield self.event("response.output_text.delta", delta=answer, logprobs=[], **self.where)

    def open_message(self):
        """Close the reasoning item (its text is whole now), then open the message and its text part."""
        if self.message_open:
            return
        self.message_open = True
        if self.reasoning is not None:
            where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
            yield self.event("response.reasoning_text.done", text=self.reasoning, **where)
            yield self.event("response.output_item.done", output_index=0, item=self.reasoning_item("completed"))
        yield self.event("response.output_item.added", output_index=self.where["output_index"],
                         item=self.item(None, "in_progress"))
        yield self.event("response.content_part.added", part=self.part(""), **self.where)

    def event(self, kind: str, **fields) -> dict:
        """One SSE event: ``event:`` is the type, the data repeats it with a growing ``sequence_number``."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(data)}

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def output(self, text: str | None, status: str) -> list[dict]:
        """The response's output items: the reasoning item (when there is one), then the message."""
        items = [] if self.reasoning is None else [self.reasoning_item("completed")]
        return items + ([] if text is None else [self.item(text, status)])

    def response(self, text: str | None, finish_reason: str | None, error: dict | None = None) -> dict:
        """The response object: in progress (``finish_reason`` None), completed, incomplete (length, or cut by
        the drain's deadline: ``abort``), or failed (``error``, with the error's code and message)."""
        status = "in_progress" if finish_reason is None else _STATUS.get(finish_reason, "completed")
        body = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "error": error, "incomplete_details": _INCOMPLETE.get(finish_reason) if status == "incomplete" else None,
               "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
               "output": self.output(text, status), "parallel_tool_calls": True,
               "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
               "temperature": body.temperature, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
               "tools": [], "top_p": body.top_p, "truncation": "disabled", "user": body.user,
               "metadata": body.metadata or {}, "usage": None}
        if finish_reason is not None:
            usage = self.generation.usage()
            out["usage"] = {"input_tokens": usage["prompt_tokens"],
                            # cache_write_tokens: the SDK's schema requires it; kvserve reports writes as 0 (a
                            # prefix cached by one request costs nothing extra, so nothing is billed as a write)
                            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                                     "cache_write_tokens": 0},
                            "output_tokens": usage["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage["total_tokens"]}
        return out


def register(app: FastAPI, state: ServerState, dependencies: list) -> None:
    """Add ``POST /v1/responses`` to ``app``; its body is admitted as the chat request it becomes (server.admission,
    with chat's 4xx/429s)."""

    @app.post("/v1/responses", dependencies=dependencies)
    async def responses(body: ResponsesRequest, request: Request):
        try:
            chat = body.chat_request()
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ApiError(400, f"input: {first.get('msg', 'invalid')}", param="input") from None
        try:
            generation = await admit(state, chat, request)
        except ApiError as exc:  # chat's checks name chat's fields: this route's are max_output_tokens and input
            if exc.param in ("max_tokens", "max_completion_tokens"):
                exc.message = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", exc.message)
                exc.param = "max_output_tokens"
            elif exc.param is not None and exc.param.split(".")[0] == "messages":
                exc.param = "input"  # the messages were made of instructions and input: their indexes differ
            raise
        builder = _ResponseBuilder(body, generation, request.state.request_id, state.model_name)
        if body.stream:
            return EventSourceResponse(_stream(builder, request.app.state.drain), ping=state.config.sse_ping_s or None,
                                       sep="\n")
        parts: list[str] = []
        reasons: list[str] = []

        async def consume() -> None:
            async for update in generation.updates():
                if update.error is not None:
                    raise update.error
                parts.append(update.text)
                if update.finish_reason is not None:
                    reasons.append(update.finish_reason)

        if not await until_done_or_gone(consume(), request, generation):  # a client that hung up stops it
            return Response(status_code=499)
        text = "".join(parts)
        if builder.thinking is not None:
            split = ReasoningSplit(builder.thinking)
            reasoning, text = split.feed(text)
            more, tail = split.finish()
            builder.reasoning, text = (reasoning + more) or None, text + tail
        return JSONResponse(builder.response(text, reasons[-1] if reasons else None))


async def _stream(builder: _ResponseBuilder, drain: Drain):
    """The Responses API's stream events. It always ends with a terminal event: ``response.completed``,
    ``response.incomplete`` (length, or the drain's deadline), or ``response.failed`` after an ``error``. With a
    reasoning parser the message opens at the answer's first text, after the reasoning item's events."""
    b = builder
    split = ReasoningSplit(b.thinking) if b.thinking is not None else None
    reason = None
    try:
        yield b.event("response.created", response=b.response(None, None))
        yield b.event("response.in_progress", response=b.response(None, None))
        if split is None:
            for event in b.open_message():
                yield event
        async for update in drain.until_cut(b.generation.updates()):
            if update is None:  # the drain's deadline
                reason = "abort"
                break
            if update.error is not None:
                yield b.event("error", code=update.error.code, message=update.error.message, param=None)
                error = {"code": "server_error", "message": update.error.message}
                yield b.event("response.failed", response=b.response(b.text + update.text, "error", error))
                return
            reason = update.finish_reason or reason
            for event in b.text_events(*(("", update.text) if split is None else split.feed(update.text))):
                yield event
        for event in b.text_events(*(("", "") if split is None else split.finish())):
            yield event
        for event in b.open_message():  # a reply that was all reasoning still ends with its (empty) message
            yield event
        status, text = _STATUS.get(reason, "completed"), b.text
        yield b.event("response.output_text.done", text=text, logprobs=[], **b.where)
        yield b.event("response.content_part.done", part=b.part(text), **b.where)
        yield b.event("response.output_item.done", output_index=b.where["output_index"], item=b.item(text, status))
        yield b.event(f"response.{status}", response=b.response(text, reason))
    finally:
        b.generation.abort()  # no-op once finished; frees a disconnected client's blocks
