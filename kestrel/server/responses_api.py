"""OpenAI's Responses API: `POST /v1/responses` and `GET /v1/responses/{id}`, as the official `openai`
client's `client.responses` calls them.

The input (a string, or items: messages, function_call, function_call_output, reasoning) becomes OpenAI
chat messages after the `instructions` as a system message, and runs as one chat turn
(`kestrel.server.chat`); function tools are chat tools. The answer's reading becomes output items: a
reasoning item (its text as `reasoning_text` content), a message with the output text, and a
function_call item per call, streamed as the Responses events. A response is stored (unless `store`
is false) with its conversation, which `previous_response_id` continues (`ResponseStore`).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.server.chat import ChatAnswer, prepare_chat
from kestrel.server.chat_output import ChatDelta
from kestrel.server.errors import APIError, bad_request
from kestrel.server.protocol import ChatCompletionRequest, FunctionName, NamedToolChoice, Tool, ToolFunction, _Body
from kestrel.server.response_store import StoredResponse
from kestrel.server.sse import named_sse_stream
from kestrel.server.state import ServerState, parse_body, respond
from kestrel.server.tokenization import lone_surrogate

_API_NAMES = {"max_new_tokens": "max_output_tokens"}  # SamplingParams field -> the Responses API's
_TEXT_PARTS = ("input_text", "output_text", "text")
_REASONING_PARTS = ("reasoning_text", "summary_text")
ABORTED = {"code": "server_error", "message": "the request was aborted before it finished (the server is shutting "
                                              "down, or it was aborted); send it again"}


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class ReasoningConfig(_Body):
    effort: Literal["low", "medium", "high"] | None = None  # the chat template's reasoning_effort
    summary: str | None = None  # no summaries are written: the reasoning comes whole


class TextConfig(_Body):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension, as on chat completions
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    user: str | None = None
    priority: int = 0  # scheduling (SamplingParams.priority), as on the other routes
    chat_template_kwargs: dict[str, Any] | None = None


# ---- input items as chat messages ------------------------------------------------------------------
def _required(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} is required (a string) in an item of type {item.get('type')!r}", "input")
    return value


def _text(content: Any, where: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str:
    """A message's content: a string, or parts of text (of the types `kinds`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content[{j}]: only text parts ({', '.join(kinds)}) are supported, "
                              f"got {kind!r}", "input")
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages: a reasoning item goes with the assistant turn after it,
    function_call items join that turn's tool_calls, a function_call_output is a tool message."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    reasoning: str | None = None  # waiting for its assistant turn

    def assistant(content: str | None) -> dict[str, Any]:
        nonlocal reasoning
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            turn["reasoning_content"], reasoning = reasoning, None
        out.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (an input item)", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            text = _text(item.get("content"), where)
            if role == "assistant":
                assistant(text)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _required(item, "call_id", where), "type": "function", "function": {
                "name": _required(item, "name", where), "arguments": _required(item, "arguments", where)}}
            turn = out[-1] if out and out[-1]["role"] == "assistant" and reasoning is None else assistant(None)
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _required(item, "call_id", where),
                        "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, where, _REASONING_PARTS)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (messages, function_call, "
                              "function_call_output and reasoning are)", "input")
    return out


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def chat_request(body: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    tools = [Tool(type="function", function=ToolFunction(name=t.name, description=t.description,
                                                         parameters=t.parameters, strict=t.strict))
             for t in body.tools or []]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    messages = chat_messages(items, body.instructions)
    if not messages:
        raise bad_request("input is empty", "input")
    chat = ChatCompletionRequest(
        model=body.model, messages=messages, tools=tools or None, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
        max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        response_format=_response_format(body.text), priority=body.priority,
        reasoning_effort=body.reasoning.effort if body.reasoning is not None else None,
        chat_template_kwargs=body.chat_template_kwargs)
    try:
        chat.check()
    except APIError as e:
        if e.param == "response_format":
            e.param = "text"
        raise
    return chat


# ---- output items ---------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"id": _id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": _id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


def _output(answer: ChatAnswer, status: str) -> list[dict[str, Any]]:
    items = [_reasoning_item(answer.reasoning, status)] if answer.reasoning else []
    if answer.content:
        items.append(_message_item(answer.content, status))
    return items + [_call_item(c.id, c.name, c.arguments) for c in answer.calls]


class _Events:
    """A streamed answer as output items and their events, numbered in order: consecutive reasoning in one
    reasoning item, consecutive text in one message, each call a function_call item sent whole."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning item or message being written

    def event(self, kind: str, **fields: Any) -> tuple[str, dict]:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _start(self, item: dict[str, Any]) -> Iterator[tuple[str, dict]]:
        yield from self.close("completed")
        self.items.append(item)
        yield self.event("response.output_item.added", output_index=len(self.items) - 1,
                         item={**item, "status": "in_progress", **({"content": []} if "content" in item else {})})
        if "content" in item:
            self.open = item
            yield self.event("response.content_part.added", **self._where(item), content_index=0,
                             part=item["content"][0])

    def add(self, got: ChatDelta) -> Iterator[tuple[str, dict]]:
        for kind, text in (("reasoning", got.reasoning), ("message", got.content)):
            if not text:
                continue
            if self.open is None or self.open["type"] != kind:
                yield from self._start(_reasoning_item("", "completed") if kind == "reasoning"
                                       else _message_item("", "completed"))
            part = self.open["content"][0]
            part["text"] += text
            yield self.event("response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta",
                             **self._where(self.open), content_index=0, delta=text,
                             **({"logprobs": []} if kind == "message" else {}))
        for call in got.tool_calls:
            function = call["function"]
            item = _call_item(call["id"], function["name"], function["arguments"])
            yield from self._start(item)
            yield self.event("response.function_call_arguments.delta", **self._where(item),
                             delta=function["arguments"])
            yield self.event("response.function_call_arguments.done", **self._where(item), name=function["name"],
                             arguments=function["arguments"])
            yield self.event("response.output_item.done", output_index=self.items.index(item), item=item)

    def close(self, status: str) -> Iterator[tuple[str, dict]]:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        part = item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        yield self.event(done, **self._where(item), content_index=0, text=part["text"],
                         **({"logprobs": []} if item["type"] == "message" else {}))
        yield self.event("response.content_part.done", **self._where(item), content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=self.items.index(item), item=item)


# ---- the routes -----------------------------------------------------------------------------------------
def _input_items(state: ServerState, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation so far: the previous response's, then this input."""
    given = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else list(body.input)
    if body.previous_response_id is None:
        return given
    previous = state.responses.get(body.previous_response_id)
    if previous is None:
        raise APIError(404, f"previous_response_id {body.previous_response_id!r} names no stored response (it was "
                            "stored with store=false, or is gone from the server's store)", "previous_response_id")
    return [*previous.items, *given]


async def create(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, ResponsesRequest)
    # Fields the response echoes back: text no JSON encoder can write is refused before any work.
    for name in ("user", "metadata", "reasoning"):
        value = getattr(body, name)
        if problem := lone_surrogate(value.model_dump() if hasattr(value, "model_dump") else value, name):
            raise bad_request(problem, name)
    model = state.check_model(body.model)
    items = _input_items(state, body)
    chat = chat_request(body, items)
    turn = await prepare_chat(state, chat, body_bytes, body.max_output_tokens, "max_output_tokens", _API_NAMES,
                              prompt_param="input")
    gen = turn.gen
    [choice] = gen.choices
    response_id = _id("resp")
    head = {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": _tool_choice(body),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "error": None,
            "text": {"format": body.text.format if body.text and body.text.format else {"type": "text"}},
            "reasoning": body.reasoning.model_dump() if body.reasoning else None, "user": body.user}

    def finished(output: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response, stored unless store is false."""
        usage = gen.usage()
        response = {**head, "status": status(), "output": output,
                    "incomplete_details": {"reason": "max_output_tokens"} if status() == "incomplete" else None,
                    "error": ABORTED if status() == "failed" else None,
                    "usage": {"input_tokens": usage["prompt_tokens"],
                              "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                                       "cache_write_tokens": 0},
                              "output_tokens": usage["completion_tokens"],
                              "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": usage["total_tokens"]}}
        if body.store:
            state.responses.put(response_id, StoredResponse(response, [*items, *output]))
        return response

    def status() -> str:
        """"failed" for a request the server gave up (shutting down, or aborted): not a whole answer."""
        return {"length": "incomplete", "abort": "failed"}.get(choice.finish_reason, "completed")

    stream = _Events()

    async def events() -> AsyncIterator[tuple[str, dict]]:
        started = {**head, "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
        yield stream.event("response.created", response=started)
        yield stream.event("response.in_progress", response=started)
        async for update in gen.updates():
            for event in stream.add(turn.delta(update)):
                yield event
        for event in stream.close("completed" if status() == "completed" else "incomplete"):
            yield event
        response = finished(stream.items)
        yield stream.event(f"response.{response['status']}", response=response)

    def error_event(e: APIError) -> tuple[str, dict]:
        return stream.event("error", code=e.code or e.type, message=e.message, param=e.param)

    return await respond(request, gen, body.stream, lambda: named_sse_stream(events(), error_event),
                         lambda: finished(_output(turn.answer(choice), status())))


def _tool_choice(body: ResponsesRequest) -> Any:
    if isinstance(body.tool_choice, FunctionChoice):
        return body.tool_choice.model_dump()
    return body.tool_choice or "auto"


async def retrieve(state: ServerState, response_id: str) -> Response:
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response has the id {response_id!r} (responses made with store=false are "
                            "not kept, and the server keeps only the latest --responses-store-size)", "response_id")
    return JSONResponse(stored.response)
