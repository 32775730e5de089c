"""`kestrel serve`: take the port, load the model in the engine process, serve HTTP, shut down cleanly.

Order matters for a clear failure: config errors first, then the port (so a taken port fails in a
second, not after loading the model), then the tokenizer and the model. On SIGINT/SIGTERM uvicorn
stops accepting connections and lets running requests finish for `GRACEFUL_SHUTDOWN_S` seconds;
whatever still runs is then cancelled (aborting its engine requests), and the engine process exits.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn

from kestrel.config import EngineConfig
from kestrel.engine.tokenizer import load_tokenizer
from kestrel.server.app import build_app
from kestrel.server.engine_client import EngineClient, EngineStartError
from kestrel.server.metrics import ServerMetrics
from kestrel.server.state import ServerState

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 30


class ServerStartError(RuntimeError):
    """The server cannot start: port taken, or the model does not load."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or ServerStartError naming the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ServerStartError(f"cannot resolve --host {host!r}: {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart right after a stop (TIME_WAIT)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServerStartError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running "
                               "there? choose another --port)") from None
    return sock


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit and sockets:
            host = self.config.host
            print(f"ready on {url(host, sockets[0].getsockname()[1])}", flush=True)


def serve(config: EngineConfig, served_model_name: str | None = None) -> None:
    """Run the server until SIGINT/SIGTERM. Raises ServerStartError (or ValueError for bad config)."""
    name = served_model_name or config.model.model  # as the user named it ("demo"), not the resolved folder
    config = config.resolve()
    server_config = config.server
    sock = bind(server_config.host, server_config.port)
    client: EngineClient | None = None
    try:
        tokenizer = load_tokenizer(config.model.tokenizer or config.model.model, required=False)
        metrics = ServerMetrics(name)
        try:
            client = EngineClient.launch(config, server_config.log_level, metrics)
        except EngineStartError as e:
            raise ServerStartError(str(e)) from None
        state = ServerState(client, tokenizer, name, config.model.model, metrics, server_config.api_key)
        debug = server_config.log_level.lower() == "debug"
        uv_config = uvicorn.Config(build_app(state), host=server_config.host, log_config=None, access_log=debug,
                                   timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off")
        # uvicorn re-raises the signal that stopped it once it is done; make that a no-op here so the
        # engine process is shut down below and the exit is clean.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        asyncio.run(_serve(_Server(uv_config), sock, client))
    finally:
        sock.close()
        if client is not None and client.process.is_alive():  # start-up failed after the engine loaded
            client.process.kill()
            client.process.join()


async def _serve(server: _Server, sock: socket.socket, client: EngineClient) -> None:
    client.start()
    try:
        await server.serve(sockets=[sock])
    finally:
        await client.shutdown()
    logger.info("server stopped")
