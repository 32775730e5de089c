"""The OpenAPI schema served at /openapi.json, request bodies included.

The generation endpoints read their bodies themselves (a 413 before reading, our own 400s), so
FastAPI cannot see their models; the schemas are added here from the same pydantic classes that
validate the bodies, so they cannot drift apart.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kestrel.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

BODIES: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                      "/v1/chat/completions": ChatCompletionRequest, "/generate": GenerateRequest}


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
    return schema


def install(app: FastAPI) -> None:
    """Serve `openapi_schema(app)`, built once on the first request for it."""
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app)
        return app.openapi_schema

    app.openapi = build  # FastAPI's documented way to customize the schema
