"""Reasoning parsers, alone and before a tool-call parser, on handwritten answers: the whole answer's
reading, and streams cut at every character, in every chunking tried, adding up to it."""
from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from kestrel.server.chat_output import ChatOutput
from kestrel.server.reasoning_parsers import REASONING_PARSERS, reasoning_parser
from kestrel.server.tool_parsers import ToolCallStream, tool_parser

CALL = '{"city": "Oslo", "note": "a <|fake|> \\"quoted\\" } brace"}'
# (reasoning parser, tool-call parser or None, answer, reasoning, content, [(name, arguments)])
CASES = [
    ("gpt-oss", "gpt-oss", "<|channel|>analysis<|message|>The user greets.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>", "The user greets.", "Hello!", []),
    ("gpt-oss", "gpt-oss", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
     f"commentary to=functions.get_weather <|constrain|>json<|message|>{CALL}<|call|>", "Need the weather.", None,
     [("get_weather", CALL)]),
    ("gpt-oss", "gpt-oss", "<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant to=functions.now"
     "<|channel|>commentary json<|message|>{}<|call|><|start|>assistant<|channel|>commentary to=functions.get_weather"
     f" <|constrain|>json<|message|>{CALL}<|call|>", "Two calls.", None, [("now", "{}"), ("get_weather", CALL)]),
    ("gpt-oss", "gpt-oss", "<|channel|>analysis<|message|>Say something first.<|end|><|start|>assistant<|channel|>"
     "commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>analysis<|message|>Now call.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}<|call|>",
     "Say something first.\n\nNow call.", "Let me check.", [("now", "{}")]),
    ("gpt-oss", "gpt-oss", "<|channel|>analysis<|message|>Bad JSON.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.now <|constrain|>json<|message|>{"x": tru}<|call|>', "Bad JSON.", '{"x": tru}', []),
    ("gpt-oss", "gpt-oss", "<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>analysis "
     'to=browser.search<|message|>{"q": "x"}<|call|>', "Search.", None, []),
    ("gpt-oss", "gpt-oss", "No channels at all, a <| b.", "", "No channels at all, a <| b.", []),
    ("gpt-oss", "gpt-oss", "<|channel|>final<|message|>Only the answer, no end", "", "Only the answer, no end", []),
    ("gpt-oss", None, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Done.<|return|>", "Think.", "Done.", []),
    ("gpt-oss", None, "<|channel|>analysis<|message|>Cut in the middle of thinking", "Cut in the middle of thinking",
     "", []),
    ("gpt-oss", None, "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>final<|message|>B."
     "<|endoftext|>", "A.", "B.", []),
    ("deepseek-r1", None, "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer.", "Step 1.\nStep 2.", "The answer.", []),
    ("deepseek-r1", None, "Opened in the prompt.</think>Answer.", "Opened in the prompt.", "Answer.", []),
    ("deepseek-r1", None, "Never closed <thin", "Never closed <thin", "", []),
    ("qwen3", None, "<think>\nHmm.\n</think>\n\nHi.", "Hmm.", "Hi.", []),
    ("qwen3", None, "No thinking, a <thought> later.", "", "No thinking, a <thought> later.", []),
    ("qwen3", "hermes", '<think>Call it.</think>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Call it.", None, [("now", "{}")]),
    ("deepseek-r1", "hermes", 'Plan.</think>Sure. <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Plan.", "Sure.", [("now", "{}")]),
    # A call written before the thinking closes is a call all the same, counted with the answer's.
    ("qwen3", "hermes", '<think>Look it up. <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\nThen.'
     '</think>\nDone. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Look it up. \nThen.", "Done.", [("now", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ("deepseek-r1", "hermes", 'Never closes. <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Never closes.", None, [("now", "{}")]),
]


def cases() -> list:
    return [pytest.param(*case, id=f"{case[0]}+{case[1]}-{i}") for i, case in enumerate(CASES)]


def new_output(reasoning: str, tools: str | None) -> ChatOutput:
    counter = itertools.count()
    stream = ToolCallStream(tool_parser(tools), lambda: f"call_{next(counter)}") if tools else None
    return ChatOutput(reasoning_parser(reasoning)(), stream)


def read(reasoning: str, tools: str | None, pieces: list[str]) -> tuple[str, str | None, list[tuple[str, str]]]:
    """(reasoning, content, calls) as a client assembles them from the deltas of `pieces`, the last final."""
    output = new_output(reasoning, tools)
    deltas = [output.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces or [""])]
    calls = [(e["function"]["name"], e["function"]["arguments"]) for d in deltas for e in d.tool_calls]
    for _, arguments in calls:  # a call goes out whole
        json.loads(arguments)
    content = "".join(d.content for d in deltas)
    # What the non-streamed answer reports is what the deltas added up to.
    assert (output.reasoning, output.content, [(c.name, c.arguments) for c in output.calls]) == \
        ("".join(d.reasoning for d in deltas), content, calls)
    return "".join(d.reasoning for d in deltas), content or None, calls


@pytest.mark.parametrize("parser, tools, text, reasoning, content, calls", cases())
def test_whole_answers(parser, tools, text, reasoning, content, calls):
    assert read(parser, tools, [text]) == (reasoning, content or None, calls)


def chunkings(text: str) -> list[list[str]]:
    rng = random.Random(text)
    out = [list(text)]
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("parser, tools, text, reasoning, content, calls", cases())
def test_every_split_of_a_stream_reads_as_the_whole(parser, tools, text, reasoning, content, calls):
    """Character by character and in random chunks, the answer and every prefix of it (an answer cut by
    max_tokens anywhere) read as they do whole: markers split across chunks never leak."""
    inside_markers = {i for m in MARKUP.finditer(text) for i in range(m.start() + 1, m.end())}
    for cut in range(len(text) + 1):
        whole = read(parser, tools, [text[:cut]])
        for pieces in chunkings(text[:cut]) if cut in (len(text), len(text) // 2) else [list(text[:cut])]:
            assert read(parser, tools, pieces) == whole, (cut, pieces)
        if cut not in inside_markers:  # a marker is one token: a cut never splits it
            assert not MARKUP.search(whole[0] + (whole[1] or "")), cut  # no markup reaches the client


# The formats' markers (the test answers' own text holds none of these).
MARKUP = re.compile(r"<\|(start|end|message|channel|return|call|constrain|endoftext)\|>|</?think>")


def test_analysis_never_reaches_content_while_streaming():
    output = new_output("gpt-oss", "gpt-oss")
    text = ("<|channel|>analysis<|message|>secret plan<|end|><|start|>assistant<|channel|>final<|message|>"
            "public<|return|>")
    sent = [output.feed(ch) for ch in text]
    assert "".join(d.content for d in sent) == "public" and "".join(d.reasoning for d in sent) == "secret plan"
    # The content starts only once the final channel's header is whole.
    first_content = next(i for i, d in enumerate(sent) if d.content)
    assert text[:first_content + 1].endswith("<|message|>p")


def test_an_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; valid ones: deepseek-r1, qwen3, gpt-oss"):
        reasoning_parser("r1")
    assert set(REASONING_PARSERS) == {"deepseek-r1", "qwen3", "gpt-oss"}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "now"}}])
def test_gpt_oss_refuses_forced_tool_calls_with_a_400(tool_choice):
    from kestrel.server.errors import APIError
    from kestrel.server.protocol import ChatCompletionRequest
    from kestrel.server.tools import tool_use

    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tool_choice": tool_choice,
        "tools": [{"type": "function", "function": {"name": "now"}}]})
    with pytest.raises(APIError) as refused:
        tool_use(body, tool_parser("gpt-oss"))
    assert refused.value.status == 400 and refused.value.param == "tool_choice"
    assert "--tool-call-parser gpt-oss" in refused.value.message and "'auto'" in refused.value.message


@pytest.mark.parametrize("tools, reasoning, message", [
    (None, "think", "unknown reasoning parser 'think'; valid ones: deepseek-r1, qwen3, gpt-oss"),
    ("gpt-oss", None, "--tool-call-parser gpt-oss needs --reasoning-parser gpt-oss"),
    ("hermes", "gpt-oss", "only --tool-call-parser gpt-oss reads, not hermes"),
])
def test_bad_parser_flags_fail_at_start_up(tools, reasoning, message):
    from kestrel.config import EngineConfig
    from kestrel.config_resolve import resolve_config

    with pytest.raises(ValueError, match=message):
        resolve_config(EngineConfig.from_flat(device="cpu", tool_call_parser=tools, reasoning_parser=reasoning))
