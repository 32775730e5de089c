"""One chat choice's answer as OpenAI's message fields: `reasoning_content`, `content` and `tool_calls`.

The answer's text goes through the reasoning parser (`--reasoning-parser`); what follows the reasoning
goes through the tool-call reading (`ToolCallStream`) when the request has tools, else it is the
content. With tools, the reasoning goes through a tool-call reading of its own too, whose calls join
the answer's: a model that writes a call before it closes its thinking has made that call. The server
feeds a `ChatOutput` the same text deltas whether the answer is streamed or not, so both read the same. Reasoning and content are stripped as `ToolCallStream` strips content: leading
whitespace dropped, trailing whitespace held until text follows it.
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


class _Stripped:
    """A text given out as it grows, stripped: leading whitespace dropped, trailing whitespace held."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self._held = ""

    def add(self, text: str) -> str:
        if not self.parts and not self._held:
            text = text.lstrip()
        text = self._held + text
        out = text.rstrip()
        self._held = text[len(out):]
        if out:
            self.parts.append(out)
        return out

    def __str__(self) -> str:
        return "".join(self.parts)


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallStream | None) -> None:
        assert reasoning is not None or tools is not None, "a plain answer needs no reading"
        self.parser = reasoning
        self.tools = tools
        self._thinking = tools.beside() if tools is not None and reasoning is not None else None
        self._reasoning = _Stripped()  # without tools
        self._content = _Stripped()  # without tools

    @property
    def reasoning(self) -> str:
        return self._thinking.content if self._thinking is not None else str(self._reasoning)

    @property
    def content(self) -> str:
        return self.tools.content if self.tools is not None else str(self._content)

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def ended(self) -> bool:
        """A repeated tool call ended the answer (see ToolCallStream): the caller stops the generation."""
        return self.tools is not None and (self.tools.ended or self._thinking is not None and self._thinking.ended)

    def feed(self, delta: str, final: bool = False) -> ChatDelta:
        """What `delta` adds to the answer; `final` on its last text. Once `ended`, the rest is ignored."""
        if self.ended:
            return ChatDelta()
        out = ChatDelta()
        if self.parser is None:
            rest = content = delta
        else:
            read = self.parser.feed(delta, final)
            rest, content = read.rest, read.content
            if self._thinking is not None:
                out.reasoning, out.tool_calls = self._thinking.feed(read.reasoning, final)
                if self._thinking.ended:  # a repeated call inside the reasoning: the answer ends there
                    return out
            else:
                out.reasoning = self._reasoning.add(read.reasoning)
        if self.tools is not None:
            out.content, calls = self.tools.feed(rest, final)
            out.tool_calls += calls
        else:
            out.content = self._content.add(content)
        return out
