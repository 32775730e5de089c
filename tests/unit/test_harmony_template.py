"""A harmony-shaped chat template through kestrel's templating: every role, the tools, reasoning_effort
and other template variables; and what it writes for an assistant's calls is what the gpt-oss parsers
read back."""
from __future__ import annotations

import json

import pytest

from kestrel.engine.tokenizer import apply_chat_template, apply_chat_template_text
from kestrel.server.chat_output import ChatOutput
from kestrel.server.reasoning_parsers import reasoning_parser
from kestrel.server.tool_parsers import ToolCallStream, tool_parser
from tests.harmony_tokenizer import HARMONY_TOKENS, build_harmony_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "developer", "content": "Answer in one sentence."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "reasoning_content": "I need the tool.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny and 21 C in Oslo."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_harmony_tokenizer(tmp_path_factory.mktemp("harmony-tokenizer"))


def test_every_role_renders_in_harmony(tokenizer):
    text = apply_chat_template_text(tokenizer, CONVERSATION, tools=TOOLS, template_kwargs={"reasoning_effort": "low"})
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: low\n" in text
    assert "<|start|>developer<|message|># Instructions\nAnswer in one sentence.\n# Tools\nnamespace functions {\n" \
           'type get_weather = (_: {"type": "object", "properties": {"city": {"type": "string"}}}) => any;' in text
    assert "<|start|>user<|message|>Weather in Oslo?<|end|>" in text
    # The reasoning the client sent back (reasoning_content) reaches the template as `thinking`.
    assert "<|start|>assistant<|channel|>analysis<|message|>I need the tool.<|end|>" in text
    assert ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Oslo"}<|call|>') in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny, 21 C<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>It is sunny and 21 C in Oslo.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>Thanks!<|end|><|start|>assistant")
    # Without reasoning_effort the template's own default; without tools no tool namespace.
    plain = apply_chat_template_text(tokenizer, CONVERSATION[1:2])
    assert "Reasoning: medium\n" in plain and "<|start|>developer" not in plain


def test_each_marker_is_one_special_token(tokenizer):
    ids = apply_chat_template(tokenizer, CONVERSATION, tools=TOOLS)
    for marker in HARMONY_TOKENS[:7]:
        assert tokenizer.convert_tokens_to_ids(marker) in tokenizer.all_special_ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == apply_chat_template_text(tokenizer, CONVERSATION, tools=TOOLS)
    assert "<|" not in tokenizer.decode(ids, skip_special_tokens=True)  # why the parsers need them kept


def test_the_templates_calls_read_back_through_the_gpt_oss_parsers(tokenizer):
    """The assistant turn the template writes (analysis, then a call), read as a model's answer."""
    text = apply_chat_template_text(tokenizer, CONVERSATION[:3], tools=TOOLS, add_generation_prompt=False)
    answer = text[text.index("<|start|>user<|message|>Weather in Oslo?<|end|>"):].split("<|end|>", 1)[1]
    answer = answer.removeprefix("<|start|>assistant")  # the generation prompt's part
    output = ChatOutput(reasoning_parser("gpt-oss")(), ToolCallStream(tool_parser("gpt-oss"), lambda: "call_x"))
    delta = output.feed(answer, final=True)
    assert delta.reasoning == "I need the tool." and delta.content == ""
    assert [(e["function"]["name"], json.loads(e["function"]["arguments"])) for e in delta.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]


def test_chat_template_kwargs_may_not_set_what_the_server_sets():
    from kestrel.server.errors import APIError
    from kestrel.server.protocol import ChatCompletionRequest

    def body(**fields):
        return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})

    assert body(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}).template_kwargs() == \
        {"enable_thinking": False, "reasoning_effort": "high"}
    for fields, param, message in [
        ({"chat_template_kwargs": {"tools": [], "add_generation_prompt": False}}, "chat_template_kwargs",
         "may not set add_generation_prompt, tools"),
        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort",
         "given twice"),
    ]:
        with pytest.raises(APIError) as refused:
            body(**fields).check()
        assert refused.value.param == param and message in refused.value.message
