"""vLLM's LoRA routes: `POST /v1/load_lora_adapter` {lora_name, lora_path} and `POST /v1/unload_lora_adapter`
{lora_name}. A loaded adapter is served at once, as a model of its own in /v1/models; an adapter that
cannot be served fails its load with a 400 naming why, and the server goes on serving."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from kestrel.server.errors import bad_request
from kestrel.server.protocol import LoadLoRARequest, UnloadLoRARequest
from kestrel.server.state import ServerState, parse_body


def _check_enabled(state: ServerState) -> None:
    if state.client.lora_adapters is None:
        raise bad_request("this server serves no LoRA adapters: start it with --enable-lora", "lora_name")


async def load(state: ServerState, request: Request) -> Response:
    body, _ = await parse_body(request, LoadLoRARequest)
    state.check_alive()
    _check_enabled(state)
    if body.lora_name in state.served_model_names:
        raise bad_request(f"{body.lora_name!r} is the base model's name; give the adapter another", "lora_name")
    await state.client.lora_command(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload(state: ServerState, request: Request) -> Response:
    body, _ = await parse_body(request, UnloadLoRARequest)
    state.check_alive()
    _check_enabled(state)
    await state.client.lora_command(body.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
