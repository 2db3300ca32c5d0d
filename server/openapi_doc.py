"""/openapi.json as the server really answers: errors are OpenAI bodies with their real status codes.

FastAPI documents a 422 with its own ``HTTPValidationError`` body on every route that validates input, while
kvserve answers invalid input with a 400 and ``{"error": {"message", "type", "param", "code"}}``
(server/app.py). Schema-driven clients and fuzzers (schemathesis) check responses against this document, so it
names the codes kvserve sends instead.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from kvserve.server.drain import GENERATION_PATHS


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Body of every 4xx and 5xx answer."""

    error: ErrorDetail


_REF = "#/components/schemas/ErrorResponse"
# status -> (description, applies to): "body" routes that read a JSON body, "key" routes behind --api-key,
# "generate" the generation routes (server.drain names them), "model" routes that name a model, "all" every route
_ERRORS = {
    "400": ("invalid request: the message names the field (param); on a generation route also a reply that "
            "stopped short of its grammar (code constraint_unsatisfied); on any route a malformed or repeated Host "
            "header (code invalid_host)", "all"),
    "401": ("missing or wrong API key (only when the server has --api-key); carries WWW-Authenticate: Bearer", "key"),
    "404": ("no such model", "model"),
    "408": ("the request body did not arrive within --body-timeout-seconds", "body"),
    "413": ("request body over --max-request-bytes (decompressed, for a gzip body)", "body"),
    "415": ("the body is not sent as application/json, or with a Content-Encoding other than gzip", "body"),
    "421": ("Host header not allowed (DNS rebinding guard: --allowed-hosts)", "all"),
    "429": ("waiting queue full; Retry-After says when to retry", "generate"),
    "431": ("request headers over the server's limit (server.httpserver)", "all"),
    "500": ("a bug (code internal_error), or on a generation route the engine step failed (engine_error)", "all"),
    "503": ("draining (Retry-After) or the engine loop has stopped", "generate"),
}
# what /health and /live answer while not ready or not alive: their own status object, not an error body
_PROBE_503 = {"description": "not ready (draining, or the engine loop has stopped) or, for /live, not alive",
              "content": {"application/json": {"schema": {"type": "object", "properties": {
                  "status": {"type": "string"}, "error": {"type": "string"}, "inflight": {"type": "integer"}}}}}}
# one server-sent event as schemathesis and other SSE-aware tools read it: its fields, each text (the data is JSON)
_SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"},
                                               "id": {"type": "string"}, "retry": {"type": "integer"}}}
_EVENT_STREAM = {"text/event-stream": {"schema": _SSE_EVENT,
                                       "description": "with \"stream\": true: server-sent events"}}


def _applies(path: str, operation: dict, keyed: set[str]) -> set[str]:
    model = (path in GENERATION_PATHS or path.endswith("/render") or "{model_id" in path
             or path in ("/tokenize", "/detokenize"))
    return {"all", *(("body",) if "requestBody" in operation else ()), *(("key",) if path in keyed else ()),
            *(("generate",) if path in GENERATION_PATHS else ()), *(("model",) if model else ())}


# request fields that hold token ids: (schema, property); their integers are ids of the served model's vocabulary
_TOKEN_ID_FIELDS = (("DetokenizeRequest", "tokens"), ("CompletionRequest", "prompt"),
                    ("CompletionRequest", "stop_token_ids"), ("ChatCompletionRequest", "stop_token_ids"))


def _bound_token_ids(components: dict, below: int) -> None:
    """Say in the schemas what ``server.prepare.check_token_ids`` checks: token ids are in [0, ``below`` - 1], and a
    ``logit_bias`` key is such an id written in digits, its value in [-100, 100]."""
    def bound(node) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer":
                node.update(minimum=0, maximum=below - 1)
            for child in node.values():
                bound(child)
        elif isinstance(node, list):
            for child in node:
                bound(child)

    for name, field in _TOKEN_ID_FIELDS:
        prop = components.get(name, {}).get("properties", {}).get(field)
        if prop is not None:
            bound(prop)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        for option in components.get(name, {}).get("properties", {}).get("logit_bias", {}).get("anyOf", ()):
            if option.get("type") == "object":
                option["propertyNames"] = {"pattern": "^[0-9]{1,12}$"}
                option["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}


def openapi_schema(app: FastAPI) -> dict:
    """The app's OpenAPI document with FastAPI's 422 replaced by the answers kvserve sends (cached): the error
    statuses of each route, /health's and /live's 503, and the event stream of a generation route."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    keyed = {route.path_format for route in app.routes if isinstance(route, APIRoute) and route.dependencies}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            applies = _applies(path, operation, keyed)
            for status, (description, where) in _ERRORS.items():
                if where in applies:
                    responses[status] = {"description": description,
                                         "content": {"application/json": {"schema": {"$ref": _REF}}}}
            if path in ("/health", "/live"):
                responses["503"] = _PROBE_503
            if path in GENERATION_PATHS:
                responses["200"].setdefault("content", {}).update(_EVENT_STREAM)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    state = getattr(app.state, "kvserve", None)
    if state is not None:
        _bound_token_ids(components, state.token_ids_below)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    app.openapi_schema = schema
    return schema
