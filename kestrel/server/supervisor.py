"""Restarting the engine process when it dies, in the same server process.

When the engine process dies (killed, out of memory, a crash), or the client's own sender thread or
dispatcher task fails (its pipes are then in an unknown state), `EngineClient` fails the requests it
had with 503 `engine_dead` and `/metrics` shows `kestrel:engine_alive 0`. The supervisor then starts
a new engine process, which loads the model again; meanwhile new requests get 503 `engine_dead` and
`/health` 503. Once it is ready, the new client takes the old one's place and the server serves again
(`kestrel:engine_restarts_total` counts these). If the new process cannot load the model, the
server shuts down with exit status 1, for a service manager to act on.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kestrel.config import EngineConfig
from kestrel.server.engine_client import EngineClient, EngineLaunch, EngineStartError
from kestrel.server.state import ServerState

logger = logging.getLogger(__name__)


class EngineSupervisor:
    def __init__(self, state: ServerState, config: EngineConfig, log_level: str,
                 on_fatal: Callable[[], None]) -> None:
        self.state = state
        self.config = config
        self.log_level = log_level
        self.on_fatal = on_fatal  # the restart failed: shut the server down, exit status 1
        self._launch: EngineLaunch | None = None
        self._restart: asyncio.Task[None] | None = None
        self._closed = False

    def watch(self, client: EngineClient) -> None:
        client.on_dead = self._on_dead

    def _on_dead(self) -> None:
        if self._closed or self.state.admission.stopping:
            return  # shutting down anyway: nothing to restart for
        self._restart = asyncio.get_running_loop().create_task(self._run_restart(), name="kestrel-engine-restart")

    async def _run_restart(self) -> None:
        dead = self.state.client
        await dead.shutdown(timeout=5.0)  # reaps the process, stops its sender thread, closes its pipes
        if self._closed:  # the server began stopping meanwhile: no new engine
            return
        logger.warning("starting a new engine process (the model loads again; requests get 503 meanwhile)")
        self._launch = EngineLaunch(self.config, self.log_level)
        try:
            client = await asyncio.to_thread(self._launch.wait, self.state.metrics)
        except EngineStartError as e:
            if not self._closed:
                logger.error("could not restart the engine process: %s; shutting the server down", e)
                self.on_fatal()
            return
        finally:
            self._launch = None
        if self._closed:  # the server stopped while the model loaded
            await client.shutdown()
            return
        client.start()
        self.watch(client)
        self.state.client = client
        self.state.metrics.engine_restarts.inc()
        logger.info("the new engine process (pid %d) is ready", client.info.pid)

    async def close(self) -> None:
        """Stop a restart in progress (killing the process that is loading the model)."""
        self._closed = True
        if self._launch is not None:
            self._launch.kill()
        if self._restart is not None:
            await self._restart
