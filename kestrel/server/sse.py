"""Server-sent events, and noticing a client that left, for streaming and non-streaming answers.

A client that disconnects must free its KV at once, not when its request would have ended: both
helpers watch the ASGI `receive` channel for `http.disconnect` next to the work, and the caller's
`on_close` (which aborts the engine requests still running) always runs at the end.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kestrel.server.errors import APIError

T = TypeVar("T")
logger = logging.getLogger(__name__)


def sse_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_stream(payloads: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """One event per payload, then [DONE]. An APIError raised mid-stream (the engine died, a step
    failed) is sent as its error body before [DONE]; so is any other exception (a bug), after logging
    it: the client gets a well-formed end and the connection stays usable either way."""
    try:
        async for payload in payloads:
            yield sse_event(payload)
    except APIError as e:
        yield sse_event(e.body())
    except Exception as e:
        logger.exception("unhandled error while streaming a response")
        yield sse_event(APIError(500, f"internal server error: {type(e).__name__}: {e}").body())
    yield SSE_DONE


async def named_sse_stream(events: AsyncIterator[tuple[str, Any]],
                           error_event: Callable[[APIError], tuple[str, Any]]) -> AsyncIterator[bytes]:
    """Events named by their type (`event: NAME` before each payload), as Anthropic's Messages and OpenAI's
    Responses stream them, with no [DONE]; an error mid-stream is sent as `error_event(error)` and ends
    the stream, as `sse_stream` does."""
    def named(name: str, payload: Any) -> bytes:
        return f"event: {name}\n".encode() + sse_event(payload)

    try:
        async for name, payload in events:
            yield named(name, payload)
    except APIError as e:
        yield named(*error_event(e))
    except Exception as e:
        logger.exception("unhandled error while streaming a response")
        yield named(*error_event(APIError(500, f"internal server error: {type(e).__name__}: {e}")))


class ClientGone(Exception):
    pass


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then raise ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


class EventStream(StreamingResponse):
    """An SSE response of the `events` byte chunks; `on_close()` runs however the stream ends."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, pump())
        except (ClientGone, OSError):
            pass  # the client left: nothing to send it
        finally:
            self.on_close()
