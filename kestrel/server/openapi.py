"""The OpenAPI schema served at /openapi.json, request bodies and error answers included.

The endpoints read their bodies themselves (a 413 before reading, our own 400s), so FastAPI cannot
see their models; the schemas are added here from the same pydantic classes that
validate the bodies, so they cannot drift apart. So are the error answers each route gives, in OpenAI's
error shape, or Anthropic's on /v1/messages (`kestrel.server.errors`); no route answers 422 (a bad body
is a 400).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kestrel.server.anthropic_api import CountTokensRequest, MessagesRequest
from kestrel.server.errors import speaks_anthropic
from kestrel.server.pooling_api import EmbeddingRequest, RerankRequest, ScoreRequest
from kestrel.server.protocol import (ChatCompletionRequest, CompletionRequest, GenerateRequest, LoadLoRARequest,
                                     UnloadLoRARequest)
from kestrel.server.responses_api import ResponsesRequest
from kestrel.server.tokenize_api import DetokenizeRequest, TokenizeRequest

BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    "/generate": GenerateRequest, "/v1/embeddings": EmbeddingRequest, "/v1/rerank": RerankRequest,
    "/rerank": RerankRequest, "/v2/rerank": RerankRequest, "/v1/score": ScoreRequest, "/score": ScoreRequest,
    "/v1/load_lora_adapter": LoadLoRARequest, "/v1/unload_lora_adapter": UnloadLoRARequest}

ERRORS = {400: "the request is invalid (`param` names the field)", 401: "a missing or wrong API key (with --api-key)",
          404: "no such model (`code`: model_not_found), no such LoRA adapter, or no such stored response",
          413: "the body is over --max-request-bytes",
          503: "the server is draining, restarting its engine, or full (then with Retry-After)"}
# The error answers of each path beside its 200; 401 marks the paths --api-key protects (kestrel.server.app).
_GENERATION = (400, 401, 413, 503)
ROUTE_ERRORS: dict[str, tuple[int, ...]] = {
    "/v1/completions": (*_GENERATION, 404), "/v1/chat/completions": (*_GENERATION, 404), "/generate": _GENERATION,
    "/v1/messages": (*_GENERATION, 404), "/v1/messages/count_tokens": (400, 401, 404, 413),
    "/v1/responses": (*_GENERATION, 404), "/v1/responses/{response_id}": (401, 404),
    "/tokenize": (400, 401, 404, 413), "/detokenize": (400, 401, 404, 413),
    "/v1/embeddings": (*_GENERATION, 404), "/v1/rerank": (*_GENERATION, 404), "/rerank": (*_GENERATION, 404),
    "/v2/rerank": (*_GENERATION, 404), "/v1/score": (*_GENERATION, 404), "/score": (*_GENERATION, 404),
    "/v1/load_lora_adapter": (400, 401, 413, 503), "/v1/unload_lora_adapter": (400, 401, 404, 413, 503),
    "/flush_cache": (400, 401, 503),  # 400: requests are running, nothing was flushed
    "/v1/loads": (401,), "/get_load": (401,), "/model_info": (401,), "/get_model_info": (401,),
    "/v1/models": (401,), "/server_info": (401,), "/health": (503,), "/ping": (503,)}

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}
ANTHROPIC_ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    components["ErrorResponse"] = ERROR_SCHEMA
    components["AnthropicErrorResponse"] = ANTHROPIC_ERROR_SCHEMA
    for path, statuses in ROUTE_ERRORS.items():
        name = "AnthropicErrorResponse" if speaks_anthropic(path) else "ErrorResponse"
        error = {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}
        for operation in schema["paths"][path].values():
            operation["responses"].pop("422", None)  # FastAPI's, for a path parameter; any string is an id
            operation["responses"].update(
                {str(status): {"description": ERRORS[status], "content": error} for status in statuses})
    return schema


def install(app: FastAPI) -> None:
    """Serve `openapi_schema(app)`, built once on the first request for it."""
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app)
        return app.openapi_schema

    app.openapi = build  # FastAPI's documented way to customize the schema
