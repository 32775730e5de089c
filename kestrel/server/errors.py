"""HTTP errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and on Anthropic's
routes (`/v1/messages...`) in Anthropic's, `{"type": "error", "error": {"type", "message"}}`: each API's
clients read their own."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable_error"}
# Anthropic's error types by status (its API answers 529 where kestrel answers 503: overloaded).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers  # e.g. Retry-After on a 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape has no `param`: the message names the field (ours all do)."""
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer on route `path`, in that API's error shape."""
        body = self.anthropic_body() if speaks_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_validation_error(err: ValidationError) -> APIError:
    """The first invalid field of a request body, as a 400 naming it (all alternatives of a union)."""
    errors = err.errors(include_url=False)
    loc = errors[0]["loc"]
    if not loc:
        return bad_request(f"the request body must be a JSON object: {errors[0]['msg']}")
    field = str(loc[0])
    same = [e for e in errors if e["loc"] and str(e["loc"][0]) == field]
    if any(e["type"] == "missing" for e in same):
        return bad_request(f"'{field}' is required", field)
    path = ".".join(str(p) for p in loc if isinstance(p, int) or p == loc[0])
    reasons = "; or ".join(dict.fromkeys(e["msg"] for e in same))
    return bad_request(f"invalid '{path}': {reasons}", field)
