"""Admission: a chat or completions body becomes a queued Generation, or a 4xx/429/503.

One home for what the chat, completions and Responses routes share: the size limits checked before any work,
tokenizing long prompts off the event loop, compiling a grammar, the prefix-cache partition, and queuing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

from fastapi import Request

from kvserve.scheduler.service import QueueFull
from kvserve.server import structured
from kvserve.server.auth import ApiKeys
from kvserve.server.errors import ApiError
from kvserve.server.generation import Generation
from kvserve.server.prepare import Prepared, prepare
from kvserve.server.prompts import PromptGroups, prepare_prompts
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest
from kvserve.server.state import ServerState

# Prompts longer than this (characters) are tokenized on a worker thread: megabytes take seconds to tokenize, and
# on the event loop that would stall every other stream (the tokenizer releases the GIL while it works).
_TOKENIZE_OFF_LOOP_CHARS = 32_768
# A chat template's work grows with its messages (and tool definitions) as well as their characters: 29,000
# one-character messages (870 KB, under the body limit) took ~1 s to render, stalling every stream. Each counts
# as this many characters of work, so a chat of more than 128 messages is rendered off the loop.
_CHARS_PER_MESSAGE = 256


# At most this many long prompts are tokenized (or templated) at once, off the loop: a flood of them waits here
# instead of taking every worker thread of the loop's default executor.
_TOKENIZING = asyncio.Semaphore(2)


def check_model(state: ServerState, model: str | None) -> None:
    """A request's ``model``: none, one of this server's served names or ``default``.

    Raises:
        ApiError: 404 (OpenAI's model_not_found) naming the models this server serves.
    """
    if model is not None and model not in (*state.model_names, "default"):
        named = " or ".join(repr(name) for name in state.model_names[:4])
        more = len(state.model_names) - 4
        # a client's name echoed at most 80 characters long (a megabyte of it is not sent back)
        raise ApiError(404, f"model {model[:80]!r}{'...' if len(model) > 80 else ''} does not exist; this server "
                            f"serves {named}{f' (and {more} more: GET /v1/models)' if more > 0 else ''}",
                       param="model", code="model_not_found")


async def tokenizing(chars: int, fn: Callable, *args):
    """``fn(*args)``: on the event loop for a short prompt, else on a worker thread, two at a time."""
    if chars <= _TOKENIZE_OFF_LOOP_CHARS:
        return fn(*args)
    async with _TOKENIZING:
        return await asyncio.to_thread(fn, *args)


def chat_work(messages: list, tools: list | None) -> int:
    """Rendering and tokenizing work of chat ``messages`` (and ``tools``), in characters (``tokenizing``'s unit):
    their text and tool definitions' JSON, and ``_CHARS_PER_MESSAGE`` for each message and tool the template loops
    over."""
    return (sum(len(message.text) for message in messages) + _CHARS_PER_MESSAGE * (len(messages) + len(tools or ()))
            + sum(len(json.dumps(tool)) for tool in tools or ()))  # a tool's schema is rendered whole


def _prompt_chars(body: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(body, ChatCompletionRequest):
        return chat_work(body.messages, body.tools)
    return sum(len(prompt) for prompt in body.prompts if isinstance(prompt, str))


def _check_request_size(state: ServerState, body, completions: bool) -> None:
    """Refuse, before tokenizing or queuing anything, a request that could never be admitted whole: more prompts
    than ``--max-prompts-per-request``, or more sequences (prompts x choices) than the server holds at once
    (``--max-num-seqs`` running + ``--max-queue`` waiting). Otherwise one body could fill the queue for everyone."""
    config = state.config
    prompts = len(body.prompts) if completions else 1
    if prompts > config.max_prompts_per_request:
        raise ApiError(400, f"this request has {prompts} prompts; at most {config.max_prompts_per_request} are "
                            "allowed per request (--max-prompts-per-request)", param="prompt")
    sequences = prompts * (body.candidates if completions else body.n)
    capacity = config.max_num_seqs + config.max_queue
    if sequences > capacity:
        raise ApiError(400, f"this request needs {sequences} sequences ({prompts} prompt(s) x "
                            f"{sequences // prompts} choices); this server holds at most {capacity} at once "
                            "(--max-num-seqs + --max-queue)", param="n")


async def prepare_request(state: ServerState, body, request: Request) -> list[Prepared]:
    """Check and tokenize a chat or completions body as its generation route does, queuing nothing: one
    ``Prepared`` per prompt (a chat body has one). The render routes (server.render) answer with exactly these
    token ids, so a router that renders a request sees the tokens the server will prefill.

    Raises:
        ApiError: 404 for a model this server does not serve; 400 for a request over the size limits, a prompt
            ``prepare`` refuses or a grammar that does not compile.
    """
    check_model(state, body.model)
    completions = isinstance(body, CompletionRequest)
    _check_request_size(state, body, completions)
    prepare_all = prepare_prompts if completions else prepare
    prepared = await tokenizing(_prompt_chars(body), prepare_all, state, body)
    grammar = await structured.compile_request(state, body)  # on a worker thread; cached by schema
    salt, tenant = ApiKeys.cache_salt(request, body.cache_salt), ApiKeys.tenant(request)
    owner = getattr(request.state, "key_owner", None)
    prepared = prepared if completions else [prepared]
    for one in prepared:
        one.grammar, one.cache_salt, one.tenant, one.owner = grammar, salt, tenant, owner
    return prepared


async def admit(state: ServerState, body, request: Request) -> Generation | PromptGroups:
    """Prepare (``prepare_request``) and queue a request, or raise ApiError (its 4xx, 429 full queue, 503 dead
    engine).

    Its sequences use the prefix-cache partition of its API key and its ``cache_salt``, and belong to its key's
    tenant or its tenant header's (server.auth).
    """
    completions = isinstance(body, CompletionRequest)
    with _refusals(state):  # a full queue refuses before the prompt is tokenized; the check at start decides
        state.service.check_room((len(body.prompts) if completions else 1)
                                 * (body.candidates if completions else body.n))
    prepared = await prepare_request(state, body, request)
    if completions:  # one prompt or several, numbered as OpenAI numbers them
        generation = PromptGroups(state, prepared, body.n, body.prompts)
    else:
        generation = Generation(state, prepared[0])
    with _refusals(state):
        generation.start()
    return generation


@contextlib.contextmanager
def _refusals(state: ServerState):
    """QueueFull as a 429 with Retry-After, a dead engine loop as a 503."""
    try:
        yield
    except QueueFull as exc:
        state.metrics.rejected.labels(reason="queue_full").inc()
        raise ApiError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after_s)}) from exc
    except RuntimeError as exc:
        raise ApiError(503, str(exc)) from exc
