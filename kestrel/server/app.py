"""The FastAPI app: routes, API-key check, and every error as an OpenAI-shaped JSON body."""
from __future__ import annotations

import dataclasses
import logging
import secrets

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kestrel.server import native_api, openai_api
from kestrel.server.errors import APIError
from kestrel.server.metrics import CONTENT_TYPE
from kestrel.server.state import ServerState

logger = logging.getLogger(__name__)


def _protected(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/v1", "/generate")


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on /v1/* and /generate; health and metrics stay open for probes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _protected(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kestrel", docs_url=None, redoc_url=None, openapi_url=None)
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error while serving a request")
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    @app.get("/health")
    async def health() -> Response:
        state.check_alive()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/server_info")
    async def server_info() -> Response:
        client = state.client
        return JSONResponse({
            "model_path": state.model_path, "served_model_name": state.served_model_name,
            "engine_pid": client.info.pid, "engine_alive": client.alive, "vocab_size": client.info.vocab_size,
            "context_length": client.info.context_length, "max_req_len": client.info.max_req_len,
            "stats": {**dataclasses.asdict(client.stats), "token_usage": client.stats.token_usage}})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(openai_api.models(state))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_api.completions(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_api.chat_completions(state, request)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await native_api.generate(state, request)

    return app
