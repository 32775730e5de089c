"""Closing connections whose request headers do not arrive (`--request-read-timeout`).

uvicorn times out a connection only between two requests (keep-alive, 5 s); one that connects and
sends nothing, or half a request line and headers, is held open forever, and a few thousand such
connections exhaust the server's file descriptors. Here a connection has `--request-read-timeout`
seconds from connecting, and from the first byte of each later request, until its headers are
complete; otherwise it is closed (no response: HTTP cannot answer a request it has not read). The
size of the headers is h11's bound (16 KiB). A body that stops arriving is `body_limit`'s business:
the application is reading it by then, and answers 408.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderTimeoutProtocol(H11Protocol):
    header_timeout: float  # set by `header_timeout_protocol`
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are complete: the request is being served
            self._disarm()
        elif self._header_timer is None and not self.transport.is_closing():  # a later request began
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_overdue)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take over `timeout` seconds."""
    return type("HeaderTimeoutH11Protocol", (_HeaderTimeoutProtocol,), {"header_timeout": timeout})
