"""Reasoning in model output, one parser per format, chosen by `--reasoning-parser`.

A reasoning model thinks before it answers; the parser splits the text so far into the reasoning
(`reasoning_content` of chat answers) and the rest: what follows it, read by the tool-call parser when
the request has tools, else turned into the content by `content()`. Both only grow as the text does
(text that may still turn out to be a marker is held back), so streamed deltas add up to the whole
answer's reading. The names are SGLang's and vLLM's.

- `deepseek-r1` (DeepSeek-R1, QwQ, Qwen3 thinking-2507 models): the chat template opens `<think>` in the
  prompt, so the answer starts in the reasoning (an opening `<think>` the model writes again is dropped)
  and `</think>` ends it; an answer without `</think>` is all reasoning.
- `qwen3` (Qwen3's hybrid models): reasoning only when the answer opens with `<think>` (with
  `enable_thinking: false` in chat_template_kwargs the template closes the block in the prompt, and the
  answer is content).
- `gpt-oss` (harmony): the `analysis` channel's messages are the reasoning; the rest is the other
  messages, markup kept for the `gpt-oss` tool-call parser; its content is the `final` and commentary
  messages' text. Its markers are special tokens, so its answers are detokenized keeping them.
"""
from __future__ import annotations

from dataclasses import dataclass

from kestrel.server import harmony
from kestrel.server.tool_parsers import held_back


@dataclass
class ReasoningSplit:
    reasoning: str
    rest: str


class ReasoningParser:
    name = ""
    # The format's markers are special tokens: the text must keep them (skip_special_tokens off).
    needs_special_tokens = False

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """Reasoning and rest of `text`, an answer so far (`final`: the whole answer)."""
        raise NotImplementedError

    def content(self, rest: str, final: bool) -> str:
        """The content of the rest when no tool-call parser reads it."""
        return rest


class ThinkParser(ReasoningParser):
    """`<think>reasoning</think>rest`."""

    open_tag, close_tag = "<think>", "</think>"
    starts_in_reasoning = False  # the template opened the block in the prompt

    def split(self, text: str, final: bool) -> ReasoningSplit:
        lead = text.lstrip()
        if lead.startswith(self.open_tag):
            start = len(text) - len(lead) + len(self.open_tag)
        elif not final and self.open_tag.startswith(lead):  # whitespace, or the tag's start: wait
            return ReasoningSplit("", "")
        elif self.starts_in_reasoning:
            start = 0
        else:
            return ReasoningSplit("", text)
        end = text.find(self.close_tag, start)
        if end < 0:
            reasoning = text[start:]
            return ReasoningSplit(reasoning if final else held_back(reasoning, self.close_tag), "")
        return ReasoningSplit(text[start:end], text[end + len(self.close_tag):])


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek-r1"
    starts_in_reasoning = True


class Qwen3Parser(ThinkParser):
    name = "qwen3"


class GptOssReasoningParser(ReasoningParser):
    name = "gpt-oss"
    needs_special_tokens = True

    def split(self, text: str, final: bool) -> ReasoningSplit:
        messages = harmony.read_messages(text, final)
        return ReasoningSplit("\n\n".join(m.body for m in messages if harmony.is_reasoning(m)),
                              "".join(text[m.start:m.end] for m in messages if not harmony.is_reasoning(m)))

    def content(self, rest: str, final: bool) -> str:
        return harmony.content_of(harmony.read_messages(rest, final))


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1Parser, "qwen3": Qwen3Parser, "gpt-oss": GptOssReasoningParser}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ValueError naming the valid ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; valid ones: {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()
