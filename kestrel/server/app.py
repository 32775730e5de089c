"""The FastAPI app: routes, the body-size limit, the API-key check, every error in the shape of the route's
API (OpenAI's, Anthropic's under /v1/messages).

Open to all: /health and /ping (its SageMaker-style twin), /metrics (probes and scrapers, as vLLM keeps
them), /version and /openapi.json. With --api-key, everything else needs `Authorization: Bearer KEY` (or
`x-api-key: KEY`, which the anthropic client sends): /v1/*, /v2/*, /generate, /tokenize, /detokenize,
/rerank, /score and /server_info (which names the model path and the engine's PID), and what a gateway reads
or asks (/get_load, /model_info, /get_model_info, /flush_cache: gateway_api); `needs_api_key` lists them.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kestrel.server import (anthropic_api, gateway_api, lora_api, native_api, openai_api, openapi, pooling_api,
                            responses_api, tokenize_api)
from kestrel.server.body_limit import BodyLimitMiddleware
from kestrel.server.errors import APIError
from kestrel.server.metrics import CONTENT_TYPE
from kestrel.server.state import ServerState

logger = logging.getLogger(__name__)
try:
    KESTREL_VERSION = version("kestrel")
except PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed
    KESTREL_VERSION = "unknown"


def needs_api_key(path: str) -> bool:
    """Whether --api-key guards `path` (see the module docstring)."""
    return path.startswith(("/v1/", "/v2/")) or path in ("/v1", "/generate", "/tokenize", "/detokenize", "/server_info",
                                                         "/rerank", "/score", "/get_load", "/model_info",
                                                         "/get_model_info", "/flush_cache")


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` or `x-api-key: KEY` on every protected path (see the module docstring)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_api_key(scope["path"]):
            headers = dict(scope["headers"])
            # Both compared, always: how long the check takes says nothing about which header was sent.
            # The scheme's name is case-insensitive (RFC 7235); the key is not.
            given = headers.get(b"authorization", b"")
            bearer = given[:7].lower() == b"bearer " and secrets.compare_digest(given[7:], self.bearer[7:])
            key = secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer or key):
                error = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>' "
                                      "(or 'x-api-key: <key>')", code="invalid_api_key")
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InternalErrorMiddleware:
    """A bug while serving one request is logged with its traceback and answered 500, and that is all.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then closes the
    connection: the client's next request on it would be reset.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except ClientDisconnect:  # the client left while sending its body: nothing to answer, no fault here
            logger.debug("client disconnected while sending a request to %s", scope.get("path"))
        except Exception as e:
            logger.exception("unhandled error while serving %s", scope.get("path"))
            if started or scope["type"] != "http":
                raise  # too late for a 500: let the server close the connection
            await APIError(500, f"internal server error: {type(e).__name__}: {e}").response(scope["path"])(
                scope, receive, send)


def build_app(state: ServerState, max_request_bytes: int, request_read_timeout: float) -> FastAPI:
    app = FastAPI(title="kestrel", description="OpenAI-compatible and SGLang-native LLM serving",
                  version=KESTREL_VERSION, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    openapi.install(app)
    # The last added runs first: the size limit, then the key, then the last-resort 500.
    app.add_middleware(InternalErrorMiddleware)
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes, read_timeout=request_read_timeout)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
            message = f"{request.method} is not allowed on {request.url.path}; use {exc.headers['Allow']}"
        # 405 keeps its Allow header.
        return APIError(exc.status_code, message, headers=exc.headers).response(request.url.path)

    @app.get("/health")
    async def health() -> Response:
        state.check_health()  # 503 while draining, while the engine process is dead or while its loop is stuck
        return JSONResponse({"status": "ok"})

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # probes that read the status

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """SageMaker's health probe (vLLM serves it too): /health's answer."""
        return await health()

    @app.get("/version")
    async def kestrel_version() -> Response:
        return JSONResponse({"version": KESTREL_VERSION})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        state.metrics.engine_stall.set(state.client.stalled_for())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/server_info")
    async def server_info() -> Response:
        client = state.client
        return JSONResponse({
            "model_path": state.model_path, "served_model_name": state.served_model_name,
            "engine_pid": client.info.pid, "tp_rank_pids": client.info.rank_pids, "engine_alive": client.alive,
            "vocab_size": client.info.vocab_size,
            "context_length": client.info.context_length, "max_req_len": client.info.max_req_len,
            "stats": {**dataclasses.asdict(client.stats), "token_usage": client.stats.token_usage},
            "admission": {"requests": state.admission.num_requests, "engine_requests": state.admission.in_flight,
                          "capacity": state.admission.capacity, "stopping": state.admission.stopping}})

    gateway_api.install(app, state)  # /v1/loads, /model_info, /flush_cache: what a gateway reads or asks

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(openai_api.models(state))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_api.completions(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_api.chat_completions(state, request)

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request) -> Response:
        return await anthropic_api.messages(state, request)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request) -> Response:
        return await anthropic_api.count_tokens(state, request)

    @app.post("/v1/responses")
    async def responses_create(request: Request) -> Response:
        return await responses_api.create(state, request)

    @app.get("/v1/responses/{response_id}")
    async def responses_retrieve(response_id: str) -> Response:
        return await responses_api.retrieve(state, response_id)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await pooling_api.embeddings(state, request)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request) -> Response:
        return await pooling_api.rerank(state, request)

    @app.post("/v1/score")
    @app.post("/score")
    async def score(request: Request) -> Response:
        return await pooling_api.score(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokenize_api.tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokenize_api.detokenize(state, request)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await native_api.generate(state, request)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: Request) -> Response:
        return await lora_api.load(state, request)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: Request) -> Response:
        return await lora_api.unload(state, request)

    return app
