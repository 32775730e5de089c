"""Reasoning in model output, one parser per format, chosen by `--reasoning-parser`.

A reasoning model thinks before it answers. One parser reads one answer, fed its text as it grows,
and splits it into the reasoning (`reasoning_content` of chat answers) and the rest: what follows it,
read by the tool-call parser when the request has tools; and the content, the rest as the user reads
it when no tool-call parser does. Each only grows as the text does (text that may still turn out to
be a marker is held back), so streamed deltas add up to the whole answer's reading, and each character
is read about once. The names are SGLang's and vLLM's.

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
class ReasoningDelta:
    """What some text added to an answer's reasoning, rest and content."""

    reasoning: str = ""
    rest: str = ""
    content: str = ""


class ReasoningParser:
    """Reads one answer; a new one for each."""

    name = ""
    # The format's markers are special tokens: the text must keep them (skip_special_tokens off).
    needs_special_tokens = False

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        """What `delta` adds; `final` on the answer's last text."""
        raise NotImplementedError

    @classmethod
    def answer_starts_after(cls, template_kwargs: dict) -> str | None:
        """The marker after which the answer (what a grammar constrains) starts, None if it starts at
        once: with a grammar, the reasoning before it stays free."""
        raise NotImplementedError

    @classmethod
    def opens_with(cls, template_kwargs: dict) -> str | None:
        """The tag the output opens its reasoning with, where the model may also answer at once
        (None: the reasoning is always there, or opened by the prompt)."""
        return None


class ThinkParser(ReasoningParser):
    """`<think>reasoning</think>rest`."""

    open_tag, close_tag = "<think>", "</think>"
    starts_in_reasoning = False  # the template opened the block in the prompt

    def __init__(self) -> None:
        self._in: str | None = None  # "reasoning" or "rest", once known
        self._pending = ""  # text not read yet: before the start is known, or a tail that may be a tag

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        text = self._pending + delta
        out = ReasoningDelta()
        if self._in is None:
            lead = text.lstrip()
            if lead.startswith(self.open_tag):
                self._in, text = "reasoning", lead[len(self.open_tag):]
            elif not final and self.open_tag.startswith(lead):  # whitespace, or the tag's start: wait
                self._pending = text
                return out
            else:
                self._in = "reasoning" if self.starts_in_reasoning else "rest"
        if self._in == "reasoning":
            end = text.find(self.close_tag)
            if end < 0:
                out.reasoning = text if final else held_back(text, self.close_tag)
                self._pending = text[len(out.reasoning):]
                return out
            out.reasoning, self._in, text = text[:end], "rest", text[end + len(self.close_tag):]
        self._pending = ""
        out.rest = out.content = text
        return out

    @classmethod
    def answer_starts_after(cls, template_kwargs: dict) -> str | None:
        return cls.close_tag


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek-r1"
    starts_in_reasoning = True


class Qwen3Parser(ThinkParser):
    name = "qwen3"

    @classmethod
    def answer_starts_after(cls, template_kwargs: dict) -> str | None:
        # Without thinking the template closes the block in the prompt; the model thinks by default.
        return None if template_kwargs.get("enable_thinking") is False else cls.close_tag

    @classmethod
    def opens_with(cls, template_kwargs: dict) -> str | None:
        return cls.open_tag  # a model that skips thinking (or never learnt it) answers at once


class GptOssReasoningParser(ReasoningParser):
    """The analysis messages' bodies are the reasoning, the others' raw text the rest, the bodies of
    those for the user the content; a blank line between two messages of the reasoning or content."""

    name = "gpt-oss"
    needs_special_tokens = True

    def __init__(self) -> None:
        self._reader = harmony.MessageReader()
        self._last: dict[str, int] = {}  # "reasoning"/"content" -> index of the last message that went there

    def _joined(self, kind: str, piece: harmony.Piece) -> str:
        last = self._last.get(kind)
        self._last[kind] = piece.index
        return piece.body if last in (None, piece.index) else "\n\n" + piece.body

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        reasoning, rest, content = [], [], []
        for piece in self._reader.feed(delta, final):
            if harmony.is_reasoning(piece):
                reasoning.append(self._joined("reasoning", piece))
                continue
            rest.append(piece.raw)
            if harmony.is_content(piece):
                content.append(self._joined("content", piece))
        return ReasoningDelta("".join(reasoning), "".join(rest), "".join(content))

    @classmethod
    def answer_starts_after(cls, template_kwargs: dict) -> str | None:
        # The answer is the final channel's message body (written without a <|constrain|> marker).
        return "<|channel|>final<|message|>"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1Parser, "qwen3": Qwen3Parser, "gpt-oss": GptOssReasoningParser}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser called `name` (a class: one instance reads one answer); ValueError naming the valid ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; valid ones: {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
