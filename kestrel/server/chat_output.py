"""One chat choice's answer as OpenAI's message fields: `reasoning_content`, `content` and `tool_calls`.

The answer's text goes through the reasoning parser (`--reasoning-parser`), whose rest goes through the
tool-call reading (`ToolCallStream`) when the request has tools, else becomes the content. The server
feeds a `ChatOutput` the same text deltas whether the answer is streamed or not, so both read the same.
Reasoning and content are stripped as `ToolCallStream` strips content: leading whitespace dropped,
trailing whitespace held until text follows it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.server.reasoning_parsers import ReasoningParser
from kestrel.server.tool_parsers import ToolCall, ToolCallStream


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's delta entries


def _grown(sent: str, text: str) -> str:
    """What `text` (stripped) adds to `sent`, the part of it already given out."""
    text = text.strip()
    return text[len(sent):] if len(text) > len(sent) else ""


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallStream | None) -> None:
        assert reasoning is not None or tools is not None, "a plain answer needs no reading"
        self.parser = reasoning
        self.tools = tools
        self.text = ""
        self.rest = ""  # the reasoning parser's rest so far
        self.reasoning = ""  # sent so far
        self._content = ""  # sent so far, without tools

    @property
    def content(self) -> str:
        return self.tools.content if self.tools is not None else self._content

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def ended(self) -> bool:
        """A repeated tool call ended the answer (see ToolCallStream): the caller stops the generation."""
        return self.tools is not None and self.tools.ended

    def feed(self, delta: str, final: bool = False) -> ChatDelta:
        """What `delta` adds to the answer; `final` on its last text. Once `ended`, the rest is ignored."""
        if self.ended:
            return ChatDelta()
        self.text += delta
        out = ChatDelta()
        if self.parser is None:
            rest_delta = delta
        else:
            split = self.parser.split(self.text, final)
            out.reasoning = _grown(self.reasoning, split.reasoning)
            self.reasoning += out.reasoning
            assert split.rest.startswith(self.rest), "a reasoning parser's rest only grows"
            rest_delta, self.rest = split.rest[len(self.rest):], split.rest
        if self.tools is not None:
            out.content, out.tool_calls = self.tools.feed(rest_delta, final)
        else:
            out.content = _grown(self._content, self.parser.content(self.rest, final))
            self._content += out.content
        return out
