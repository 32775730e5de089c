"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes.

/tokenize takes a text `prompt` (with the tokenizer's special tokens unless `add_special_tokens` is off) or
chat `messages` (rendered by the chat template as a chat request's prompt is, with its `tools` and
`chat_template_kwargs`; `add_generation_prompt` opens the assistant's turn) and answers
`{count, max_model_len, tokens, token_strs}`; /detokenize turns `tokens` back into `{prompt}`. Neither
runs the engine, and neither limits the length to the context: counting a prompt that is too long is
what a client asks before it shortens it.
"""
from __future__ import annotations

import sys
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel.server.errors import bad_request
from kestrel.server.protocol import ChatCompletionRequest, Tool, _Body
from kestrel.server.state import ServerState, parse_body
from kestrel.server.tokenization import INLINE_BODY_BYTES, PromptError


class TokenizeRequest(_Body):
    """Exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: on for a prompt; off for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


async def tokenize(state: ServerState, request: Request) -> Response:
    body, body_bytes = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt (a text) and messages (a chat)", "prompt")
    if body.continue_final_message:
        raise bad_request("continue_final_message is not supported", "continue_final_message")
    inline = body_bytes <= INLINE_BODY_BYTES
    if body.prompt is not None:
        tokenization = state.need_tokenization("text prompts", "prompt")
        try:
            [ids] = await tokenization.encode([body.prompt], sys.maxsize, ["prompt"], inline,
                                              body.add_special_tokens is not False)
        except PromptError as e:
            raise bad_request(str(e), "prompt") from None
    else:
        if body.add_special_tokens:
            raise bad_request("add_special_tokens is for a prompt: the chat template writes the special tokens of "
                              "messages", "add_special_tokens")
        # The chat request's own checks: template variables it may not set, text no tokenizer can take.
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
        chat.check()
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = await state.render_chat(body.messages, body_bytes, tools, chat.template_kwargs(),
                                      add_generation_prompt=body.add_generation_prompt)
    token_strs = [state.tokenizer.convert_ids_to_tokens(t) for t in ids] if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": state.client.info.context_length, "tokens": ids,
                         "token_strs": token_strs})


async def detokenize(state: ServerState, request: Request) -> Response:
    body, _ = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    tokenizer = state.need_tokenization("detokenize", "tokens").tokenizer
    vocab = state.client.info.vocab_size
    if (bad := next((t for t in body.tokens if not 0 <= t < vocab), None)) is not None:
        raise bad_request(f"tokens must be token ids in [0, {vocab}), got {bad}", "tokens")
    return JSONResponse({"prompt": tokenizer.decode(body.tokens)})
