"""Bounds on the shape of what a client sends, checked before any code walks it.

A JSON value nested a few hundred levels deep makes recursive code raise RecursionError (pickling
the request for the engine process, `json.dumps`, a chat template) or a grammar compiler run for
minutes (a JSON schema nested 250 levels: 9 s; 1,000 levels: minutes). So:

- each field of a request body (and each of /generate's `sampling_params`) nests objects and arrays
  at most `MAX_NESTING` levels deep, counted from the field's value; a JSON schema given as text
  (`json_schema`, `structural_tag`) is held to the same bound;
- each output constraint (`response_format`, `json_schema`, `regex`, `ebnf`, `structural_tag`, and
  `tools`, which become the grammar of a forced call) is at most `MAX_GRAMMAR_BYTES` as JSON text.

Real schemas stay far below both (OpenAI's structured outputs allow 10 levels of schema nesting,
about 20 of JSON). Past them a request gets a 400 naming the field.
"""
from __future__ import annotations

import json
from typing import Any

from kestrel.server.errors import bad_request

MAX_NESTING = 64
MAX_GRAMMAR_BYTES = 2**20
_CONTAINERS = (dict, list)


def nesting_depth(value: Any, limit: int) -> int:
    """Levels of objects and arrays in `value` (0 for a scalar); counting stops past `limit`."""
    deepest = 0
    stack = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            break
        children = node.values() if isinstance(node, dict) else node
        # A long list of scalars (a prompt's token ids) is looked at in C: its types, not its items.
        if isinstance(node, dict) or not set(map(type, children)).isdisjoint(_CONTAINERS):
            stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))
    return deepest


def _too_deep(where: str, param: str) -> Exception:
    return bad_request(f"{where} nests objects and arrays more than {MAX_NESTING} levels deep; at most "
                       f"{MAX_NESTING} are accepted", param)


def check_nesting(body: dict[str, Any], nested_fields: tuple[str, ...] = ()) -> None:
    """400 for a field of `body` nested deeper than MAX_NESTING; the fields named in `nested_fields`
    are objects whose own fields are counted each on its own (and named alone, as `param`)."""
    for name, value in body.items():
        if name in nested_fields and isinstance(value, dict):
            for inner, item in value.items():
                if nesting_depth(item, MAX_NESTING) > MAX_NESTING:
                    raise _too_deep(f"{name}.{inner}", inner)
        elif nesting_depth(value, MAX_NESTING) > MAX_NESTING:
            raise _too_deep(name, name)


def check_grammar(value: str | dict[str, Any] | list[Any] | None, where: str, param: str,
                  json_text: bool = False) -> None:
    """400 for an output constraint over MAX_GRAMMAR_BYTES, or, given as JSON text (`json_text`: a
    schema or structural tag as a string), nested deeper than MAX_NESTING."""
    if value is None:
        return
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise bad_request(f"{where} has {size} bytes; at most {MAX_GRAMMAR_BYTES} bytes are accepted", param)
    if json_text and isinstance(value, str):
        try:
            parsed = json.loads(value)
        except RecursionError:
            raise _too_deep(where, param) from None
        except ValueError:
            return  # not JSON: the grammar compiler says what is wrong with it
        if nesting_depth(parsed, MAX_NESTING) > MAX_NESTING:
            raise _too_deep(where, param)
