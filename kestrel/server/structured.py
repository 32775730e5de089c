"""OpenAI's `response_format` as the engine's grammar fields (kestrel.engine.grammar compiles them).

- `{"type": "text"}` (or none): no constraint.
- `{"type": "json_object"}`: any JSON object (the schema `{"type": "object"}`, as SGLang does).
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`: the schema.
  The output always follows it; as in SGLang and vLLM, properties the schema does not list are never
  generated, whether `strict` is true or not.
- `{"type": "structural_tag", "format": {...}}`: an xgrammar structural tag, as SGLang takes it.

Whether a schema or tag compiles is for the engine to say (a 400 with the compiler's message).
"""
from __future__ import annotations

import json
from typing import Any

from kestrel.server.errors import bad_request

# SGLang's grammar sampling parameters that the OpenAI routes take as extra fields.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
ANY_OBJECT = '{"type": "object"}'


def response_format_grammar(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """The SamplingParams grammar field for `response_format` ({} for none); 400 for a malformed one."""
    if response_format is None:
        return {}
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": ANY_OBJECT}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with 'name' and 'schema'",
                              "response_format")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON Schema object", "response_format")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
        return {"json_schema": schema}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(response_format, ensure_ascii=False)}
    raise bad_request(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
                      "response_format")
