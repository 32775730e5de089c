"""What the engine returns for a request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    """The generated part of one request.

    meta keys: id, prompt_tokens, completion_tokens, cached_tokens, finish_reason
    ("stop" | "length" | "abort"), matched_stop (token id or string that stopped it, or None), and
    output_token_logprobs / output_top_logprobs when logprobs were asked for.
    """

    text: str
    token_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = True
