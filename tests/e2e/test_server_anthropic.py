"""Anthropic's Messages API through the official `anthropic` client: text, streaming, stop_sequences, a
tool_use round trip in the hermes format, thinking blocks from the qwen3 reasoning parser, count_tokens, and
errors in Anthropic's shape. The app runs in process over a scripted fake engine (`tests.e2e.scripted_chat`)."""
from __future__ import annotations

import anthropic
import httpx2
import pytest

from tests.e2e.scripted_chat import serve
from tests.tiny_tokenizer import build_tokenizer

WEATHER_TOOL = {"name": "get_weather", "description": "the weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def client_of(http) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(api_key="none", base_url="http://kestrel", http_client=http, max_retries=0)


def test_text_streamed_or_not_and_stop_sequences(tokenizer):
    async def scenario(http) -> None:
        client = client_of(http)
        out = await client.messages.create(model="fake", max_tokens=64, system="Be kind.",
                                           messages=[{"role": "user", "content": "Hi"}])
        assert (out.type, out.role, out.model, out.stop_reason, out.stop_sequence) == \
            ("message", "assistant", "fake", "end_turn", None)
        assert [(b.type, b.text) for b in out.content] == [("text", "Hello there, how can I help?")]
        assert out.usage.output_tokens > 0 and out.usage.input_tokens > 0

        async with client.messages.stream(model="fake", max_tokens=64,
                                          messages=[{"role": "user", "content": "Hi"}]) as stream:
            texts = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(texts) == "Hello there, how can I help?" and len(texts) > 1
        assert final.content[0].text == "Hello there, how can I help?" and final.stop_reason == "end_turn"

        out = await client.messages.create(model="fake", max_tokens=64, stop_sequences=["four", "three"],
                                           messages=[{"role": "user", "content": "count for me"}])
        assert (out.content[0].text, out.stop_reason, out.stop_sequence) == ("one two", "stop_sequence", "three")
        # The client of this version sends the sampling fields as extra body fields (the API takes them).
        out = await client.messages.create(model="fake", max_tokens=2, extra_body={"temperature": 0.5, "top_p": 0.9,
                                                                                   "top_k": 5},
                                           metadata={"user_id": "u1"}, messages=[{"role": "user", "content": "Hi"}])
        assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 2

    seen = serve(tokenizer, scenario, httpx2)
    assert seen[0][0].startswith("<|bos|><|system|>Be kind.<|eos|><|user|>Hi<|eos|><|assistant|>")
    params = seen[3][1]
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (0.5, 0.9, 5, 2)


def test_a_message_the_server_gives_up_is_an_error(tokenizer):
    """A request the engine aborts (a server shutting down) is an overloaded error, whole or streamed:
    the Messages API has no stop reason that says the answer was cut by the server."""
    async def scenario(http) -> None:
        client = client_of(http)
        ask = dict(model="fake", max_tokens=64, messages=[{"role": "user", "content": "abort please"}])
        with pytest.raises(anthropic.APIStatusError, match="aborted") as whole:
            await client.messages.create(**ask)
        assert whole.value.status_code == 503
        with pytest.raises(anthropic.APIStatusError, match="aborted"):
            async with client.messages.stream(**ask) as stream:
                await stream.get_final_message()

    serve(tokenizer, scenario, httpx2)


def test_tool_use_round_trip_with_thinking(tokenizer):
    async def scenario(http) -> None:
        client = client_of(http)
        ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
        out = await client.messages.create(model="fake", max_tokens=128, tools=[WEATHER_TOOL], messages=ask)
        assert out.stop_reason == "tool_use"
        thinking, call = out.content
        assert (thinking.type, thinking.thinking) == ("thinking", "Call the tool.")
        assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Oslo"})
        assert call.id.startswith("toolu_")

        events = []
        async with client.messages.stream(model="fake", max_tokens=128, tools=[WEATHER_TOOL],
                                          messages=ask) as stream:
            async for event in stream:
                events.append(event.type)
            streamed = await stream.get_final_message()
        assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == \
            [("thinking", None), ("tool_use", {"city": "Oslo"})]
        assert streamed.stop_reason == "tool_use"
        assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_stop" in events

        history = [*ask, {"role": "assistant", "content": [b.model_dump() for b in out.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
        out = await client.messages.create(model="fake", max_tokens=128, tools=[WEATHER_TOOL], messages=history,
                                           tool_choice={"type": "auto"})
        assert (out.content[0].text, out.stop_reason) == ("It is sunny in Oslo.", "end_turn")

    seen = serve(tokenizer, scenario, httpx2)
    # The assistant's turn and the tool's result reached the template as chat messages.
    assert "<|tool|>sunny<|eos|>" in seen[2][0]


def test_thinking_blocks_and_count_tokens(tokenizer):
    async def scenario(http) -> None:
        client = client_of(http)
        ask = [{"role": "user", "content": "think: capital of France?"}]
        out = await client.messages.create(model="fake", max_tokens=64, messages=ask,
                                           thinking={"type": "enabled", "budget_tokens": 1024})
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content] == \
            [("thinking", "A short question."), ("text", "Paris is the capital.")]
        deltas = []
        async with client.messages.stream(model="fake", max_tokens=64, messages=ask) as stream:
            async for event in stream:
                if event.type == "content_block_delta":
                    deltas.append(event.delta.type)
        assert set(deltas) == {"thinking_delta", "text_delta"}
        assert deltas.index("text_delta") > max(i for i, d in enumerate(deltas) if d == "thinking_delta")

        counted = await client.messages.count_tokens(model="fake", system="Be kind.", messages=ask)
        generated = await client.messages.create(model="fake", max_tokens=4, system="Be kind.", messages=ask)
        assert counted.input_tokens == generated.usage.input_tokens > 0

    serve(tokenizer, scenario, httpx2)


def test_errors_in_anthropics_shape(tokenizer):
    async def scenario(http) -> None:
        client = client_of(http)
        hi = [{"role": "user", "content": "Hi"}]
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model="fake", max_tokens=16, extra_body={"temperature": 1.5}, messages=hi)
        assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message":
                                "temperature must be a number in [0, 1], got 1.5"}}
        response = await http.post("/v1/messages", json={"model": "fake", "messages": hi})
        assert response.status_code == 400
        assert response.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": "'max_tokens' is required"}}
        for body, field in [({"max_tokens": 0}, "max_tokens"), ({"stop_sequences": [""]}, "stop_sequences"),
                            ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
                            ({"tool_choice": {"type": "tool"}}, "tool_choice"),
                            ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice")]:
            response = await http.post("/v1/messages", json={"model": "fake", "max_tokens": 16, "messages": hi, **body})
            assert response.status_code == 400, body
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and field in error["message"], (body, error)
        with pytest.raises(anthropic.NotFoundError) as e:
            await client.messages.create(model="claude-nope", max_tokens=16, messages=hi)
        assert e.value.body["error"]["type"] == "not_found_error"
        response = await http.post("/v1/messages/count_tokens", content=b"{not json")
        assert response.status_code == 400 and response.json()["type"] == "error"
        # Still serving.
        out = await client.messages.create(model="fake", max_tokens=16, messages=hi)
        assert out.content[0].text

    serve(tokenizer, scenario, httpx2)
