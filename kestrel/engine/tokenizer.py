"""Tokenizer loading, chat templates and end-of-sequence ids.

The engine can run on token ids only (no tokenizer in the model folder); everything here that takes
a tokenizer is only called when one exists.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

# Any of these in a local folder means a tokenizer is meant to be there.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# developer: OpenAI's newer name for the system role's instructions (gpt-oss's template reads it as such).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# What apply_chat_template sets itself: a request's chat_template_kwargs may set any other template variable.
TEMPLATE_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs"} | {"messages"}


def load_tokenizer(path: str, required: bool = True) -> PreTrainedTokenizerBase | None:
    """Load the tokenizer saved in `path` (a local model folder, or a GGUF file: transformers builds the
    tokenizer and its chat template from the file's metadata).

    Returns None only when `required` is False and the folder has no tokenizer files; a folder
    that has them but fails to load always raises, so a broken tokenizer is never silently ignored.
    """
    from kestrel.models.gguf import gguf_file

    gguf = gguf_file(path)
    folder = Path(path)
    if gguf is None and folder.is_dir() and not any((folder / name).exists() for name in _TOKENIZER_FILES):
        if not required:
            return None
        raise FileNotFoundError(
            f"no tokenizer in {path}: expected one of {', '.join(_TOKENIZER_FILES)}; "
            "add one, or pass prompt token ids instead of text"
        )
    # AutoTokenizer pulls in torch (seconds, hundreds of MB): the server's tokenizer worker processes,
    # which import this module but get their tokenizer pickled, never need it.
    from transformers import AutoTokenizer

    try:
        if gguf is not None:
            return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer from {path}: {e}") from e


def _message_text(content: Any, index: int) -> str:
    """Content as one string: a string as is, or OpenAI-style text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(
                    f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}, got {part!r}"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(
        f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _tool_calls(calls: Any, index: int) -> list[dict]:
    """An assistant message's `tool_calls` for the template: each function's `arguments` JSON text
    becomes the dict templates render (text that is not JSON stays text)."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and isinstance(c["function"].get("name"), str) for c in calls):
        raise ValueError(f"messages[{index}].tool_calls must be a list of "
                         "{'type': 'function', 'function': {'name': str, 'arguments': str}}")
    out = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass
        out.append({**call, "function": function})
    return out


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Validate chat messages and return them as [{'role': str, 'content': str}, ...].

    Raises ValueError naming the first bad message and the valid shapes; other keys are kept
    (e.g. `name`, `tool_call_id`) because some templates read them. An assistant message with
    `tool_calls` may have no content (null). An assistant's `reasoning_content` (the API's name, which
    Qwen3's template reads) is also given as `thinking` (gpt-oss's template's name).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if message.get("tool_calls") is not None and role == "assistant":
            calls = _tool_calls(message["tool_calls"], i)
            content = message.get("content")
            out.append({**message, "content": "" if content is None else _message_text(content, i),
                        "tool_calls": calls})
            continue
        if "content" not in message:
            raise ValueError(f"messages[{i}] has no 'content'")
        out.append({**message, "content": _message_text(message["content"], i)})
    for message in out:
        if message["role"] == "assistant" and isinstance(message.get("reasoning_content"), str):
            message.setdefault("thinking", message["reasoning_content"])
    return out


def apply_chat_template_text(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render `messages` (and the `tools` the model may call, OpenAI's shape) with the tokenizer's chat
    template into the prompt text; `template_kwargs` are further variables of the template (e.g.
    gpt-oss's `reasoning_effort`), none of TEMPLATE_ARGUMENTS."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; send a plain prompt (completions API) instead"
        )
    return tokenizer.apply_chat_template(
        normalize_messages(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
        **({"tools": tools} if tools else {}), **(template_kwargs or {})
    )


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render and tokenize `messages`; the template supplies any BOS, so none is added again."""
    text = apply_chat_template_text(tokenizer, messages, add_generation_prompt, tools, template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def _ids(value: Any) -> set[int]:
    """An `eos_token_id` field (int, list of ints or null) as a set."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def eos_token_ids(model_path: str, tokenizer: PreTrainedTokenizerBase | None, hf_config: dict) -> set[int]:
    """Every id that ends generation: config.json (`hf_config`), generation_config.json and the
    tokenizer's eos.

    Read from the JSON directly (no config classes) so it works for any architecture; a missing
    generation_config.json contributes nothing.
    """
    ids = _ids(hf_config.get("eos_token_id"))
    file = Path(model_path) / "generation_config.json"
    if file.is_file():
        ids |= _ids(json.loads(file.read_text()).get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
