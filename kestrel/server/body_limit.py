"""The request body's limits, enforced while it is read: its size (`--max-request-bytes`) and the
time between two of its reads (`--request-read-timeout`).

A body that announces a larger `Content-Length` is answered 413 at once, without reading a byte of
it; a chunked one is counted as it arrives and answered 413 as soon as it passes the limit, so the
HTTP process never holds more than the limit for one request. uvicorn discards the part of the body
nobody read, so a client that sends it all still reads the 413 and may reuse the connection.

A client that stops sending its body is answered 408 and the connection closed, instead of holding
it (and the request's coroutine) forever. Once the body is complete, waiting on `receive` means
waiting for a disconnect, which has no time limit.
"""
from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kestrel.server.errors import APIError


def _too_large(max_bytes: int, size: int | None) -> APIError:
    has = f"has {size} bytes" if size is not None else f"is larger than {max_bytes} bytes"
    return APIError(413, f"the request body {has}; this server accepts at most {max_bytes} bytes "
                         "(--max-request-bytes)", code="request_too_large")


def _too_slow(read_timeout: float) -> APIError:
    return APIError(408, f"no part of the request body arrived for {read_timeout:g} s (--request-read-timeout); "
                         "send the whole body without pausing", code="request_timeout",
                    headers={"Connection": "close"})  # what is left of the body will not be read


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)  # the HTTP parser (h11) already rejected malformed values
    return None


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = _content_length(scope)
        if size is not None and size > self.max_bytes:
            await _too_large(self.max_bytes, size).response(scope["path"])(scope, receive, send)
            return
        received = 0
        body_done = False

        async def checked_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                raise _too_slow(self.read_timeout) from None  # the app's APIError handler answers it
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes, None)
            else:  # http.disconnect: nothing more will come
                body_done = True
            return message

        await self.app(scope, checked_receive, send)
