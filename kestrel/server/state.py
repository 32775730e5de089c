"""What every endpoint needs: the engine client, the tokenizer, names; and reading a request body."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.server.engine_client import EngineClient
from kestrel.server.errors import APIError, bad_request, from_validation_error
from kestrel.server.generation import Generation
from kestrel.server.metrics import ServerMetrics
from kestrel.server.sse import ClientGone, EventStream, until_disconnect

B = TypeVar("B", bound=BaseModel)


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Any  # None when the model folder has none: token-id prompts only
    served_model_name: str
    model_path: str
    metrics: ServerMetrics
    api_key: str | None = None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(400, f"model {model!r} does not exist; this server serves {self.served_model_name!r} "
                                "(see /v1/models)", "model", "model_not_found")

    def need_tokenizer(self, what: str, param: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"this model has no tokenizer, so {what} cannot be used; send token ids", param)
        return self.tokenizer

    def encode(self, text: str, param: str) -> list[int]:
        return self.need_tokenizer("text prompts", param).encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def check_alive(self) -> None:
        if not self.client.alive:
            raise self.client.dead_error()


def _no_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and no sampling parameter may be one.
    raise ValueError(f"{name} is not a JSON value")


async def parse_body(request: Request, model: type[B]) -> B:
    """The JSON body validated against `model`; 400 for malformed JSON or invalid fields."""
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def respond(request: Request, gen: Generation, stream: bool,
                  events: Callable[[], AsyncIterator[bytes]],
                  body: Callable[[], Any]) -> Response:
    """Start `gen`, then stream `events()` or wait for the end and answer `body()` as JSON.

    Either way, a client that leaves aborts the unfinished engine requests.
    """
    await gen.start()
    if stream:
        return EventStream(events(), gen.close)
    try:
        await until_disconnect(request.receive, gen.run())
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; uvicorn drops it
    finally:
        gen.close()
    return JSONResponse(body())
