"""Which generation requests the server takes, and ending the ones it took when it shuts down.

A request holds a `Ticket` from the moment its body is parsed (so prompts waiting for the tokenizer
count too) until its response has ended. The server holds at most `capacity` engine requests
(prompts x n): `--max-running-requests` running plus `--max-queued-requests` waiting. Past that a
request gets 503 with Retry-After instead of joining a queue that grows until memory runs out.
After `stop()` (shutdown) every new request gets 503; `abort_all()` ends the ones already taken.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from kestrel.server.errors import APIError, bad_request

T = TypeVar("T")

RETRY_AFTER_S = 1  # overload clears as fast as requests finish: ask again soon


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and takes no new requests; send it to another replica "
                         "or retry once the server is back", code="server_shutting_down")


class Ticket:
    """One HTTP call's claim on the server's capacity; `release()` gives it back (idempotent)."""

    def __init__(self, admission: "AdmissionControl", choices: int) -> None:
        self.choices = choices
        self.aborted = asyncio.Event()
        # Set once the call's engine requests are queued: aborts them, so their streams end properly.
        self.on_abort: Callable[[], None] | None = None
        self._admission = admission
        self._released = False

    async def unless_aborted(self, work: Awaitable[T]) -> T:
        """`work`'s result, or 503 if the server aborts this request first (shutdown)."""
        task = asyncio.ensure_future(work)
        aborted = asyncio.ensure_future(self.aborted.wait())
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
        if not task.done():
            task.cancel()
            raise shutting_down()
        return task.result()

    def abort(self) -> None:
        self.aborted.set()
        if self.on_abort is not None:
            self.on_abort()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self)

    @contextlib.contextmanager
    def released_on_error(self) -> Iterator[None]:
        """Give the ticket back if the block raises; on success its new owner (the response) releases it."""
        try:
            yield
        except BaseException:
            self.release()
            raise


class AdmissionControl:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0  # engine requests of the tickets out
        self.stopping = False
        self._tickets: set[Ticket] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self, choices: int, param: str) -> Ticket:
        """A ticket for `choices` engine requests, or APIError: 503 when full or stopping, 400 when the
        request alone is larger than the whole capacity (it could never be admitted)."""
        if self.stopping:
            raise shutting_down()
        if choices > self.capacity:
            raise bad_request(f"this request asks for {choices} completions (prompts x n); this server holds at "
                              f"most {self.capacity} at once (--max-running-requests + --max-queued-requests)",
                              param)
        if self.in_flight + choices > self.capacity:
            raise APIError(503, f"the server is at capacity ({self.in_flight} of {self.capacity} requests running "
                                "or queued, --max-running-requests + --max-queued-requests); retry shortly",
                           code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        ticket = Ticket(self, choices)
        self._tickets.add(ticket)
        self.in_flight += choices
        self._idle.clear()
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)
        self.in_flight -= ticket.choices
        if not self._tickets:
            self._idle.set()

    @property
    def num_requests(self) -> int:
        """HTTP calls holding a ticket."""
        return len(self._tickets)

    def stop(self) -> None:
        self.stopping = True

    def abort_all(self) -> None:
        for ticket in list(self._tickets):
            ticket.abort()

    async def wait_idle(self, timeout: float, hurry: asyncio.Event | None = None) -> bool:
        """Wait until no ticket is out (True), `timeout` seconds pass or `hurry` is set (False)."""
        waits = {asyncio.ensure_future(self._idle.wait())}
        if hurry is not None:
            waits.add(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=None if math.isinf(timeout) else timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()
