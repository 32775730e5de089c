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


# vLLM's `structured_outputs` keys: the constraints (at most one), then options that change no output here.
STRUCTURED_OUTPUT_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Our grammars never generate a property the schema does not list, and never fall back to another backend.
STRUCTURED_OUTPUT_NO_OPS = ("disable_additional_properties", "disable_fallback")
# Options that would change the output and that the grammar compiler is not given: refused when set.
STRUCTURED_OUTPUT_UNSUPPORTED = ("disable_any_whitespace", "whitespace_pattern")


def structured_outputs_grammar(spec: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's `structured_outputs` as the SamplingParams grammar field ({} for none); 400 for a malformed
    one, one with two constraints, or one that asks for an option we do not serve.

    `json` is a schema (object or text), `grammar` an EBNF grammar, `json_object: true` any JSON object,
    and `choice` exactly one of its strings (an EBNF alternation of literals)."""
    if spec is None:
        return {}
    known = (*STRUCTURED_OUTPUT_CONSTRAINTS, *STRUCTURED_OUTPUT_NO_OPS, *STRUCTURED_OUTPUT_UNSUPPORTED)
    if unknown := sorted(set(spec) - set(known)):
        raise bad_request(f"structured_outputs has unknown key(s) {', '.join(unknown)}; valid keys: "
                          f"{', '.join(known)}", "structured_outputs")
    if asked := [k for k in STRUCTURED_OUTPUT_UNSUPPORTED if spec.get(k) not in (None, False)]:
        raise bad_request(f"structured_outputs.{asked[0]} is not supported", "structured_outputs")
    given = [k for k in STRUCTURED_OUTPUT_CONSTRAINTS if spec.get(k) not in (None, False)]
    if len(given) > 1:
        raise bad_request(f"structured_outputs has {' and '.join(given)}; give one constraint of "
                          f"{', '.join(STRUCTURED_OUTPUT_CONSTRAINTS)}", "structured_outputs")
    if not given:
        return {}
    kind, value = given[0], spec[given[0]]

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise bad_request(f"structured_outputs.{kind} must be {what}, got {type(value).__name__}",
                              "structured_outputs")

    if kind == "json":
        need(isinstance(value, (str, dict)), "a JSON Schema (an object or its JSON text)")
        return {"json_schema": value}
    if kind == "json_object":
        need(value is True, "a boolean")
        return {"json_schema": ANY_OBJECT}
    if kind == "choice":
        need(isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
             "a non-empty list of strings")
        # JSON string escapes are EBNF's too: each choice is a literal, whatever characters it holds.
        return {"ebnf": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)}
    need(isinstance(value, str), "a string")
    return {{"regex": "regex", "grammar": "ebnf", "structural_tag": "structural_tag"}[kind]: value}
