"""Graceful shutdown on SIGTERM or SIGINT: stop admitting, let running requests finish, abort the rest.

1. New generation requests and /health get 503 (`server_shutting_down`), so a load balancer moves
   on; the socket stays open meanwhile, so no client sees a refused connection.
2. The running requests get `--shutdown-timeout` seconds to finish.
3. The rest are aborted: a stream ends with a chunk whose finish_reason is "abort", then [DONE]; a
   non-streaming request answers with what it has, finish_reason "abort".
4. uvicorn stops, the engine process exits, and so does the server, with status 0.
A second signal skips the wait of step 2. Nothing is cancelled mid-response, so nothing logs a traceback.

After step 2 the process ends within `SHUTDOWN_MARGIN_S`: aborted requests end within an engine
step (`ABORT_GRACE_S` bounds a wedged engine), uvicorn closes the connections (`CONNECTION_GRACE_S`
bounds one still sending its request), the engine process exits without the interpreter's teardown
(killed after `engine_client.ENGINE_EXIT_TIMEOUT_S`), and so do the tokenizer workers and this process
(see `process_exit`). Measured on 2 busy CPU cores with 20 streams: about 1 s.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import uvicorn

from kestrel.server.admission import AdmissionControl

logger = logging.getLogger(__name__)

# Aborted requests end within one engine step; this only bounds a wedged engine.
ABORT_GRACE_S = 2.0
# Every request has ended when uvicorn stops; this only bounds a connection still sending its request.
CONNECTION_GRACE_S = 1.0
# What the README promises on top of --shutdown-timeout: the graces above, the engine's exit, slack.
SHUTDOWN_MARGIN_S = 5.0


class Drain:
    def __init__(self, admission: AdmissionControl, timeout: float, stop_server: Callable[[], None]) -> None:
        self.admission = admission
        self.timeout = timeout
        self.stop_server = stop_server
        self.exit_code = 0
        self._hurry = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def begin(self, exit_code: int = 0, timeout: float | None = None) -> None:
        """Start draining (call on the event loop); called again, skip the wait for running requests."""
        self.exit_code = max(self.exit_code, exit_code)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(self.timeout if timeout is None else timeout), name="kestrel-drain")
        else:
            self._hurry.set()

    async def _run(self, timeout: float) -> None:
        admission = self.admission
        admission.stop()
        if admission.num_requests:
            logger.info("shutting down: waiting up to %.0f s for %d running requests (a second signal "
                        "aborts them now)", timeout, admission.num_requests)
        if not await admission.wait_idle(timeout, self._hurry):
            logger.info("shutting down: aborting the %d requests still running", admission.num_requests)
            admission.abort_all()
            if not await admission.wait_idle(ABORT_GRACE_S):
                logger.warning("%d requests did not end within %.0f s of their abort", admission.num_requests,
                               ABORT_GRACE_S)
        self.stop_server()


class Server(uvicorn.Server):
    """uvicorn, with signals handed to a `Drain` instead of stopping at once, and a ready line."""

    def __init__(self, config: uvicorn.Config, ready_url: Callable[[int], str]) -> None:
        super().__init__(config)
        self.ready_url = ready_url
        self.drain: Drain | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if not self.should_exit and sockets:
            print(f"ready on {self.ready_url(sockets[0].getsockname()[1])}", flush=True)

    def handle_exit(self, sig: int, frame: object) -> None:
        # Runs in the signal handler, between two bytecodes of the event loop's thread: hand over to
        # the loop. Not recording the signal also keeps uvicorn from raising it again on the way out.
        if self._loop is None or self.drain is None:
            self.should_exit = True  # not serving yet: stop at once
            return
        self._loop.call_soon_threadsafe(self.drain.begin)

    def stop(self) -> None:
        self.should_exit = True
