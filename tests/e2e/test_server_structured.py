"""Structured outputs and tool calls through `kestrel serve` and the official `openai` client.

The model is a tiny random Llama with the bundled demo's chat template (tools, Hermes-style calls), so
the server runs with `--tool-call-parser hermes`; the grammar makes even random weights answer in form.
"""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from transformers import AutoTokenizer

from kestrel.cli import main
from kestrel.engine.tokenizer import apply_chat_template
from kestrel.server.protocol import ChatCompletionRequest
from kestrel.server.tool_parsers import tool_parser
from kestrel.server.tools import tool_use
from tests.e2e.server_process import ServerProcess, wait_idle
from tests.e2e.test_server_hostile import HOSTILE, KeepAlive, raw_json
from tests.grammar_model import make_grammar_model

SCHEMA = {"type": "object", "properties": {"word": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "n"]}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAME = "tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_grammar_model(tmp_path_factory.mktemp("grammar-server-model"))


@pytest.fixture(scope="module")
def server(model):
    with pytest.MonkeyPatch.context() as mp:
        # One torch thread in the engine process: the test machine's cores are shared.
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = ServerProcess(model, "--served-model-name", NAME, "--tool-call-parser", "hermes",
                            "--enable-auto-tool-choice", "--tokenizer-pool-size", "1")  # vLLM's flag, accepted
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_response_format_streamed_or_not(client):
    args = dict(model=NAME, messages=MESSAGES, max_tokens=200, temperature=1.0, response_format=response_format(SCHEMA))
    out = client.chat.completions.create(seed=3, **args)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(seed=3, stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_is_any_object(client, http, model):
    # A random model never closes an unconstrained key string: compare with the engine's grammar instead.
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=4,
                                          response_format={"type": "json_object"})
    ids = apply_chat_template(AutoTokenizer.from_pretrained(model), MESSAGES)
    native = http.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 1.0, "seed": 4, "json_schema": {"type": "object"}}}).json()
    assert chat.choices[0].message.content == native["text"] and native["text"].startswith("{")


def test_sglang_grammar_fields_on_completions_and_generate(client, http):
    out = client.completions.create(model=NAME, prompt="Code:", max_tokens=40,
                                    temperature=1.0, seed=1, extra_body={"regex": r"[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    native = http.post("/generate", json={"text": "Code:", "sampling_params": {
        "max_new_tokens": 200, "temperature": 1.0, "seed": 2, "json_schema": json.dumps(SCHEMA)}})
    assert native.status_code == 200
    jsonschema.validate(json.loads(native.json()["text"]), SCHEMA)
    ebnf = http.post("/generate", json={"text": "Code:", "sampling_params": {
        "max_new_tokens": 40, "ebnf": 'root ::= "<" ("a" | "b")+ ">"'}}).json()
    assert re.fullmatch("<[ab]+>", ebnf["text"]) and ebnf["meta_info"]["finish_reason"]["type"] == "stop"


CHOICES = ['say "maybe"', "back\\slash", "tab\there"]  # each must come out as written, escapes and all


@pytest.mark.parametrize("spec, check", [
    ({"regex": r"[A-Z]{2}-[0-9]{3}"}, lambda text: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text)),
    ({"choice": CHOICES}, lambda text: text in CHOICES),
    ({"grammar": 'root ::= "<" ("a" | "b")+ ">"'}, lambda text: re.fullmatch("<[ab]+>", text)),
    ({"json": SCHEMA, "disable_additional_properties": True}, lambda text: jsonschema.validate(json.loads(text), SCHEMA)
     is None),
    ({"json": json.dumps(SCHEMA)}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
])
def test_vllm_structured_outputs_constrain_completions(client, spec, check):
    for seed in (1, 2):
        out = client.completions.create(model=NAME, prompt="Answer:", max_tokens=200, temperature=1.0, seed=seed,
                                        extra_body={"structured_outputs": spec})
        assert check(out.choices[0].text), out.choices[0].text
        assert out.choices[0].finish_reason == "stop"


def test_vllm_structured_outputs_json_object_is_response_formats(client):
    args = dict(model=NAME, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=4)
    vllm = client.chat.completions.create(extra_body={"structured_outputs": {"json_object": True}}, **args)
    openai_way = client.chat.completions.create(response_format={"type": "json_object"}, **args)
    assert vllm.choices[0].message.content == openai_way.choices[0].message.content


def test_invalid_grammars_are_a_400_with_the_compilers_message_and_the_server_goes_on(client, http):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                       response_format=response_format({"type": "object", "properties": {
                                           "a": {"type": "strin"}}}))
    error = info.value.body
    assert 'Unsupported type "strin"' in error["message"] and error["param"] == "response_format"
    bad_regex = http.post("/generate", json={"text": "x", "sampling_params": {"regex": "a(b"}})
    assert bad_regex.status_code == 400 and "parenthesis is not closed" in bad_regex.json()["error"]["message"]
    assert bad_regex.json()["error"]["param"] == "regex"
    for body in ({"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema"}},
                 {"regex": "a", "ebnf": 'root ::= "a"'}, {"response_format": {"type": "json_object"}, "regex": "a"},
                 {"regex": "\ud800"}):
        # ASCII JSON: "\ud800" goes as an escape, as a client can send it (httpx would refuse the character).
        answer = http.post("/v1/chat/completions", content=json.dumps({"messages": MESSAGES, "max_tokens": 5, **body}),
                           headers={"content-type": "application/json"})
        assert answer.status_code == 400, (body, answer.text)
    assert http.get("/health").status_code == 200
    ok = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 10, "regex": "ok"}})
    assert ok.json()["text"] == "ok"
    wait_idle(http)


def accumulate(chunks) -> tuple[str, list[dict], str]:
    """Streamed chat chunks as the openai client's users accumulate them: content, calls, finish reason."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for entry in choice.delta.tool_calls or []:
            if entry.index == len(calls):
                calls.append({"id": entry.id, "name": entry.function.name, "arguments": ""})
            calls[entry.index]["arguments"] += entry.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_streamed_or_not(client, tool_choice):
    args = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                parallel_tool_calls=False, max_tokens=300, temperature=1.0)
    out = client.chat.completions.create(seed=0, **args)
    message = out.choices[0].message
    # A named function finishes with "stop", as OpenAI answers it: the caller chose the call.
    expected_finish = "stop" if isinstance(tool_choice, dict) else "tool_calls"
    assert out.choices[0].finish_reason == expected_finish and message.content is None
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    content, calls, finish = accumulate(client.chat.completions.create(seed=0, stream=True, **args))
    assert (content, finish) == ("", expected_finish)
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_logprobs_under_a_grammar_are_finite_and_keep_their_count(client):
    """The grammar masks out all but a few tokens at most steps: their -inf logprobs come at vLLM's
    floor (-9999.0), never as a 500 (JSON has no -inf), and every step keeps its 5 top entries."""
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=40, logprobs=True, top_logprobs=5, seed=1)
    content = out.choices[0].logprobs.content
    assert content and all(len(step.top_logprobs) == 5 for step in content)
    tops = [top.logprob for step in content for top in step.top_logprobs]
    assert all(-9999.0 <= lp <= 0.0 for lp in tops) and -9999.0 in tops
    assert all(step.logprob > -9999.0 for step in content)  # a chosen token was allowed


def both_ways(client, **args) -> tuple[tuple[str | None, list[tuple[str, str]], str], int]:
    """((content, calls, finish_reason), completion tokens) of a chat answer; the streamed answer must read
    the same (an empty streamed content is the whole answer's null)."""
    out = client.chat.completions.create(**args)
    choice = out.choices[0]
    whole = (choice.message.content, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
             choice.finish_reason)
    content, calls, finish = accumulate(client.chat.completions.create(stream=True, **args))
    assert (content or None, [(c["name"], c["arguments"]) for c in calls], finish) == whole, args["max_tokens"]
    return whole, out.usage.completion_tokens


def test_required_calls_end_with_the_models_calls_and_cut_calls_read_the_same_streamed_or_not(client):
    """OpenAI's default parallel_tool_calls: the grammar allows another call after each one; the greedy
    random model repeats its call, which ends the calls before max_tokens, all parsed. Then a max_tokens
    sweep over that answer: the complete calls are tool_calls (the uncut answer's, in order), a cut
    trailing call is content, and the streamed answer reads exactly as the whole one."""
    args = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0)
    (content, full_calls, finish), used = both_ways(client, max_tokens=300, **args)
    assert finish == "tool_calls" and content is None and full_calls and used < 300
    for name, arguments in full_calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert len(set(full_calls)) == len(full_calls)
    for max_tokens in sorted({*range(3, used, max(1, used // 5)), used - 1}):
        (content, calls, finish), _ = both_ways(client, max_tokens=max_tokens, **args)
        assert calls == full_calls[:len(calls)], max_tokens
        assert finish == "length" or (finish == "tool_calls" and calls == full_calls), max_tokens
        if content is not None:  # only a cut call's markup
            assert finish == "length" and content.startswith("<tool_call>"[:len(content)]), (max_tokens, content)


def test_refusals_under_speculative_decoding_name_the_field_the_client_sent(model):
    """Prompt logprobs are refused with speculative decoding: the 400 names the request's own field, on
    every route, whatever SamplingParams field it set. Grammars, penalties and min_tokens are served."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = ServerProcess(model, "--tool-call-parser", "hermes", "--tokenizer-pool-size", "1",
                            "--speculative-algorithm", "NGRAM")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            requests = [("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "logprobs"),
                        ("/generate", {"text": "x", "return_logprob": True, "logprob_start_len": 0},
                         "logprob_start_len")]
            for path, body, param in requests:
                answer = http.post(path, json={"max_tokens": 4, **body} if path != "/generate" else body)
                assert answer.status_code == 400, (path, body, answer.text)
                error = answer.json()["error"]
                assert error["param"] == param and "speculative decoding" in error["message"], (path, body, error)
            assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}).status_code == 200
            for fields in ({"frequency_penalty": 0.5, "presence_penalty": 0.5}, {"repetition_penalty": 1.1},
                           {"min_tokens": 3}):
                answer = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, **fields})
                assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 3, answer.text
            small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False}
            answer = http.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 200, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "small", "schema": small}}})
            assert answer.status_code == 200, answer.text
            jsonschema.validate(json.loads(answer.json()["choices"][0]["message"]["content"]), small)
            tools = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 300, "temperature": 0,
                                                            "tools": TOOLS, "tool_choice": "required"}).json()
            for call in tools["choices"][0]["message"]["tool_calls"]:
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    finally:
        srv.stop()


def test_the_template_gets_the_tools_and_a_tool_conversation_renders(client):
    args = dict(model=NAME, max_tokens=1, temperature=0)
    plain = client.chat.completions.create(messages=MESSAGES, **args).usage.prompt_tokens
    auto = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, **args).usage.prompt_tokens
    none = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="none", **args).usage.prompt_tokens
    assert auto > plain == none
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.chat.completions.create(messages=history, tools=TOOLS, **args).usage.prompt_tokens > auto


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "must be 1 to 64"),
    ({"tools": TOOLS[:1] * 2}, "tools", "unique"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(fields, param, message):
    from kestrel.server.errors import APIError

    with pytest.raises(APIError) as info:
        tool_use(body(**fields), tool_parser("hermes"))
    assert info.value.status == 400 and info.value.param == param and message in info.value.message
    with pytest.raises(APIError, match="start it with --tool-call-parser"):
        tool_use(body(tools=TOOLS), None)
    assert tool_use(body(tools=TOOLS, tool_choice="none"), None) is None


def test_tool_choice_and_a_response_format_cannot_both_constrain(http):
    answer = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                                                     "response_format": {"type": "json_object"}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice"


def test_a_long_compile_stalls_no_other_request(client, http):
    """A schema that compiles for a while (a long enum) waits alone: a plain request sent meanwhile
    answers at its usual speed. The schema's own answer is a 200 that follows it, or, when a loaded
    machine makes the compile outlast --grammar-compile-timeout, a 400 that says so."""
    schema = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(12000)]}},
              "required": ["v"]}
    outcome: dict[str, object] = {}

    def constrained() -> None:
        start = time.monotonic()
        try:
            out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=60,
                                                 response_format=response_format(schema))
            jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        except openai.BadRequestError as e:
            outcome["error"] = e.body
        outcome["seconds"] = time.monotonic() - start

    def plain() -> float:
        start = time.monotonic()
        http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3}}).raise_for_status()
        return time.monotonic() - start

    alone = min(plain() for _ in range(3))
    first = threading.Thread(target=constrained)
    first.start()
    time.sleep(1.0)  # the constrained request has reached the engine: its compile runs
    during = plain()
    first.join()
    if "error" in outcome:
        assert "did not compile within" in outcome["error"]["message"], outcome
        assert outcome["error"]["param"] == "response_format"
    # Old engine: the plain request waits out the compile (~the whole constrained request).
    assert during < max(10 * alone, outcome["seconds"] / 4), (alone, during, outcome)
    wait_idle(http)


def test_an_unknown_tool_call_parser_fails_at_start_up(model, capsys):
    assert main(["serve", "--model", model, "--tool-call-parser", "mistral"]) == 2
    assert "unknown tool call parser 'mistral'; valid ones: llama3, qwen25, hermes" in capsys.readouterr().err


def test_hostile_grammar_and_tool_fields_are_never_a_5xx(server, http):
    valid_tool = TOOLS[0]
    cases = []
    for value in HOSTILE:
        for field in ("response_format", "structured_outputs", "json_schema", "regex", "ebnf", "tools", "tool_choice",
                      "parallel_tool_calls"):
            cases.append(("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, field: value}))
        cases.append(("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "tools": [valid_tool],
                                               "tool_choice": "required", "parallel_tool_calls": False,
                                               "response_format": value}))
        cases.append(("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": value}}], "tool_choice": "required"}))
        for field in ("json_schema", "regex", "ebnf", "structural_tag"):
            cases.append(("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1, field: value}}))
    conn = KeepAlive(server)
    try:
        for path, body in cases:
            status, payload = conn.post(path, raw_json(body))
            assert status in (200, 400), (path, body, status, payload)
            if status == 400:
                assert payload["error"]["message"], payload
    finally:
        conn.close()
    assert http.get("/health").status_code == 200
    wait_idle(http)
