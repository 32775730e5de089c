"""gpt-oss's chat format through the server and the official `openai` client: the analysis channel as
`reasoning_content`, the final channel as content, harmony tool calls as `tool_calls`, streamed or not.

The HTTP app runs in process with the harmony test tokenizer and template (`tests.harmony_tokenizer`);
the engine side is a fake that answers each chat with a scripted harmony answer, one token per step, so
the markers arrive in their own chunks as a model's tokens would.
"""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from kestrel.server.messages import AbortRequests, AddRequests, Admission, Shutdown, StepOutput, TokenDelta
from kestrel.server.reasoning_parsers import reasoning_parser
from kestrel.server.tool_parsers import tool_parser
from tests.e2e.conftest import fake_engine_app
from tests.e2e.scripted_chat import serve as scripted_serve
from tests.harmony_tokenizer import build_harmony_tokenizer
from tests.tiny_tokenizer import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
CALL = ("<|channel|>analysis<|message|>The user wants the weather: call get_weather.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')
ANSWER = ("<|channel|>analysis<|message|>The tool said sunny.<|end|><|start|>assistant<|channel|>final<|message|>"
          "It is sunny in Oslo.<|return|>")
GREETING = ("<|channel|>analysis<|message|>A greeting; answer briefly.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Hello!<|return|>")


def harmony_engine(tokenizer, seen: list):
    """Answers a prompt whose tools were rendered with a call (with the answer once the tool result is in
    the prompt), any other with a greeting; records (prompt text, params) of each request."""
    def engine(inbox, outbox) -> None:
        while True:
            try:
                msg = inbox.recv()
            except EOFError:
                return
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequests):
                continue
            assert isinstance(msg, AddRequests), msg
            outbox.send(Admission(msg.group))
            for r in msg.reqs:
                prompt = tokenizer.decode(r.prompt_ids, skip_special_tokens=False)
                seen.append((prompt, r.params))
                text = ANSWER if "to=assistant" in prompt else CALL if "get_weather" in prompt else GREETING
                ids = tokenizer.encode(text, add_special_tokens=False)
                for i, token in enumerate(ids):
                    last = i == len(ids) - 1
                    outbox.send(StepOutput([TokenDelta(r.rid, [token], finished=last,
                                                       finish_reason="stop" if last else None,
                                                       matched_stop=token if last else None,
                                                       prompt_tokens=len(r.prompt_ids))]))
    return engine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_harmony_tokenizer(tmp_path_factory.mktemp("harmony-tokenizer"))


def serve(tokenizer, scenario) -> list:
    """Run `scenario(openai client)` against the app; returns what the engine saw."""
    seen: list = []

    async def run() -> None:
        async with fake_engine_app(harmony_engine(tokenizer, seen), tokenizer, tool_parser=tool_parser("gpt-oss"),
                                   reasoning_parser=reasoning_parser("gpt-oss")) as (_, http):
            client = openai.AsyncOpenAI(api_key="none", base_url="http://kestrel/v1", http_client=http)
            await asyncio.wait_for(scenario(client), 30)

    asyncio.run(run())
    return seen


async def streamed(client, **args) -> tuple[str, str, list[dict], str]:
    """(reasoning, content, calls, finish_reason) of a streamed answer, assembled as a client does."""
    reasoning, content, calls, finish = "", "", [], None
    async for chunk in await client.chat.completions.create(model="fake", stream=True, **args):
        choice = chunk.choices[0]
        extra = choice.delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")  # vLLM's newer name, the same text
        reasoning += extra.get("reasoning_content") or ""
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            assert call.index == len(calls)  # each call whole, in one entry
            calls.append({"name": call.function.name, "arguments": call.function.arguments})
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_and_content_streamed_or_not(tokenizer):
    async def scenario(client) -> None:
        out = await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Hi"}],
                                                   reasoning_effort="high")
        message = out.choices[0].message
        assert (message.reasoning_content, message.content, message.tool_calls, out.choices[0].finish_reason) == \
            ("A greeting; answer briefly.", "Hello!", None, "stop")
        assert message.model_extra["reasoning"] == "A greeting; answer briefly."
        assert await streamed(client, messages=[{"role": "user", "content": "Hi"}]) == \
            ("A greeting; answer briefly.", "Hello!", [], "stop")

    seen = serve(tokenizer, scenario)
    # The template got reasoning_effort; the engine was asked to keep the markers in the text.
    assert "Reasoning: high\n" in seen[0][0] and "Reasoning: medium\n" in seen[1][0]
    assert all(params.skip_special_tokens is False for _, params in seen)


def test_tool_calls_streamed_or_not_then_the_answer(tokenizer):
    async def scenario(client) -> None:
        out = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.reasoning_content == "The user wants the weather: call get_weather."
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Oslo"}
        assert await streamed(client, messages=ASK, tools=TOOLS) == (
            "The user wants the weather: call get_weather.", "",
            [{"name": "get_weather", "arguments": call.function.arguments}], "tool_calls")
        # The client sends the turn back, reasoning included, with the tool's result.
        history = [*ASK, {"role": "assistant", "content": None, "reasoning_content": choice.message.reasoning_content,
                          "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        out = await client.chat.completions.create(model="fake", messages=history, tools=TOOLS)
        assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("It is sunny in Oslo.", "stop")
        with pytest.raises(openai.BadRequestError, match="cannot be forced with --tool-call-parser gpt-oss"):
            await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice="required")

    seen = serve(tokenizer, scenario)
    assert ("<|start|>assistant<|channel|>analysis<|message|>The user wants the weather: call get_weather.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Oslo"}<|call|><|start|>functions.get_weather to=assistant') in seen[2][0]


def test_a_grammar_waits_for_the_end_of_thinking(tokenizer, tmp_path):
    """With a reasoning parser, response_format's grammar starts after the format's end-of-thinking marker
    (gpt-oss: the final channel's header; qwen3: </think>, unless the template was told not to think)."""
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}

    async def harmony(client) -> None:
        await client.chat.completions.create(model="fake", messages=ASK, response_format=schema)
        await client.chat.completions.create(model="fake", messages=ASK)

    seen = serve(tokenizer, harmony)
    marker = tuple(tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False))
    assert seen[0][1].grammar_after == marker and seen[0][1].json_schema is not None
    assert seen[1][1].grammar_after is None

    think = build_tokenizer(tmp_path / "think")

    async def qwen3(http) -> None:
        for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
            answer = await http.post("/v1/chat/completions", json={
                "model": "fake", "messages": [{"role": "user", "content": "think"}], "response_format": schema,
                **kwargs})
            assert answer.status_code == 200, answer.text

    seen = scripted_serve(think, qwen3)
    assert seen[0][1].grammar_after == tuple(think.encode("</think>", add_special_tokens=False))
    assert seen[1][1].grammar_after is None
    # Qwen3 may answer without opening its block: `<think>` or the grammar, first, where `<think>` is one
    # token (Qwen3's tokenizer; this test tokenizer spells it in five, so none is set).
    opener = think.encode("<think>", add_special_tokens=False)
    assert seen[0][1].grammar_opener == (opener[0] if len(opener) == 1 else None)
    assert seen[1][1].grammar_opener is None
