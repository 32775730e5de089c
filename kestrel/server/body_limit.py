"""The request body's size limit (`--max-request-bytes`), enforced before the body is parsed.

A body that announces a larger `Content-Length` is answered 413 at once, without reading a byte of
it; a chunked one is counted as it arrives and answered 413 as soon as it passes the limit, so the
HTTP process never holds more than the limit for one request. uvicorn discards the part of the body
nobody read, so a client that sends it all still reads the 413 and may reuse the connection.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kestrel.server.errors import APIError


def _too_large(max_bytes: int, size: int | None) -> APIError:
    has = f"has {size} bytes" if size is not None else f"is larger than {max_bytes} bytes"
    return APIError(413, f"the request body {has}; this server accepts at most {max_bytes} bytes "
                         "(--max-request-bytes)", code="request_too_large")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)  # the HTTP parser (h11) already rejected malformed values
    return None


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = _content_length(scope)
        if size is not None and size > self.max_bytes:
            await _too_large(self.max_bytes, size).response()(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes, None)  # the app's APIError handler answers it
            return message

        await self.app(scope, counted_receive, send)
