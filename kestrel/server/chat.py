"""One chat turn on the engine, whichever API asked for it: OpenAI's chat completions, Anthropic's
Messages and OpenAI's Responses all translate their request into a `ChatCompletionRequest` and run it
through `prepare_chat`; each then writes the answer in its own shape.

The turn owns what the chat logic decides: the tools and the grammar forcing a call, the sampling
parameters and their errors renamed to the calling API's fields, the prompt from the chat template,
and the reading of each choice's text into reasoning, content and tool calls (`ChatOutput`), the same
streamed or not.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kestrel.server.chat_output import ChatDelta, ChatOutput
from kestrel.server.errors import bad_request
from kestrel.server.generation import Choice, ChoiceUpdate, Generation
from kestrel.server.protocol import ChatCompletionRequest, expand_choices, validated
from kestrel.server.state import ServerState
from kestrel.server.tool_parsers import ToolCall, ToolCallStream
from kestrel.server.tools import ToolUse, new_call_id, tool_use


@dataclass
class ChatAnswer:
    """A whole choice as the reading found it."""

    reasoning: str | None  # None without a reasoning parser, or when the model wrote none
    content: str
    calls: list[ToolCall]
    finish_reason: str | None  # OpenAI's: "stop", "length", "tool_calls", "abort"


class ChatTurn:
    """The generation of one chat request and the reading of its choices (see the module docstring)."""

    gen: Generation  # set by prepare_chat once the prompt is known; the reading is its on_update

    def __init__(self, tools: ToolUse | None, readers: list[ChatOutput] | None, reasoning: bool) -> None:
        self.tools = tools
        self.readers = readers
        self.reasoning = reasoning  # a reasoning parser reads the answers
        self._read: dict[int, ChatDelta] = {}  # choice -> what its last update added

    def read(self, u: ChoiceUpdate) -> None:
        """Read an update as it comes (the generation's on_update); a repeated call ends the choice."""
        reader = self.readers[u.index]
        self._read[u.index] = reader.feed(u.text, final=u.finish_reason is not None)
        if reader.ended:
            self.gen.stop(u.index)

    def delta(self, u: ChoiceUpdate) -> ChatDelta:
        """What update `u` added to its choice's answer (after `read` saw it)."""
        if self.readers is None:
            return ChatDelta(content=u.text)
        return self._read.pop(u.index)

    def finish_reason(self, index: int, finish: str | None) -> str | None:
        """A choice that ended on its calls finishes with "tool_calls"; a named tool_choice with "stop",
        as OpenAI answers it (the caller asked for that call; the model chose nothing)."""
        if self.tools is None or finish is None:
            return finish
        reader = self.readers[index]
        if reader.ended or finish == "stop" and reader.calls:
            return "stop" if self.tools.named else "tool_calls"
        return finish

    def answer(self, c: Choice) -> ChatAnswer:
        if self.readers is None:
            return ChatAnswer(None, c.text, [], c.finish_reason)
        reader = self.readers[c.index]
        return ChatAnswer(reader.reasoning or None, reader.content, reader.calls,
                          self.finish_reason(c.index, c.finish_reason))


async def prepare_chat(state: ServerState, body: ChatCompletionRequest, body_bytes: int, asked: int | None,
                       max_tokens_param: str, api_names: dict[str, str], prompt_param: str = "messages",
                       new_id: Callable[[], str] = new_call_id) -> ChatTurn:
    """The turn of a checked request, ready for `respond` to start: `asked` is the output limit the
    request gave (None: all the room the context leaves), `max_tokens_param` its field; `api_names`
    maps SamplingParams fields to the request's (for errors); `new_id` names tool calls."""
    state.need_tokenization("chat messages", prompt_param)
    info = state.client.info
    tools = tool_use(body, state.tool_parser)
    grammar = body.grammar()
    if tools is not None and tools.structural_tag is not None:
        if grammar:
            raise bad_request("tool_choice 'required' or a named function constrains the output to tool calls; "
                              f"drop {next(iter(grammar))}", "tool_choice")
        grammar = {"structural_tag": tools.structural_tag}
    grammar_param = "tools" if tools is not None and tools.structural_tag is not None else body.grammar_param()
    # Without a limit, as vLLM: up to the end of the context, at most max_req_len - 1 for any prompt.
    base = validated(body.sampling_params(info.max_req_len - 1 if asked is None else asked,
                                          body.engine_top_logprobs(), grammar), info.vocab_size, api_names)
    reasoning = state.reasoning_parser
    if reasoning is not None and reasoning.needs_special_tokens:  # the parser reads the format's markers
        base = dataclasses.replace(base, skip_special_tokens=False)
    template_kwargs = body.template_kwargs()
    if reasoning is not None and base.grammar is not None:  # the model thinks freely, then the grammar holds
        if (marker := reasoning.answer_starts_after(template_kwargs)) is not None:
            base = dataclasses.replace(base, grammar_after=tuple(state.tokenizer.encode(marker,
                                                                                        add_special_tokens=False)))
            # A model that may answer without opening its thinking block (one token, e.g. Qwen3's
            # `<think>`) would never write the marker: its first token decides (SamplingParams).
            opener = reasoning.opens_with(template_kwargs)
            ids = state.tokenizer.encode(opener, add_special_tokens=False) if opener else []
            if len(ids) == 1:
                base = dataclasses.replace(base, grammar_opener=ids[0])
    ticket = state.admit(body.n, "n")
    # With a reasoning parser or tools, each choice's text is read by its ChatOutput as it comes, streamed
    # or not (one reading, so both answers agree).
    readers = [ChatOutput(reasoning() if reasoning is not None else None,
                          ToolCallStream(tools.parser, new_id) if tools is not None else None)
               for _ in range(body.n)] if reasoning is not None or tools is not None else None
    with ticket.released_on_error():
        prompt = await state.chat_prompt_ids(ticket, body.messages, body_bytes,
                                             tools.template_tools if tools is not None else None, template_kwargs,
                                             prompt_param)
        params = state.params_for(base, [prompt], asked, None, prompt_param, max_tokens_param, api_names)
        turn = ChatTurn(tools, readers, reasoning is not None)
        turn.gen = Generation(state.client, state.tokenizer, *expand_choices([prompt], params, body.n), ticket,
                              prompt_param=prompt_param, grammar_param=grammar_param, api_names=api_names,
                              on_update=turn.read if readers is not None else None,
                              lora_name=state.lora_of(body.model))
    return turn
