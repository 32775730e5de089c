"""Per-request sampling parameters and their validation."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from kestrel.core.pooling_params import PoolingParams

# The constraints a request's output may follow (SGLang's sampling parameter names); at most one.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
PENALTY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty")


class UnsupportedParamError(ValueError):
    """A valid value of the SamplingParams field `param` that this engine cannot serve (e.g. a penalty
    with speculative decoding); the server reports it against the request field that set `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

# A temperature below this samples greedily (vLLM's threshold). There, two logits more than 1e-3 apart
# (finer than a bf16 logit's resolution above 1) already differ by more than float32's exp can hold
# (e**-104 underflows), so sampling could only differ from argmax on ties; and dividing by a smaller
# temperature (1e-38, a subnormal) sends finite logits to inf and the softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
# A seen token's logit is divided or multiplied by repetition_penalty: below 0.01 (100x) a seen token
# already wins over any other, and a tinier value only pushes logits toward overflow; above 2 (SGLang's
# bound) the text is no longer the model's.
REPETITION_PENALTY_RANGE = (0.01, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    `temperature` below GREEDY_BELOW_TEMPERATURE (0 included) means greedy. `top_k == -1` disables
    top-k; top-k, top-p and min-p always keep the most likely token. `logit_bias` maps token ids to a
    number in [-100, 100] added to their logits before a token is picked (greedy included), as
    OpenAI's. `seed=None` draws a random seed once when the request is created; every token's
    randomness is derived from (seed, position), so batch neighbours, retraction and chunking never
    change the sample.

    At most one of `json_schema` (a JSON Schema, as text or a dict), `regex`, `ebnf` (a GBNF
    grammar) or `structural_tag` (xgrammar's structural-tag JSON) constrains the output: tokens the
    grammar does not allow next are masked before sampling, and the request stops ("stop") once the
    grammar can only end. The engine compiles it when the request is added (a bad one is a ValueError).
    `grammar_after`: token ids (a reasoning model's end-of-thinking marker) before which the output is
    free; the grammar constrains what follows their first appearance in the output.
    `grammar_opener`: with `grammar_after`, the token that opens the free part (`<think>`): the first
    token is then the opener or one the grammar allows, and anything but the opener starts the answer
    at once, under the grammar (a model that does not think never writes the closing marker).
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
    logit_bias: dict[int, float] | None = None
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
    grammar_after: tuple[int, ...] | None = None
    grammar_opener: int | None = None
    # A prefill-only request (max_new_tokens=0) that returns its pooled hidden state or scores instead
    # of tokens (kestrel.engine.pooling).
    pooling: PoolingParams | None = None
    # Scheduling priority, vLLM's sense: a lower value is admitted first, and retracted last (default 0).
    priority: int = 0
    stop_strs: list[str] = field(init=False, repr=False, default_factory=list)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """SGLang's form of a request's sampling parameters: a dict of these fields' names."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; the parameters are {names}")
        return cls(**values)

    def __post_init__(self) -> None:
        self.stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

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

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "an integer >= 0")
        if not _is_int(self.priority):
            bad("priority", "an integer (lower runs first)")
        if self.grammar_after is not None and (not self.grammar_after or not all(
                _is_int(t) and t >= 0 for t in self.grammar_after)):
            bad("grammar_after", "a non-empty sequence of token ids")
        if self.grammar_opener is not None and (self.grammar_after is None or not _is_int(self.grammar_opener)
                                                or self.grammar_opener < 0):
            bad("grammar_opener", "a token id, with grammar_after")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad("min_new_tokens", f"an integer in [0, max_new_tokens={self.max_new_tokens}]")
        if not _is_num(self.temperature) or self.temperature < 0:
            bad("temperature", f"a finite number >= 0 (below {GREEDY_BELOW_TEMPERATURE:g}: greedy)")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            bad("top_k", "-1 (disabled) or an integer >= 1")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_num(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            bad("repetition_penalty", f"a number in [{low:g}, {high:g}] (1 disables it)")
        if not _is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "a number in [-2, 2]")
        if not _is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "a number in [-2, 2]")
        self._validate_logit_bias(vocab_size)
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "an integer or None")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "None or an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
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
        if self.pooling is not None:
            if self.max_new_tokens != 0:
                bad("max_new_tokens", "0 for a pooling request (it runs the prefill only)")
            self.pooling.validate(vocab_size)
        ids = self.stop_token_ids or []
        if not all(_is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size) for t in ids):
            bad("stop_token_ids", f"a list of token ids in [0, {vocab_size})")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if self.logit_bias is None:
            return
        low, high = LOGIT_BIAS_RANGE
        allowed = f"a map from token ids in [0, {vocab_size}) to numbers in [{low:g}, {high:g}]"
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be {allowed}, got {type(self.logit_bias).__name__}")
        for token, bias in self.logit_bias.items():  # the first bad entry only: the map may be large
            if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"logit_bias must be {allowed}; {token!r} is not a token id of this model")
            if not _is_num(bias) or not low <= bias <= high:
                raise ValueError(f"logit_bias must be {allowed}; token {token} has {bias!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    """A finite int or float: inf and NaN would slip through the range checks."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
