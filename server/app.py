"""The FastAPI app: OpenAI-compatible routes, SSE streaming, health, metrics, tokenize.

Every request is validated, tokenized, checked against the limits and admitted (or refused with 429)
before a response starts, so a bad streaming request gets the same JSON error as a non-streaming one and
no SSE byte is ever sent for it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from kvserve.server import tools
from kvserve.server.auth import ApiKeys
from kvserve.server.admission import admit, chat_work, check_model, tokenizing
from kvserve.server.bodylimit import BodyLimit
from kvserve.server.drain import Drain, DrainGate
from kvserve.server.errors import ApiError
from kvserve.server.choice import ChoiceUpdate
from kvserve.server.generation import Generation, until_done_or_gone
from kvserve.server.prepare import chat_prompt_ids, check_token_ids, completion_text_ids
from kvserve.server.hostguard import HostGuard, HostPolicy
from kvserve.server.openai_format import Formatter
from kvserve.server.prompts import PromptGroups
from kvserve.server import livepage, render, responses
from kvserve.server.requestids import RequestIds, tokenizer_info
from kvserve.server.openapi_doc import openapi_schema
from kvserve.server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvserve.server.state import ServerState

# pydantic names the member of a union that failed (``stop.str``, ``input.list[...]``, a model's class name); the
# client only needs the fields and indices
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before",
                  "function-wrap", "function-plain", "literal", "tagged-union"}


def _is_union_member(part: str) -> bool:
    return part.split("[")[0] in _UNION_MEMBERS or part[:1].isupper()  # no request field starts with a capital


def _is_json(content_type: str) -> bool:
    """``application/json`` or ``application/*+json``, parameters ignored (what FastAPI parses as JSON)."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _validation_error(exc: RequestValidationError) -> ApiError:
    """The first pydantic error as an OpenAI 400 naming the field (``messages.0.content``)."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_member(str(part))]
    param = ".".join(loc) or getattr(first.get("ctx", {}).get("error"), "param", None)
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if not loc and param and message.startswith(f"{param}: "):  # a BodyError names its place itself
        return ApiError(400, message, param=param)
    if param is None and first.get("type") == "missing":
        message = "the request body is required (a JSON object)"
    if first.get("type") == "extra_forbidden":
        message = "unrecognized request argument: kvserve does not serve this field (docs/api.md lists those it does)"
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


def create_app(state: ServerState, drain: Drain | None = None) -> FastAPI:
    """Build the app around a ServerState; the scheduler loop runs for the app's lifetime.

    ``drain`` (default: a new one) is shared with the server that runs the app: its SIGTERM handler sets
    it draining, which /health and the generation routes then answer with 503 (server/drain.py).
    """
    drain = drain or Drain()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.service.start()
        yield
        await state.service.stop()
        state.close()

    keys = ApiKeys(state.config.api_keys, isolate_cache=not state.config.share_cache_across_keys,
                   admin_keys=state.config.admin_keys)

    def require_key(request: Request) -> None:
        """/v1 routes and the tokenizer's need ``Authorization: Bearer <key>`` when the server has API keys."""
        keys.check(request)

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.kvserve = state
    app.state.drain = drain
    app.add_middleware(BodyLimit, limit=state.max_request_bytes, timeout_s=state.config.body_timeout_s)
    if state.config.allowed_origins:  # CORS: inside the Host guard, so a preflight from a rebinding page is a 421
        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.allowed_origins), max_age=600,
                           # any header: the openai JS SDK sends its x-stainless-* headers besides authorization
                           allow_methods=["GET", "HEAD", "POST", "OPTIONS"], allow_headers=["*"],
                           expose_headers=["x-request-id", "Retry-After"])
    app.add_middleware(HostGuard, policy=HostPolicy.for_server(state.config.host, state.config.allowed_hosts))
    app.add_middleware(DrainGate, drain=drain, on_refused=state.metrics.rejected.labels(reason="draining").inc)
    app.add_middleware(RequestIds)  # outermost: a 413 or 421 carries the request id too
    app.openapi = lambda: openapi_schema(app)  # 400 with OpenAI's error body, not FastAPI's 422
    v1 = [Depends(require_key)]

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        content_type = request.headers.get("content-type")
        has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        if (content_type is None and has_body) or (content_type is not None and not _is_json(content_type)):
            # the body was not parsed at all: say why (curl -d without -H sends a form). Refusing, not guessing,
            # also keeps a web page's cross-origin form post from driving a local server.
            got = "no Content-Type" if content_type is None else repr(content_type.split(";")[0].strip())
            return ApiError(415, f"the request body must be JSON: send 'Content-Type: application/json' (got {got})",
                            code="unsupported_media_type").response()
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:
            return _method_not_allowed(request).response()
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's, for any cause
            try:
                (await request.body()).decode("utf-8")
            except UnicodeDecodeError as bad:  # JSON's encoding is UTF-8 (RFC 8259), whatever charset is declared
                return ApiError(400, f"the request body is not valid UTF-8 (byte {bad.start} is not): JSON text "
                                "is UTF-8, whatever the Content-Type's charset says").response()
        return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.get("/health")
    @app.head("/health")  # a route each: GET and HEAD get operation ids of their own in /openapi.json
    async def health():
        """Readiness: 200 only while this replica takes new requests (routers and readiness probes ask)."""
        if not state.service.healthy:
            return JSONResponse({"status": "unhealthy", "error": repr(state.service.dead)}, status_code=503)
        if drain.draining:
            return JSONResponse({"status": "draining", "inflight": drain.inflight}, status_code=503,
                                headers=drain.refusal().headers)
        return {"status": "ok"}

    @app.get("/live")
    @app.head("/live")  # a route each: GET and HEAD get operation ids of their own in /openapi.json
    async def live():
        """Liveness: 200 while the engine loop runs, draining or not (a draining pod must not be restarted)."""
        if not state.service.healthy:
            return JSONResponse({"status": "unhealthy", "error": repr(state.service.dead)}, status_code=503)
        return {"status": "draining" if drain.draining else "ok"}

    # /metrics is open by default, as vLLM's (Prometheus scrapes without a secret, and it holds counts, never text);
    # --metrics-require-key puts it behind the keys like /v1
    @app.get("/metrics", response_class=Response, dependencies=v1 if state.config.metrics_require_key else [],
             responses={200: {
        "description": "Prometheus text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # created: when this server made the model servable (OpenAI's field is a Unix time; 0 read as 1970)
    created = int(time.time())
    model_cards = {name: {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                          "max_model_len": state.max_request_tokens} for name in state.model_names}

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": list(model_cards.values())}

    @app.get("/v1/models/{model_id:path}", dependencies=v1)
    async def model(model_id: str):
        if model_id not in model_cards:
            raise ApiError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found")
        return model_cards[model_id]

    async def pooling_not_served(request: Request):
        raise ApiError(400, f"{request.url.path} is not served: {state.model_name} is a generative model (it "
                            "gives next-token logits, not pooled embeddings or scores); use /v1/chat/completions, "
                            "/v1/completions or /v1/responses", param="model", code="model_not_supported")

    for path in POOLING_PATHS:  # vLLM's pooling endpoints: named, never a bare 404
        app.add_api_route(path, pooling_not_served, methods=["POST"], dependencies=v1, include_in_schema=False)

    def _error(description: str) -> dict:
        return {"description": description,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}

    @app.post("/reset_prefix_cache", dependencies=v1, responses={
        403: _error("with API keys, a key that is not an --admin-key"),
        409: _error("requests hold KV blocks: the cache is reset only when the server is idle"),
        503: _error("the engine loop has stopped")})
    async def reset_prefix_cache(request: Request):
        """vLLM's route: empty the prefix cache (KV events: AllBlocksCleared). With API keys, an admin key's only
        (one key must not flush, nor time, the others' caches); 409 while requests hold blocks."""
        if state.config.api_keys and not request.state.key_admin:
            raise ApiError(403, "resetting the prefix cache needs an --admin-key", code="permission_denied")
        try:
            reset = await state.service.reset_prefix_cache()
        except RuntimeError as exc:
            raise ApiError(503, str(exc), code="engine_dead") from None
        if not reset:
            raise ApiError(409, "requests still hold KV blocks: the prefix cache is reset only when the server is "
                           "idle; retry then", code="busy")
        return {"reset": True}

    @app.post("/tokenize", dependencies=v1)
    async def tokenize(body: TokenizeRequest):
        check_model(state, body.model)
        tools.functions(body)  # tools and tool_choice checked as a chat request checks them, used or not
        if body.messages is not None:
            ids = await tokenizing(chat_work(body.messages, body.tools), chat_prompt_ids, state, body.messages, body,
                                   body.add_generation_prompt)
        else:
            ids = await tokenizing(len(body.prompt), completion_text_ids, state, body.prompt, body.add_special_tokens)
        reply = {"tokens": ids, "count": len(ids), "max_model_len": state.max_request_tokens}
        if body.return_token_strs:
            reply["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return reply

    @app.get("/tokenizer_info", dependencies=v1)
    async def get_tokenizer_info():
        return tokenizer_info(state.tokenizer)

    @app.post("/detokenize", dependencies=v1)
    async def detokenize(body: DetokenizeRequest):
        check_model(state, body.model)
        check_token_ids(state, body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(body: ChatCompletionRequest, request: Request):
        return await _complete(state, body, request, chat=True)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(state, body, request, chat=False)

    responses.register(app, state, v1)
    render.register(app, state, v1)
    if state.config.ui:
        livepage.register(app, state, v1)
    _head_like_get(app)
    return app


def _head_like_get(app: FastAPI) -> None:
    """A HEAD route beside every GET route that has none (RFC 9110 9.3.2: a server that serves GET serves HEAD;
    Starlette's own routes do, FastAPI's do not): the same endpoint and dependencies, its body left out by the
    HTTP server. Not for a stream (the live page's events), whose endpoint would run until the client left."""
    heads = {route.path for route in app.routes if isinstance(route, APIRoute) and "HEAD" in route.methods}
    for route in list(app.routes):
        if (isinstance(route, APIRoute) and "GET" in route.methods and route.path not in heads
                and not route.path.endswith("/events")):
            app.add_api_route(route.path, route.endpoint, methods=["HEAD"], dependencies=route.dependencies,
                              response_class=route.response_class, include_in_schema=False)


def _method_not_allowed(request: Request) -> ApiError:
    """The 405 of a path served with other methods: ``Allow`` lists every method of every route on the path
    (RFC 9110 15.5.6; Starlette's own names only the first route's, and /health is a GET and a HEAD route)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope | {"method": "GET"})  # any method: a path match is what counts
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    allow = ", ".join(sorted(methods))
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}; allowed: {allow}",
                    code="method_not_allowed", headers={"Allow": allow})


# the endpoints of embedding, scoring and classifying models (vLLM's), which a generative model does not serve
POOLING_PATHS = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank")

async def _complete(state: ServerState, body, request: Request, chat: bool):
    generation = await admit(state, body, request)
    prefix = "chatcmpl-" if chat else "cmpl-"
    # vLLM's form: the response id is the request id (x-request-id when the client sent one)
    fmt = Formatter(generation, chat, prefix + request.state.request_id, state.model_name, state.tokenizer,
                    tool_calls=chat and tools.active(body), thinking=generation.prepared.thinking if chat else None,
                    tool_names=frozenset(f["name"] for f in tools.functions(body)) if chat else frozenset(),
                    tools_constrained=chat and tools.active(body) and body.tool_choice not in (None, "auto"))
    want_logprobs = body.num_logprobs is not None
    echo = (not chat) and body.echo
    prompt_text = generation.prompt_text if echo else None  # index -> the prompt, for echo
    if body.stream:
        return EventSourceResponse(_stream(generation, fmt, body, want_logprobs, echo, prompt_text,
                                           request.app.state.drain),
                                   ping=state.config.sse_ping_s or None, sep="\n")
    return await _collect(generation, fmt, request, want_logprobs, echo, prompt_text)


async def _stream(generation: Generation | PromptGroups, fmt: Formatter, body, want_logprobs: bool, echo: bool,
                  prompt_text: Callable[[int], str] | None, drain: Drain):
    """The SSE events of a streamed reply. Every stream ends with ``[DONE]``: after each choice's final chunk;
    on an engine error or a reply that fell short of its grammar, after that choice's final chunk (finish_reason
    ``error``) and the error object; at the
    drain's deadline after a final chunk with finish_reason ``abort`` for each choice still open."""
    echoed: set[int] = set()
    finished: set[int] = set()
    try:
        async for update in drain.until_cut(generation.updates()):
            if update is None:  # the drain's deadline: the open choices end here, saying so
                for index in sorted(set(range(generation.num_choices)) - finished):
                    yield {"data": json.dumps(fmt.chunk(ChoiceUpdate(index, finish_reason="abort"), want_logprobs))}
                break
            if update.error is not None:
                yield {"data": json.dumps(fmt.chunk(update, want_logprobs))}  # its finish_reason is "error"
                yield {"data": json.dumps(update.error.body())}
                yield {"data": "[DONE]"}
                return
            if not (update.text or update.tokens or update.finish_reason):
                continue
            echo_part = None
            if echo and update.index not in echoed:
                echoed.add(update.index)
                echo_part = fmt.echo_prefix(update.index, prompt_text(update.index), want_logprobs)
            if update.finish_reason is not None:
                finished.add(update.index)
            chunk = fmt.chunk(update, want_logprobs, echo_part)
            if chunk is not None:
                if body.continuous_usage:
                    chunk["usage"] = generation.usage()
                yield {"data": json.dumps(chunk)}
        if body.include_usage:
            yield {"data": json.dumps(fmt.usage_chunk())}
        yield {"data": "[DONE]"}
    finally:
        generation.abort()  # no-op for finished choices; frees a disconnected (or cut) client's blocks


async def _collect(generation: Generation | PromptGroups, fmt: Formatter, request: Request, want_logprobs: bool,
                   echo: bool, prompt_text: Callable[[int], str] | None):
    n = generation.num_choices
    texts = {i: "" for i in range(n)}
    tokens: dict[int, list] = {i: [] for i in range(n)}
    offsets: dict[int, list[int]] = {i: [] for i in range(n)}
    reasons: dict[int, str] = {}

    async def consume() -> None:
        async for update in generation.updates():
            if update.error is not None:
                raise update.error
            texts[update.index] += update.text
            tokens[update.index].extend(update.tokens)
            offsets[update.index].extend(update.offsets)
            if update.finish_reason is not None:
                reasons[update.index] = update.finish_reason

    if not await until_done_or_gone(consume(), request, generation):
        return Response(status_code=499)  # client gone: nobody reads this
    if isinstance(generation, PromptGroups):  # best_of: keep the n best candidates of each prompt
        texts, tokens, reasons, offsets = generation.pick_best(texts, tokens, reasons, offsets)
    echoes = {i: fmt.echo_prefix(i, prompt_text(i), want_logprobs) for i in texts} if echo else {}
    return JSONResponse(fmt.full(texts, tokens, reasons, want_logprobs, echoes, offsets))
