"""Per-request sampling parameters and their validation."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The constraints a request's output may follow (SGLang's sampling parameter names); at most one.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
PENALTY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty")


class UnsupportedParamError(ValueError):
    """A valid value of the SamplingParams field `param` that this engine cannot serve (e.g. a penalty
    with speculative decoding); the server reports it against the request field that set `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    `temperature == 0` means greedy. `top_k == -1` disables top-k. `seed=None` draws a random
    seed once when the request is created; every token's randomness is derived from
    (seed, position), so batch neighbours, retraction and chunking never change the sample.

    At most one of `json_schema` (a JSON Schema, as text or a dict), `regex`, `ebnf` (a GBNF
    grammar) or `structural_tag` (xgrammar's structural-tag JSON) constrains the output: tokens the
    grammar does not allow next are masked before sampling, and the request stops ("stop") once the
    grammar can only end. The engine compiles it when the request is added (a bad one is a ValueError).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per generated token
    # Logprobs of the prompt's tokens (each given the ones before it) and this many top logprobs at each
    # prompt position, computed from the prefill (vLLM's name); with max_new_tokens=0 nothing is generated.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    stop_strs: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def has_penalties(self) -> bool:
        return bool(self.penalties)

    @property
    def penalties(self) -> list[str]:
        """The penalty fields set away from their neutral value, in declaration order."""
        neutral = {"repetition_penalty": 1, "frequency_penalty": 0, "presence_penalty": 0}
        return [name for name in PENALTY_FIELDS if getattr(self, name) != neutral[name]]

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, the key it is compiled and cached under; None if none.
        A dict schema becomes its JSON text in insertion order (property order is part of the grammar)."""
        for kind in GRAMMAR_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field and its allowed range."""
        def bad(name: str, allowed: str) -> None:
            raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "an integer >= 0")
        if not is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", f"an integer in [0, max_new_tokens={self.max_new_tokens}]")
        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "a number >= 0 (0 means greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            bad("top_k", "-1 (disabled) or an integer >= 1")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a number > 0 (1 disables it)")
        if not is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "a number in [-2, 2]")
        if not is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "a number in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "an integer or None")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "None or an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "None or an integer in [0, 20]")
        if not all(isinstance(s, str) and s for s in self.stop_strs):
            bad("stop", "a non-empty string or a list of non-empty strings")
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        for kind in given:
            value = getattr(self, kind)
            dict_ok = kind in ("json_schema", "structural_tag")
            if not (isinstance(value, str) and value) and not (dict_ok and isinstance(value, dict)):
                bad(kind, "a non-empty string" + (" or a dict" if dict_ok else "") + " or None")
            if isinstance(value, dict):
                try:
                    json.dumps(value)
                except (TypeError, ValueError):
                    bad(kind, "a dict of JSON values")
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} are both set: give at most one of {', '.join(GRAMMAR_KINDS)}")
        ids = self.stop_token_ids or []
        if not all(is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size) for t in ids):
            bad("stop_token_ids", f"a list of token ids in [0, {vocab_size})")
