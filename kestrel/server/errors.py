"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable_error"}


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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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
