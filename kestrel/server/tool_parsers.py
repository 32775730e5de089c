"""Tool calls in model output, one parser per chat-template format, chosen by `--tool-call-parser`.

The names are SGLang's. Each format is known both ways: `split()` finds the calls in the text so far
(and what is plain content), and `grammar()` builds the structural tag (xgrammar's JSON form) that
makes the model write one or more well-formed calls when `tool_choice` is "required" or names a
function, so that a forced call always parses.

- `llama3` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the answer is one or more JSON objects
  `{"name": ..., "parameters": {...}}` ("arguments" also accepted) separated by `;`, optionally after
  `<|python_tag|>`; an answer that does not start with `{` is plain content.
- `hermes` / `qwen25` (Hermes 2/3, Qwen 2.5, Qwen 3 and the bundled demo model's template): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; text outside the tags is content.
- `gpt-oss` (harmony): each call is a message to `functions.NAME` with the JSON arguments as its body;
  the final and commentary channels are content. It reads the text after the `gpt-oss` reasoning
  parser and cannot force calls (`can_force`).

Arguments are returned as the model wrote them (the raw JSON text). `ToolCallStream` is the one
reading of an answer, fed as its text grows; the server feeds it the same text deltas whether the
answer is streamed or not, so both give the same content, calls and end (see its docstring for the
rules on calls cut short and repeated).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kestrel.server import harmony

# Every tool's arguments are constrained like response_format's JSON: any whitespace, short runs.
_ARGUMENTS_MAX_WHITESPACE = 16
_WS = " \t\n\r"


@dataclass
class CallText:
    """One call as far as the text goes: its name once the name string is whole, the raw JSON text of
    its arguments so far, whether the call is whole (its object closed, its arguments valid JSON), and
    where its markup starts in the text."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False
    start: int = 0


@dataclass
class Split:
    """The text so far as content and calls. Text that cannot become a call (a malformed one) is
    content, so content only ever grows as the text does."""

    content: str  # the text that is not part of a call (a possible start of a call held back)
    calls: list[CallText] = field(default_factory=list)


# ---- a scanner for a JSON object that may still be growing ------------------------------------------
def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """Index after the JSON string starting at s[i] == '"'; None if it is not closed yet."""
    i += 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
        elif s[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """Index after the JSON value starting at s[i]; None if the text may still continue it."""
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                end = _string_end(s, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i  # a number, true, false or null runs to the next delimiter
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(s) else None


def scan_object(s: str, i: int) -> tuple[dict[str, tuple[str, bool]], int | None, bool]:
    """The JSON object starting at s[i] == '{' as far as it goes: (key -> (raw value text so far, whole),
    index after its '}' or None while it is open, malformed). Only the top level is parsed; values
    are kept as text."""
    fields: dict[str, tuple[str, bool]] = {}
    i = _skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        return fields, i + 1, False
    while True:
        if i >= len(s):
            return fields, None, False
        if s[i] != '"':
            return fields, None, True
        key_end = _string_end(s, i)
        if key_end is None:
            return fields, None, False
        try:
            key = json.loads(s[i:key_end])
        except ValueError:
            return fields, None, True
        i = _skip_ws(s, key_end)
        if i >= len(s):
            return fields, None, False
        if s[i] != ":":
            return fields, None, True
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            fields[key] = ("", False)
            return fields, None, False
        value_end = _value_end(s, i)
        if value_end is None:
            fields[key] = (s[i:], False)
            return fields, None, False
        fields[key] = (s[i:value_end], True)
        i = _skip_ws(s, value_end)
        if i >= len(s):
            return fields, None, False
        if s[i] == "}":
            return fields, i + 1, False
        if s[i] != ",":
            return fields, None, True
        i = _skip_ws(s, i + 1)


def _call(s: str, i: int, argument_keys: tuple[str, ...]) -> tuple[CallText | None, int | None]:
    """The call object starting at s[i] == '{' and the index after it (None while open); no call if
    the text is malformed (and can no longer become a call), a closed object included whose name is
    missing or whose arguments are not JSON."""
    fields, end, bad = scan_object(s, i)
    if bad:
        return None, None
    call = CallText(complete=end is not None)
    name = fields.get("name")
    if name is not None and name[1]:
        try:
            call.name = json.loads(name[0])
        except ValueError:
            return None, None
        if not isinstance(call.name, str):
            return None, None
    elif end is not None:
        return None, None  # a whole object without a name is no call
    for key in argument_keys:
        if key in fields:
            call.arguments = fields[key][0]
            break
    else:
        call.arguments = "{}" if end is not None else ""  # no arguments given: an empty argument object
    if end is not None and not _is_json(call.arguments):
        return None, None
    return call, end


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def held_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker` (it may turn out to be one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


# ---- the formats ---------------------------------------------------------------------------------
class ToolParser:
    name = ""
    can_force = True  # tool_choice "required" or a named function: `grammar()` writes the calls
    argument_keys: tuple[str, ...] = ("arguments",)
    separator = ""

    def split(self, text: str, final: bool) -> Split:
        """Content and calls of `text`; `final` when the answer ends there: a call still open is then
        no call, its text is content."""
        raise NotImplementedError

    def call_tag(self, name: str, parameters: dict) -> dict:
        """The structural-tag `tag` of one call of function `name` with that parameter schema."""
        raise NotImplementedError

    def grammar(self, functions: list[dict], forced: str | None, parallel: bool) -> dict:
        """The structural tag of one call of `forced`, or of one or more calls of any of `functions`
        (exactly one unless `parallel`), with nothing else around them. functions: {"name", "parameters"}."""
        tags = [self.call_tag(f["name"], f["parameters"]) for f in functions if forced in (None, f["name"])]
        if forced is not None:
            return {"type": "structural_tag", "format": tags[0]}
        return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                     "separator": self.separator, "at_least_one": True,
                                                     "stop_after_first": not parallel}}

    def _json_content(self, parameters: dict) -> dict:
        return {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": _ARGUMENTS_MAX_WHITESPACE}


class HermesParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, any number of them, text around."""

    name = "hermes"
    begin, end = "<tool_call>", "</tool_call>"
    separator = "\n"

    def split(self, text: str, final: bool) -> Split:
        content, calls, i = [], [], 0
        while True:
            start = text.find(self.begin, i)
            if start < 0:
                rest = text[i:]
                content.append(rest if final else held_back(rest, self.begin))
                return Split("".join(content), calls)
            content.append(text[i:start])
            body_start = start + len(self.begin)
            end = text.find(self.end, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            j = _skip_ws(body, 0)
            call = None
            if j < len(body) and body[j] == "{":
                call, _ = _call(body, j, self.argument_keys)
            elif j == len(body) and end < 0:
                call = CallText()  # just opened
            if call is not None and not call.complete and (final or end >= 0):
                call = None  # the answer or its tag ended before the call did
            if call is None:  # not a call after all: its text is content
                content.append(text[start:] if end < 0 else text[start:end + len(self.end)])
            else:
                call.start = start
                calls.append(call)
            if end < 0:
                return Split("".join(content), calls)
            i = end + len(self.end)

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{self.begin}\n{{"name": "{name}", "arguments": ',
                "content": self._json_content(parameters), "end": f"}}\n{self.end}"}


class Qwen25Parser(HermesParser):
    name = "qwen25"


class Llama3Parser(ToolParser):
    """Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": ...}` objects joined
    by `;` (after `<|python_tag|>` when special tokens are kept); otherwise it is plain content."""

    name = "llama3"
    python_tag = "<|python_tag|>"
    argument_keys = ("parameters", "arguments")
    separator = "; "

    def split(self, text: str, final: bool) -> Split:
        tag = text.find(self.python_tag)
        if tag >= 0:
            content, body = text[:tag], text[tag + len(self.python_tag):]
        else:
            start = _skip_ws(text, 0)
            if start == len(text):  # only whitespace yet: content or calls, nothing to say
                return Split(text if final else "")
            if text[start] != "{":
                return Split(text if final else held_back(text, self.python_tag))
            content, body = "", text[start:]
        offset = len(text) - len(body)  # of the body in the text
        calls, i = [], _skip_ws(body, 0)
        while i < len(body):
            call, end = _call(body, i, self.argument_keys) if body[i] == "{" else (None, None)
            if call is not None and end is None and final:
                call = None  # the answer ended before the call did
            if call is None:  # text after the calls, or a malformed or cut call: content
                return Split(content + body[i:], calls)
            call.start = offset + i
            calls.append(call)
            if end is None:
                break
            i = end
            while i < len(body) and body[i] in _WS + ";":
                i += 1
        return Split(content, calls)

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": "{name}", "parameters": ',
                "content": self._json_content(parameters), "end": "}"}


class GptOssParser(ToolParser):
    """harmony (gpt-oss, `kestrel.server.harmony`): a call is a message to `functions.NAME` whose body is
    its JSON arguments, ended by `<|call|>`; the final and commentary messages are content; the analysis
    channel never is (the `gpt-oss` reasoning parser reports it). A message to another recipient (a
    built-in tool: browser, python) is neither."""

    name = "gpt-oss"
    # Its markers are special tokens, which a structural tag (text) cannot write; and a forced call
    # would skip the analysis the model is trained to write first.
    can_force = False

    def split(self, text: str, final: bool) -> Split:
        content, calls = [], []
        for message in harmony.read_messages(text, final):
            if harmony.is_content(message):
                content.append(message.body)
            elif (message.recipient or "").startswith(harmony.FUNCTIONS):
                name = message.recipient[len(harmony.FUNCTIONS):]
                call = CallText(name, message.body.strip(), complete=message.closed, start=message.start)
                if message.closed and not (name and _is_json_object(call.arguments)):
                    content.append(message.body)  # malformed: content, as in the other formats
                else:
                    calls.append(call)
        return Split("\n\n".join(content), calls)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


PARSERS: dict[str, type[ToolParser]] = {"llama3": Llama3Parser, "qwen25": Qwen25Parser, "hermes": HermesParser,
                                        "gpt-oss": GptOssParser}


def tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError naming the valid ones."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; valid ones: {', '.join(PARSERS)}")
    return PARSERS[name]()


# ---- whole answers and streams ------------------------------------------------------------------
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(parser: ToolParser, text: str, new_id) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer as `ToolCallStream` reads it; content None when empty.
    `new_id()` names each call."""
    stream = ToolCallStream(parser, new_id)
    stream.feed(text, final=True)
    return stream.content or None, stream.calls


class ToolCallStream:
    """An answer's text deltas as OpenAI chat deltas: content, and `tool_calls` entries.

    - A call is sent whole, in one entry (index, id, name, arguments), once its JSON object is
      closed and its arguments parse: a streamed call never carries arguments that are not JSON.
    - A call still open when the answer ends (cut by max_tokens) is no call: its text is content.
      Complete calls before it stay calls.
    - A call that repeats an earlier call of the answer (same function, equal arguments) ends the
      calls: it and all text after it are dropped and `ended` is set, for the caller to stop the
      generation. A model that loops on its last call (a weak one under a forced-call grammar that
      allows more calls) would otherwise write calls until max_tokens; a repeated call in one turn
      would only run the same function twice.

    Content is stripped: leading whitespace is dropped, trailing whitespace waits until text follows it."""

    def __init__(self, parser: ToolParser, new_id) -> None:
        self.parser = parser
        self.new_id = new_id
        self.text = ""
        self.content = ""  # the content sent so far
        self.calls: list[ToolCall] = []  # the calls sent so far
        self._called: list[tuple[str, Any]] = []  # (name, parsed arguments) of each call sent
        self._taken = 0  # calls of this stream's own text sent (`calls` may hold a beside stream's too)
        self.ended = False

    def beside(self) -> "ToolCallStream":
        """A stream over another part of the same answer (its reasoning) whose calls join this one's:
        one list, so the calls' indices count on and a repeat of either's call ends both's."""
        other = ToolCallStream(self.parser, self.new_id)
        other.calls, other._called = self.calls, self._called
        return other

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """(new content, new tool_calls delta entries) after `delta`; `final` on the answer's last text.
        Once `ended`, the rest of the answer is ignored."""
        if self.ended:
            return "", []
        self.text += delta
        split = self.parser.split(self.text, final)
        whole = []
        for call in split.calls[self._taken:]:
            if not call.complete:
                break
            called = (call.name, json.loads(call.arguments))
            if called in self._called:
                self.ended = True
                self.text = self.text[:call.start]
                split = self.parser.split(self.text, final=True)
                break
            self._called.append(called)
            whole.append(ToolCall(self.new_id(), call.name, call.arguments))
        entries = [{"index": len(self.calls) + i, **call.openai()} for i, call in enumerate(whole)]
        self.calls += whole
        self._taken += len(whole)
        content = split.content.strip()
        new_content = content[len(self.content):]
        if len(content) > len(self.content):
            self.content = content
        return new_content, entries
