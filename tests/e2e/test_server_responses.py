"""OpenAI's Responses API through the official `openai` client (`client.responses`): text and streaming
events, instructions, a function call round trip (hermes format) with reasoning items, previous_response_id
and the bounded store, `store: false`, retrieve, errors; and /tokenize, /detokenize in vLLM's shapes. The app
runs in process over a scripted fake engine (`tests.e2e.scripted_chat`)."""
from __future__ import annotations

import json

import openai
import pytest

from kestrel.server.response_store import ResponseStore
from tests.e2e.scripted_chat import serve
from tests.tiny_tokenizer import build_tokenizer

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def client_of(http) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="none", base_url="http://kestrel/v1", http_client=http, max_retries=0)


def test_text_streamed_or_not_and_retrieve(tokenizer):
    async def scenario(http) -> None:
        client = client_of(http)
        out = await client.responses.create(model="fake", input="Hi", instructions="Be kind.", temperature=0.5)
        assert (out.status, out.output_text, out.model) == ("completed", "Hello there, how can I help?", "fake")
        assert out.usage.input_tokens > 0 and out.usage.output_tokens > 0
        # The SDK's own type, strictly: every field it requires is there.
        openai.types.responses.Response.model_validate(out.model_dump(exclude_unset=True))
        assert (await client.responses.retrieve(out.id)).output_text == out.output_text

        kinds, deltas = [], []
        async for event in await client.responses.create(model="fake", input="Hi", stream=True):
            kinds.append(event.type)
            deltas += [event.delta] if event.type == "response.output_text.delta" else []
            final = event.response if event.type == "response.completed" else None
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
        assert "".join(deltas) == final.output_text == "Hello there, how can I help?" and len(deltas) > 1
        assert (await client.responses.retrieve(final.id)).output_text == final.output_text

        out = await client.responses.create(model="fake", input="Hi", max_output_tokens=2, store=False)
        assert (out.status, out.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            await client.responses.retrieve(out.id)

    seen = serve(tokenizer, scenario)
    assert seen[0][0].startswith("<|bos|><|system|>Be kind.<|eos|><|user|>Hi<|eos|><|assistant|>")
    assert seen[0][1].temperature == 0.5 and seen[2][1].max_new_tokens == 2


def test_a_response_the_server_gives_up_fails(tokenizer):
    """A request the engine aborts (a server shutting down) is a failed response, not a completed one."""
    async def scenario(http) -> None:
        client = client_of(http)
        out = await client.responses.create(model="fake", input="abort please")
        assert (out.status, out.error.code) == ("failed", "server_error") and "aborted" in out.error.message
        kinds = [event.type async for event in await client.responses.create(model="fake", input="abort", stream=True)]
        assert kinds[-1] == "response.failed" and "response.completed" not in kinds

    serve(tokenizer, scenario)


def test_function_call_round_trip_with_reasoning(tokenizer):
    async def scenario(http) -> None:
        client = client_of(http)
        out = await client.responses.create(model="fake", input="What is the weather in Oslo?", tools=[WEATHER_TOOL])
        reasoning, call = out.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Call the tool."
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Oslo"})

        kinds, arguments = [], None
        async for event in await client.responses.create(model="fake", input="What is the weather in Oslo?", tools=[WEATHER_TOOL],
                                                         stream=True):
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.done":
                arguments = event.arguments
        assert "response.reasoning_text.delta" in kinds and json.loads(arguments) == {"city": "Oslo"}

        # The result, continuing the stored conversation.
        answer = await client.responses.create(model="fake", previous_response_id=out.id, tools=[WEATHER_TOOL], input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert answer.output_text == "It is sunny in Oslo." and answer.previous_response_id == out.id
        # The same conversation sent whole, as items.
        whole = await client.responses.create(model="fake", tools=[WEATHER_TOOL], input=[
            {"role": "user", "content": "What is the weather in Oslo?"}, *[item.model_dump() for item in out.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert whole.output_text == "It is sunny in Oslo."

    seen = serve(tokenizer, scenario)
    assert seen[2][0] == seen[3][0] and "<|tool|>sunny<|eos|>" in seen[2][0]


def test_bounded_store_and_errors(tokenizer):
    async def scenario(http) -> None:
        client = client_of(http)
        first = await client.responses.create(model="fake", input="Hi")
        second = await client.responses.create(model="fake", input="Hi")
        with pytest.raises(openai.NotFoundError) as e:  # the store holds one: the older is gone
            await client.responses.create(model="fake", input="Hi", previous_response_id=first.id)
        assert e.value.body["param"] == "previous_response_id"
        assert (await client.responses.retrieve(second.id)).id == second.id
        for fields, param in [({"input": [{"type": "web_search_call"}]}, "input"),
                              ({"input": [{"role": "robot", "content": "x"}]}, "input"),
                              ({"input": "Hi", "max_output_tokens": -1}, "max_output_tokens"),
                              ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
                              ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
                              ({"input": "Hi", "temperature": 3}, "temperature")]:
            response = await http.post("/v1/responses", json={"model": "fake", **fields})
            assert response.status_code == 400, fields
            assert response.json()["error"]["param"] == param, (fields, response.json())
        assert (await client.responses.create(model="fake", input="Hi")).output_text  # still serving

    serve(tokenizer, scenario, responses=ResponseStore(1))


def test_tokenize_and_detokenize(tokenizer):
    async def scenario(http) -> None:
        response = await http.post("/tokenize", json={"model": "fake", "prompt": "Hello world"})
        out = response.json()
        assert out["tokens"] == tokenizer.encode("Hello world") and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 1024 and out["token_strs"] is None
        out = (await http.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False,
                                                  "return_token_strs": True})).json()
        assert out["tokens"] == tokenizer.encode("Hello", add_special_tokens=False)
        assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
        chat = [{"role": "user", "content": "Hi"}]
        out = (await http.post("/tokenize", json={"messages": chat})).json()
        assert tokenizer.decode(out["tokens"]) == "<|bos|><|user|>Hi<|eos|><|assistant|>"
        out = (await http.post("/tokenize", json={"messages": chat, "add_generation_prompt": False})).json()
        assert tokenizer.decode(out["tokens"]) == "<|bos|><|user|>Hi<|eos|>"
        assert (await http.post("/detokenize", json={"tokens": out["tokens"]})).json() == \
            {"prompt": "<|bos|><|user|>Hi<|eos|>"}
        for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": chat}, "prompt"),
                                  ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                                  ("/detokenize", {"tokens": "abc"}, "tokens")]:
            response = await http.post(path, json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.json())
        # The schema names these routes, their bodies, and each API's error shape.
        schema = (await http.get("/openapi.json")).json()
        for path, model, errors in [("/v1/responses", "ResponsesRequest", "ErrorResponse"),
                                    ("/v1/messages", "MessagesRequest", "AnthropicErrorResponse"),
                                    ("/tokenize", "TokenizeRequest", "ErrorResponse")]:
            post = schema["paths"][path]["post"]
            assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
            assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(errors)

    serve(tokenizer, scenario)
