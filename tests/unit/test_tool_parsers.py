"""Tool-call parsers on handwritten model outputs: whole answers, and streams cut at every character.

The stream oracle is the whole-answer parse: the content deltas join to its content, and the
tool-call deltas, accumulated the way the openai client does, give its calls (names and arguments).
"""
from __future__ import annotations

import itertools
import json

import pytest

from kestrel.server.tool_parsers import PARSERS, ToolCallStream, parse_tool_calls, tool_parser


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


WEATHER = '{"city": "Paris", "days": [1, 2], "note": "a \\"quoted\\" } brace"}'
CASES = {
    "hermes": [
        # (model output, content, [(name, arguments)])
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', None,
         [("get_weather", WEATHER)]),
        (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
         '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "Let me look.",
         [("get_weather", WEATHER), ("now", "{}")]),
        ('<tool_call>{"name":"now"}</tool_call>', None, [("now", "{}")]),  # no arguments: none
        ("Plain answer, a < b and <tool but no call.", "Plain answer, a < b and <tool but no call.", []),
        ("<tool_call>\nnot json\n</tool_call> done", "<tool_call>\nnot json\n</tool_call> done", []),
    ],
    "llama3": [
        (f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
        (f'  {{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "now", "arguments": {{}}}}', None,
         [("get_weather", WEATHER), ("now", "{}")]),
        (f'Sure.<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}', "Sure.",
         [("get_weather", WEATHER)]),
        ('The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
        ('{"oops": }', '{"oops": }', []),
    ],
}
CASES["qwen25"] = CASES["hermes"]


def cases() -> list:
    return [pytest.param(name, *item, id=f"{name}-{i}") for name, items in CASES.items() for i, item in enumerate(items)]


@pytest.mark.parametrize("parser_name, text, content, calls", cases())
def test_whole_answers_parse(parser_name, text, content, calls):
    got_content, got = parse_tool_calls(tool_parser(parser_name), text, ids())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert len({c.id for c in got}) == len(got)
    for c in got:
        json.loads(c.arguments)


def accumulate(entries: list[dict]) -> list[dict]:
    """Tool-call deltas as a client accumulates them: by index, the first names the call, arguments add up."""
    calls: list[dict] = []
    for entry in entries:
        if entry["index"] == len(calls):
            assert entry["id"] and entry["type"] == "function" and entry["function"]["name"]
            calls.append({"id": entry["id"], "name": entry["function"]["name"], "arguments": ""})
        else:
            assert "id" not in entry and "name" not in entry["function"]
        calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return calls


@pytest.mark.parametrize("parser_name, text, content, calls", cases())
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streams_add_up_to_the_whole_answer(parser_name, text, content, calls, chunk):
    stream = ToolCallStream(tool_parser(parser_name), ids())
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(c for c, _ in deltas) == (content or "")
    got = accumulate([e for _, entries in deltas for e in entries])
    assert [(c["name"], c["arguments"]) for c in got] == calls
    assert len(stream.calls) == len(calls)


def test_a_stream_sends_a_call_whole_once_its_object_closes():
    stream = ToolCallStream(tool_parser("hermes"), ids())
    assert stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa') == ("", [])
    content, entries = stream.feed('ris"}}')
    assert content == "" and entries == [{"index": 0, "id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    # Text that may start a call (and trailing whitespace) is held back, then let go once it is not one.
    assert stream.feed("\n</tool_call>\nok <tool")[0] == "ok"
    assert stream.feed("s", final=True)[0] == " <tools"


def streamed(parser_name: str, text: str, chunk: int) -> tuple[str | None, list[tuple[str, str]], bool]:
    """(content, calls, ended) of `text` fed in pieces of `chunk` characters, the last one final."""
    stream = ToolCallStream(tool_parser(parser_name), ids())
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)] or [""]
    deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    entries = [e for _, es in deltas for e in es]
    for entry in entries:  # a call goes out whole: never arguments that are not yet JSON
        json.loads(entry["function"]["arguments"])
    calls = [(c["name"], c["arguments"]) for c in accumulate(entries)]
    return "".join(c for c, _ in deltas) or None, calls, stream.ended


def call_objects(text: str) -> tuple[list[int], list[int]]:
    """Where each call object of a whole answer starts and ends (a naive reading: every '{"name"'
    starts one)."""
    decoder, starts, ends, i = json.JSONDecoder(), [], [], text.find('{"name"')
    while i >= 0:
        starts.append(i)
        ends.append(decoder.raw_decode(text, i)[1])
        i = text.find('{"name"', ends[-1])
    return starts, ends


@pytest.mark.parametrize("parser_name, text, content, calls", [p for p in cases() if p.values[3] and p.values[0] != "qwen25"])
def test_an_answer_cut_anywhere_reads_the_same_streamed_or_whole(parser_name, text, content, calls):
    """Cut at every character (as max_tokens cuts): the calls whose object is whole are the calls, an
    open one is content, and streaming (any chunking) gives exactly the whole answer's reading."""
    starts, ends = call_objects(text)
    assert len(ends) == len(calls)
    for cut in range(len(text) + 1):
        whole_content, whole_calls = parse_tool_calls(tool_parser(parser_name), text[:cut], ids())
        got = (whole_content, [(c.name, c.arguments) for c in whole_calls])
        assert got[1] == calls[:sum(end <= cut for end in ends)], cut
        for chunk in (2, 7):
            assert streamed(parser_name, text[:cut], chunk) == (*got, False), (cut, chunk)
        if any(start < cut < end for start, end in zip(starts, ends)):  # inside a call: its text is content
            assert got[0] is not None and got[0].endswith(text[:cut].rstrip()[-1])


REPEAT = ('<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": [2]}}\n</tool_call>\n'
          '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "f", "arguments": {"b": [2], "a": 1}}\n</tool_call>\nmore text')


@pytest.mark.parametrize("chunk", [1, 4, len(REPEAT)])
def test_a_repeated_call_ends_the_calls(chunk):
    """The third call repeats the first (equal arguments, other key order): the calls end before it."""
    content, calls, ended = streamed("hermes", REPEAT, chunk)
    assert (content, calls, ended) == (None, [("f", '{"a": 1, "b": [2]}'), ("f", '{"a": 2}')], True)
    whole = parse_tool_calls(tool_parser("hermes"), REPEAT, ids())
    assert (whole[0], [(c.name, c.arguments) for c in whole[1]]) == (content, calls)


def test_a_malformed_call_is_content_and_the_others_stay_calls():
    text = ('<tool_call>\n{"name": "f", "arguments": {"x": tru}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(tool_parser("hermes"), text, ids())
    assert content == '<tool_call>\n{"name": "f", "arguments": {"x": tru}}\n</tool_call>'
    assert [(c.name, c.arguments) for c in calls] == [("g", "{}")]
    assert streamed("hermes", text, 3) == (content, [("g", "{}")], False)


@pytest.mark.parametrize("parser_name", sorted(name for name, parser in PARSERS.items() if parser.can_force))
def test_forced_call_grammars_name_the_parsers_format(parser_name):
    parser = tool_parser(parser_name)
    functions = [{"name": "f", "parameters": {"type": "object"}}, {"name": "g", "parameters": {"type": "object"}}]
    forced = parser.grammar(functions, "g", parallel=True)["format"]
    assert forced["type"] == "tag" and '"g"' in forced["begin"] and '"f"' not in json.dumps(forced)
    any_call = parser.grammar(functions, None, parallel=False)["format"]
    assert any_call["type"] == "tags_with_separator" and any_call["at_least_one"] and any_call["stop_after_first"]
    # What the grammar writes around a call's arguments, the parser reads back.
    tag = any_call["tags"][0]
    text = tag["begin"] + '{"x": 1}' + tag["end"]
    assert [(c.name, c.arguments) for c in parse_tool_calls(parser, text, ids())[1]] == [("f", '{"x": 1}')]


def test_an_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'; valid ones: llama3, qwen25, hermes, gpt-oss"):
        tool_parser("mistral")


def test_the_demo_template_renders_tools_and_calls_in_the_hermes_format():
    from transformers import AutoTokenizer

    from kestrel.assets import resolve_model_path
    from kestrel.engine.tokenizer import apply_chat_template_text

    tok = AutoTokenizer.from_pretrained(resolve_model_path("demo"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = apply_chat_template_text(tok, messages, tools=tools)
    assert json.dumps(tools[0]) in text and text.endswith("<|tool|>sunny<|eos|><|assistant|>")
    # What the template writes for the assistant's calls is what the hermes parser reads back.
    answer = text.split("<|assistant|>")[1].split("<|eos|>")[0]
    parsed = parse_tool_calls(tool_parser("hermes"), answer, ids())
    assert parsed[0] is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed[1]] == [("get_weather", {"city": "Oslo"}), ("now", {})]
    # Without tools the template renders as it always did.
    assert apply_chat_template_text(tok, messages[:1]) == "<|bos|><|user|>weather?<|eos|><|assistant|>"


def test_malformed_tool_calls_in_messages_are_a_value_error():
    from kestrel.engine.tokenizer import normalize_messages

    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls must be a list"):
        normalize_messages([{"role": "assistant", "content": None, "tool_calls": [{"function": "f"}]}])
    with pytest.raises(ValueError, match="has no 'content'"):
        normalize_messages([{"role": "user", "tool_calls": []}])
