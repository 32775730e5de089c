"""What every endpoint needs: the engine client, tokenization, admission, names; reading a request body."""
from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.config import ServerConfig
from kestrel.core.sampling_params import SamplingParams
from kestrel.server.admission import AdmissionControl, Ticket, shutting_down
from kestrel.server.engine_client import EngineClient
from kestrel.server.errors import APIError, bad_request, from_validation_error
from kestrel.server.generation import Generation
from kestrel.server.metrics import ServerMetrics
from kestrel.server.pooling_model import Embedder, Scorer
from kestrel.server.protocol import fit_max_tokens, prompt_too_long, validated
from kestrel.server.request_limits import check_nesting
from kestrel.server.response_store import ResponseStore
from kestrel.server.sse import ClientGone, EventStream, until_disconnect
from kestrel.server.tokenization import INLINE_BODY_BYTES, PromptError, PromptTooLong, Tokenization
from kestrel.server.reasoning_parsers import ReasoningParser
from kestrel.server.tool_parsers import ToolParser

B = TypeVar("B", bound=BaseModel)


@dataclass
class ServerState:
    client: EngineClient  # replaced when the engine process is restarted (EngineSupervisor)
    tokenization: Tokenization | None  # None when the model folder has no tokenizer: token-id prompts only
    served_model_name: str
    model_path: str
    metrics: ServerMetrics
    admission: AdmissionControl
    api_key: str | None = None
    tool_parser: ToolParser | None = None  # --tool-call-parser: the format of the model's tool calls
    reasoning_parser: type[ReasoningParser] | None = None  # --reasoning-parser: the format of its reasoning
    model_aliases: tuple[str, ...] = ()  # further --served-model-name names clients may send
    # The Responses API's stored responses (--responses-store-size).
    responses: ResponseStore = field(
        default_factory=lambda: ResponseStore(ServerConfig.responses_store_size))
    # How the model embeds and scores (kestrel.server.pooling_model); None: it does not.
    embedder: Embedder | None = None
    scorer: Scorer | None = None
    system_fingerprint: str | None = None  # on every chat and completion answer (kestrel.server.launch)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.model_aliases)

    @property
    def tokenizer(self) -> Any:
        return self.tokenization.tokenizer if self.tokenization is not None else None

    def check_model(self, model: str | None) -> str:
        """The name the answer reports: the one the request sent, or the first served name. A name this
        server does not serve is a 404, as OpenAI and vLLM answer it (SDKs raise NotFoundError)."""
        if model is None:
            return self.served_model_name
        adapters = self.client.lora_adapters or {}
        base, _, adapter = model.partition(":")
        if model in adapters or (base in self.served_model_names and adapter in adapters):
            return model
        if model not in self.served_model_names:
            served = ", ".join(repr(name) for name in (*self.served_model_names, *adapters))
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served} (see /v1/models)",
                           "model", "model_not_found", type="invalid_request_error")
        return model

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (the adapter's name, or `base:adapter`); None for
        the base model. Call after `check_model`."""
        if model is None or model in self.served_model_names:
            return None
        base, sep, adapter = model.partition(":")  # adapter names have no ':'
        return adapter if sep and base in self.served_model_names else model

    def check_lora(self, name: str, param: str) -> None:
        """404 for an adapter that is not loaded, naming the loaded ones."""
        adapters = self.client.lora_adapters
        if adapters is None:
            raise bad_request(f"{param} {name!r}: this server serves no LoRA adapters (start it with --enable-lora)",
                              param)
        if name not in adapters:
            loaded = ", ".join(repr(n) for n in adapters) or "none"
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded; loaded adapters: {loaded}", param,
                           "model_not_found", type="invalid_request_error")

    def need_tokenization(self, what: str, param: str) -> Tokenization:
        if self.tokenization is None:
            raise bad_request(f"this model has no tokenizer, so {what} cannot be used; send token ids", param)
        return self.tokenization

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def check_alive(self) -> None:
        """503 while shutting down or while the engine process is dead (being restarted)."""
        if self.admission.stopping:
            raise shutting_down()
        if not self.client.alive:
            raise self.client.dead_error()

    def check_health(self) -> None:
        """/health's answer: `check_alive`, and a 503 while the engine holds requests but its loop has
        stopped advancing (see EngineClient.stall_error). Only the probe says so: new requests still
        queue, and the engine answers them if it was only slow."""
        self.check_alive()
        if (error := self.client.stall_error()) is not None:
            raise error

    def admit(self, choices: int, param: str) -> Ticket:
        self.check_alive()
        return self.admission.admit(choices, param)

    # ---- prompts -------------------------------------------------------------------------------
    async def prompt_ids(self, ticket: Ticket, prompts: list[str | list[int]], param: str,
                         body_bytes: int) -> list[list[int]]:
        """Token ids of each prompt (text or ids); 400 for text the tokenizer cannot take or a prompt
        that leaves no room in the context."""
        texts = [p for p in prompts if isinstance(p, str)]
        names = [prompt_name(param, i, len(prompts)) for i, p in enumerate(prompts) if isinstance(p, str)]
        encoded: list[list[int]] = []
        if texts:
            tokenization = self.need_tokenization("text prompts", param)
            encoded = await self._tokenize(ticket, param, tokenization.encode(
                texts, self.client.info.max_req_len, names, body_bytes <= INLINE_BODY_BYTES))
        it = iter(encoded)
        return [next(it) if isinstance(p, str) else p for p in prompts]

    async def chat_prompt_ids(self, ticket: Ticket, messages: list[dict[str, Any]], body_bytes: int,
                              tools: list[dict[str, Any]] | None = None,
                              template_kwargs: dict[str, Any] | None = None, param: str = "messages") -> list[int]:
        """The rendered prompt's ids; errors name `param`, the request field the messages came from."""
        tokenization = self.need_tokenization("chat messages", param)
        return await self._tokenize(ticket, param, tokenization.chat(
            messages, self.client.info.max_req_len, param, body_bytes <= INLINE_BODY_BYTES, tools,
            template_kwargs))

    async def render_chat(self, messages: list[dict[str, Any]], body_bytes: int, tools: list[dict[str, Any]] | None,
                          template_kwargs: dict[str, Any] | None, param: str = "messages",
                          add_generation_prompt: bool = True) -> list[int]:
        """The rendered chat prompt's ids outside any generation (counting tokens, /tokenize): no
        admission, and no limit on the length (what is counted may be longer than the context)."""
        tokenization = self.need_tokenization("chat messages", param)
        try:
            return await tokenization.chat(messages, sys.maxsize, param, body_bytes <= INLINE_BODY_BYTES, tools,
                                           template_kwargs, add_generation_prompt)
        except PromptError as e:
            raise bad_request(str(e), param) from None

    async def _tokenize(self, ticket: Ticket, param: str, work: Any) -> Any:
        try:
            return await ticket.unless_aborted(work)
        except PromptError as e:
            raise bad_request(str(e), param) from None
        except PromptTooLong as e:
            info = self.client.info
            raise prompt_too_long(e.num_tokens, info.max_req_len, info.context_length, e.where, param) from None

    def params_for(self, base: SamplingParams, prompts: list[list[int]], asked: Any, default: int | None,
                   prompt_param: str, param: str, api_names: dict[str, str]) -> list[SamplingParams]:
        """`base` for each prompt, with max_new_tokens fitted to its length (see `fit_max_tokens`)."""
        info = self.client.info
        return [validated(dataclasses.replace(base, max_new_tokens=fit_max_tokens(
                    len(p), asked, default, info.max_req_len, info.context_length,
                    prompt_name(prompt_param, i, len(prompts)), prompt_param, param)), info.vocab_size, api_names)
                for i, p in enumerate(prompts)]


def prompt_name(param: str, index: int, count: int) -> str:
    """How an error names prompt `index` of `count`: `prompt[2]` in a batch, `prompt` alone."""
    return f"{param}[{index}]" if count > 1 else param


def _no_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and no sampling parameter may be one.
    raise ValueError(f"{name} is not a JSON value")


async def parse_body(request: Request, model: type[B]) -> tuple[B, int]:
    """The JSON body validated against `model`, and its size in bytes; 400 for malformed JSON, a field
    nested too deep (see request_limits) or invalid fields (413 for too large a body comes from
    BodyLimitMiddleware while it is read)."""
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if isinstance(data, dict):  # before anything walks it: validation, pickling, templates, compilers
        check_nesting(data, getattr(model, "nested_fields", ()))
    try:
        return model.model_validate(data), len(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def respond(request: Request, gen: Generation, stream: bool,
                  events: Callable[[], AsyncIterator[bytes]],
                  body: Callable[[], Any]) -> Response:
    """Start `gen`, then stream `events()` or wait for the end and answer `body()` as JSON.

    Either way, a client that leaves aborts the unfinished engine requests, and `gen`'s ticket is
    given back once the response has ended.
    """
    try:
        await gen.start()
    except BaseException:
        gen.close()
        raise
    if stream:
        return EventStream(events(), gen.close)
    try:
        await until_disconnect(request.receive, gen.run())
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; uvicorn drops it
    finally:
        gen.close()
    return JSONResponse(body())
