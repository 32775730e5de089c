"""A chat request's `tools` / `tool_choice`: what the chat template gets, and the grammar that forces a call.

`tool_choice` "none" leaves the tools out of the prompt and parses nothing (the answer is content);
"auto" (the default with tools) gives them to the template and parses the calls the model writes;
"required" and a named function also constrain the output with a grammar of the parser's call
format, built from the tools' parameter schemas, so the call always parses (with
`parallel_tool_calls: false`, exactly one call). A named function's answer finishes with "stop", as
OpenAI's does; the others with "tool_calls" once they made calls. A parser that cannot force calls
(gpt-oss) answers "required" and a named function with a 400.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kestrel.server.errors import bad_request
from kestrel.server.protocol import ChatCompletionRequest, NamedToolChoice
from kestrel.server.tool_parsers import PARSERS, ToolParser

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule; it also keeps names safe inside grammars
# A function without `parameters` takes none (OpenAI): only the empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolUse:
    parser: ToolParser
    template_tools: list[dict[str, Any]]  # the tools in OpenAI's shape, for the chat template
    structural_tag: str | None  # the grammar forcing the call(s); None for "auto"
    named: bool = False  # tool_choice names the function: the answer finishes with "stop", not "tool_calls"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_use(body: ChatCompletionRequest, parser: ToolParser | None) -> ToolUse | None:
    """What the request's tools ask for; None when nothing (no tools, or tool_choice "none"). 400 for
    bad tools, a tool_choice that does not fit them, or a server without --tool-call-parser."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice in ("none", "auto"):
            return None
        raise bad_request("tool_choice 'required' or a named function needs tools", "tool_choice")
    if choice == "none":
        return None
    if parser is None:
        raise bad_request("this server parses no tool calls: start it with --tool-call-parser (one of "
                          f"{', '.join(PARSERS)}, the format of the model's chat template)", "tools")
    names = [t.function.name for t in tools]
    for name in names:
        if not FUNCTION_NAME.fullmatch(name):
            raise bad_request(f"tool name {name!r} must be 1 to 64 letters, digits, '_' or '-'", "tools")
    if len(set(names)) < len(names):
        raise bad_request("tool names must be unique", "tools")
    for tool in tools:  # a call's arguments are an object (Anthropic's `input` must be one), as OpenAI requires
        schema = tool.function.parameters or {}
        if schema.get("type", "object") != "object" or any(schema.get(k) == [] for k in ("anyOf", "oneOf", "allOf")):
            raise bad_request(f"the parameters of tool {tool.function.name!r} must be a JSON Schema of type "
                              f"'object' (with any alternatives non-empty), got {json.dumps(schema)[:200]}", "tools")
    forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if forced is not None and forced not in names:
        raise bad_request(f"tool_choice names the function {forced!r}, which is not among the tools "
                          f"({', '.join(names)})", "tool_choice")
    tag = None
    if choice != "auto" and not parser.can_force:
        raise bad_request(f"tool_choice 'required' or a named function cannot be forced with --tool-call-parser "
                          f"{parser.name}: its calls are written in special tokens no grammar can force; send "
                          "tool_choice 'auto' (or none)", "tool_choice")
    if choice != "auto":
        functions = [{"name": t.function.name, "parameters": t.function.parameters or NO_PARAMETERS} for t in tools]
        tag = json.dumps(parser.grammar(functions, forced, body.parallel_tool_calls), ensure_ascii=False)
    return ToolUse(parser, [t.model_dump(exclude_none=True) for t in tools], tag, named=forced is not None)
