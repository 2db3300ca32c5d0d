"""/openapi.json as the server really answers: errors are OpenAI bodies with their real status codes.

FastAPI documents a 422 with its own ``HTTPValidationError`` body on every route that validates input, while
kvserve answers invalid input with a 400 and ``{"error": {"message", "type", "param", "code"}}``
(server/app.py). Schema-driven clients and fuzzers (schemathesis) check responses against this document, so it
names the codes kvserve sends instead.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


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
# status -> (description, applies to): "body" routes that read a JSON body, "v1" routes behind --api-key,
# "generate" the two completion routes, "model" routes that name a model, "all" every route
_ERRORS = {
    "400": ("invalid request: the message names the field (param)", "body"),
    "401": ("missing or wrong API key (only when the server has --api-key); carries WWW-Authenticate: Bearer", "v1"),
    "404": ("no such model", "model"),
    "413": ("request body over --max-request-bytes", "body"),
    "415": ("the body is not sent as application/json", "body"),
    "421": ("Host header not allowed (DNS rebinding guard: --allowed-hosts)", "all"),
    "429": ("waiting queue full; Retry-After says when to retry", "generate"),
    "503": ("the engine loop has stopped", "generate"),
}


def openapi_schema(app: FastAPI) -> dict:
    """The app's OpenAPI document with FastAPI's 422 replaced by the error answers kvserve sends (cached)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            applies = {"all", *(("body",) if "requestBody" in operation else ()),
                       *(("v1",) if path.startswith("/v1/") else ()),
                       *(("generate", "model") if path.endswith("completions") else ()),
                       *(("model",) if "{model_id" in path else ())}
            for status, (description, where) in _ERRORS.items():
                if where in applies:
                    responses[status] = {"description": description,
                                         "content": {"application/json": {"schema": {"$ref": _REF}}}}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    app.openapi_schema = schema
    return schema
