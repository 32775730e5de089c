"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, as the official
`anthropic` client (and agents built on it) call them.

A request is translated into an OpenAI chat request and runs as one chat turn (`kestrel.server.chat`):
the system prompt becomes a system message; `tool_use` blocks become the assistant's `tool_calls`,
`tool_result` blocks tool messages, `thinking` blocks the assistant's `reasoning_content`; tools take
`input_schema` as their parameters; tool_choice auto/any/tool/none is OpenAI's auto/required/named/none;
`thinking` sets the template's `enable_thinking`. The answer's reading (reasoning, text, calls) becomes
thinking, text and tool_use content blocks, streamed as Anthropic's events. Errors are in Anthropic's
shape (`kestrel.server.errors`), on every route under /v1/messages.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.server.chat import ChatAnswer, prepare_chat
from kestrel.server.chat_output import ChatDelta
from kestrel.server.errors import APIError, bad_request
from kestrel.server.generation import Choice
from kestrel.server.protocol import ChatCompletionRequest, FunctionName, NamedToolChoice, Tool, ToolFunction, _Body
from kestrel.server.sse import named_sse_stream
from kestrel.server.state import ServerState, parse_body, respond
from kestrel.server.tools import tool_use

ANTHROPIC_MAX_TEMPERATURE = 1.0
# SamplingParams field -> the Messages API's field, for errors.
_API_NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences"}
_RENAMED = {"stop": "stop_sequences"}  # chat request field -> the Messages API's, where they differ


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Body):
    """Whether the model thinks: all but "disabled" turn it on. budget_tokens is not enforced (the model
    thinks until it closes its reasoning, within max_tokens)."""

    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = None


class CountTokensRequest(_Body):
    """What the prompt is made of: `/v1/messages/count_tokens`'s body, and the start of `/v1/messages`'."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat completions (vLLM's extension)


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: for the caller's records; nothing here reads it
    stream: bool = False
    priority: int = 0  # scheduling (SamplingParams.priority), as on the OpenAI routes


# ---- the request as an OpenAI chat request ----------------------------------------------------------
def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(block.text for block in content)


def _chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text(body.system)})
    for message in body.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts, reasoning, calls = [], [], []
        for block in message.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            elif isinstance(block, ToolResultBlock):  # a tool message of its own, where the block stands
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        if message.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
            if reasoning:
                turn["reasoning_content"] = "".join(reasoning)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        elif texts or not any(isinstance(b, ToolResultBlock) for b in message.content):
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_choice(choice: AnthropicToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs the tool's name", "tool_choice")
        return NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _template_kwargs(body: CountTokensRequest) -> dict[str, Any] | None:
    if body.thinking is None:
        return body.chat_template_kwargs
    return {**(body.chat_template_kwargs or {}), "enable_thinking": body.thinking.type != "disabled"}


def _renamed(e: APIError) -> APIError:
    """An error of the chat request, naming the Messages API's field."""
    new = _RENAMED.get(e.param or "")
    if new is not None:
        e.message = new + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
        e.param = new
    return e


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI chat request `body` asks for, checked (400s name the Messages API's fields)."""
    tools = [Tool(type="function", function=ToolFunction(name=t.name, description=t.description,
                                                         parameters=t.input_schema)) for t in body.tools or []]
    sampling: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        if body.max_tokens < 1:
            raise bad_request(f"max_tokens must be an integer >= 1, got {body.max_tokens}", "max_tokens")
        if body.temperature is not None and not 0 <= body.temperature <= ANTHROPIC_MAX_TEMPERATURE:
            raise bad_request(f"temperature must be a number in [0, {ANTHROPIC_MAX_TEMPERATURE:g}], got "
                              f"{body.temperature!r}", "temperature")
        if body.top_k is not None and body.top_k < 0:
            raise bad_request(f"top_k must be an integer >= 0, got {body.top_k}", "top_k")
        sampling = {"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                    "top_k": body.top_k, "stop": body.stop_sequences, "priority": body.priority}
    disable_parallel = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    chat = ChatCompletionRequest(
        model=body.model, messages=_chat_messages(body), tools=tools or None, tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=not disable_parallel, chat_template_kwargs=_template_kwargs(body), **sampling)
    try:
        chat.check()
    except APIError as e:
        raise _renamed(e) from None
    return chat


# ---- the answer ---------------------------------------------------------------------------------------
def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _stop(answer: ChatAnswer, c: Choice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice. The Messages API has no stop reason for a request
    the server gave up (shutting down, or aborted): that is an error, as Anthropic answers an overload."""
    if answer.finish_reason == "abort":
        raise APIError(503, "the request was aborted before it finished (the server is shutting down, or it "
                            "was aborted); send it again")
    if answer.finish_reason == "tool_calls" or answer.calls and answer.finish_reason == "stop":
        return "tool_use", None
    if answer.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.matched_stop, str):  # a stop string; an int is an end-of-turn token
        return "stop_sequence", c.matched_stop
    return "end_turn", None


def _usage(c: Choice) -> dict[str, int]:
    return {"input_tokens": len(c.prompt_ids), "output_tokens": len(c.token_ids)}


def _content(answer: ChatAnswer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    blocks += [{"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}
               for call in answer.calls]
    return blocks


class _Blocks:
    """A streamed answer as content blocks: consecutive reasoning in one thinking block, consecutive
    text in one text block, each call a tool_use block of its own (sent whole, as the calls are read)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the block being written

    def _start(self, block: dict[str, Any]) -> Iterator[tuple[str, dict]]:
        yield from self.close()
        self.index += 1
        self.open = block["type"]
        yield "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def add(self, got: ChatDelta) -> Iterator[tuple[str, dict]]:
        if got.reasoning:
            if self.open != "thinking":
                yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": got.reasoning})
        if got.content:
            if self.open != "text":
                yield from self._start({"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": got.content})
        for call in got.tool_calls:
            function = call["function"]
            yield from self._start({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
            yield self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
            yield from self.close()

    def close(self) -> Iterator[tuple[str, dict]]:
        if self.open is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
            self.open = None


def _error_event(e: APIError) -> tuple[str, dict]:
    return "error", e.anthropic_body()


async def messages(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, MessagesRequest)
    model = state.check_model(body.model)
    chat = chat_request(body)
    try:
        turn = await prepare_chat(state, chat, body_bytes, body.max_tokens, "max_tokens", _API_NAMES,
                                  new_id=new_tool_use_id)
    except APIError as e:
        raise _renamed(e) from None
    gen = turn.gen
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    [choice] = gen.choices

    def message(content: list[dict], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": _usage(choice)}

    async def events() -> AsyncIterator[tuple[str, dict]]:
        yield "message_start", {"type": "message_start", "message": message([], (None, None))}
        yield "ping", {"type": "ping"}
        blocks = _Blocks()
        async for update in gen.updates():
            for event in blocks.add(turn.delta(update)):
                yield event
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = _stop(turn.answer(choice), choice)
        yield "message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                "usage": {"output_tokens": len(choice.token_ids)}}
        yield "message_stop", {"type": "message_stop"}

    def whole() -> dict[str, Any]:
        answer = turn.answer(choice)
        return message(_content(answer), _stop(answer, choice))

    return await respond(request, gen, body.stream, lambda: named_sse_stream(events(), _error_event), whole)


async def count_tokens(state: ServerState, request: Request) -> Response:
    """The prompt's length as `/v1/messages` would render it (system, messages and tools)."""
    body, body_bytes = await parse_body(request, CountTokensRequest)
    state.check_model(body.model)
    chat = chat_request(body)
    tools = tool_use(chat, state.tool_parser)
    ids = await state.render_chat(chat.messages, body_bytes, tools.template_tools if tools is not None else None,
                                  chat.template_kwargs())
    return JSONResponse({"input_tokens": len(ids)})
