"""`kestrel serve`: take the port, load the model in the engine process, serve HTTP, shut down cleanly.

Order matters for a clear failure: config errors first, then the port (so a taken port fails in a
second, not after loading the model), then the tokenizer (its worker processes start while the
engine process loads the model) and the model. SIGINT/SIGTERM drain the server (see `shutdown`);
an engine process that dies is restarted (see `supervisor`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import socket
from collections.abc import Sequence

import uvicorn

from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.engine.tokenizer import load_tokenizer
from kestrel.server.admission import AdmissionControl
from kestrel.server.app import KESTREL_VERSION, build_app
from kestrel.server.engine_client import EngineClient, EngineStartError
from kestrel.server.metrics import ServerMetrics
from kestrel.server.pooling_model import PoolingConfigError, read_embedder, read_scorer
from kestrel.server.read_timeout import header_timeout_protocol
from kestrel.server.shutdown import CONNECTION_GRACE_S, Drain, Server
from kestrel.server.state import ServerState
from kestrel.server.supervisor import EngineSupervisor
from kestrel.server.tokenization import Tokenization
from kestrel.server.reasoning_parsers import reasoning_parser
from kestrel.server.response_store import ResponseStore
from kestrel.server.tool_parsers import tool_parser

logger = logging.getLogger(__name__)


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


def system_fingerprint(config: EngineConfig) -> str:
    """OpenAI's `system_fingerprint`, fixed for the server's life: kestrel's version and a hash of every engine
    option (the model, dtype, quantization, cache, scheduler, ...; the server section, with its port and API
    key, left out), so that a client sees when the configuration its answers come from changed."""
    options = {section: value for section, value in dataclasses.asdict(config).items() if section != "server"}
    digest = hashlib.sha256(json.dumps(options, default=str, sort_keys=True).encode()).hexdigest()[:8]
    return f"kestrel-{KESTREL_VERSION}-{digest}"


def serve(config: EngineConfig, served_model_names: Sequence[str] = ()) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status (0, or 1 if a dead engine could not
    be restarted). Raises ServerStartError (or ValueError for bad config). With `--node-rank` N > 0,
    run only that node's tensor-parallel ranks (see kestrel.distributed.ranks.run_node_ranks).
    `served_model_names`: the names clients may send, the first one reported (default: the model as given,
    "demo", not the resolved folder)."""
    name, *aliases = served_model_names or [config.model.model]
    config = resolve_config(config)
    if config.parallel.node_rank > 0:  # another node's ranks: no HTTP here, node 0 serves
        from kestrel.distributed.ranks import run_node_ranks
        from kestrel.engine.tokenizer import eos_token_ids

        tokenizer = load_tokenizer(config.model.tokenizer or config.model.model, required=False)
        return run_node_ranks(config, eos_token_ids(config.model.model, tokenizer, config.model.hf_config))
    server_config = config.server
    sock = bind(server_config.host, server_config.port)
    client: EngineClient | None = None
    tokenization: Tokenization | None = None
    try:
        tokenizer = load_tokenizer(config.model.tokenizer or config.model.model, required=False)
        try:
            embedder = read_embedder(config.model.model)
            scorer = read_scorer(server_config.score_template, server_config.score_tokens, tokenizer)
        except PoolingConfigError as e:
            raise ServerStartError(str(e)) from None
        if tokenizer is not None:
            tokenization = Tokenization(tokenizer, server_config.tokenizer_pool_size)
            workers_started = tokenization.start()
        targets = config.scheduler.ttft_target_ms, config.scheduler.itl_target_ms
        metrics = ServerMetrics(name, *(None if t is None else t / 1e3 for t in targets))
        try:
            client = EngineClient.launch(config, server_config.log_level, metrics)
        except EngineStartError as e:
            raise ServerStartError(str(e)) from None
        if tokenization is not None:
            try:
                for started in concurrent.futures.as_completed(workers_started):
                    started.result()
            except Exception as e:
                raise ServerStartError(f"the tokenizer worker processes did not start: {type(e).__name__}: "
                                       f"{e}") from None
        admission = AdmissionControl(config.scheduler.max_running_requests + server_config.max_queued_requests)
        parser = tool_parser(server_config.tool_call_parser) if server_config.tool_call_parser else None
        reasoning = reasoning_parser(server_config.reasoning_parser) if server_config.reasoning_parser else None
        state = ServerState(client, tokenization, name, config.model.model, metrics, admission,
                            server_config.api_key, parser, reasoning, tuple(aliases),
                            ResponseStore(server_config.responses_store_size), embedder, scorer,
                            system_fingerprint(config))
        debug = server_config.log_level.lower() == "debug"
        # Drain ends every request before uvicorn stops, so uvicorn's own grace period only bounds a
        # connection still sending its request.
        app = build_app(state, server_config.max_request_bytes, server_config.request_read_timeout)
        uv_config = uvicorn.Config(app, host=server_config.host, log_config=None, access_log=debug,
                                   http=header_timeout_protocol(server_config.request_read_timeout),
                                   timeout_graceful_shutdown=CONNECTION_GRACE_S, lifespan="off")
        server = Server(uv_config, lambda port: url(server_config.host, port))
        return asyncio.run(_serve(server, sock, state, config, server_config.shutdown_timeout))
    finally:
        sock.close()
        if tokenization is not None:
            tokenization.shutdown()
        if client is not None and client.process.is_alive():  # start-up failed after the engine loaded
            client.process.kill()
            client.process.join()


async def _serve(server: Server, sock: socket.socket, state: ServerState, config: EngineConfig,
                 shutdown_timeout: float) -> int:
    drain = Drain(state.admission, shutdown_timeout, server.stop)
    server.drain = drain
    # A dead engine that cannot be restarted: its requests already failed, so no wait; exit status 1.
    supervisor = EngineSupervisor(state, config, config.server.log_level, lambda: drain.begin(1, timeout=0))
    supervisor.watch(state.client)
    state.client.start()
    try:
        await server.serve(sockets=[sock])
    finally:
        await supervisor.close()
        await state.client.shutdown()
    logger.info("server stopped")
    return drain.exit_code
