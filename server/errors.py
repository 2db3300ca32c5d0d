"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_exceeded",
          500: "internal_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error to return to the client.

    Args:
        status: HTTP status code.
        message: human-readable message (counts and limits included where relevant).
        param: the request field at fault, if any.
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
