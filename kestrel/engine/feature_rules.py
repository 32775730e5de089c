"""Request features that an engine feature cannot serve yet: one table, consulted by `Engine.add_request`
(the first rule that refuses raises UnsupportedParamError, a 400 naming the field) and printed by
`kestrel explain`. Combinations of engine flags that do not fit are refused earlier, when the
configuration is resolved."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kestrel.core.sampling_params import SamplingParams, UnsupportedParamError

if TYPE_CHECKING:
    from kestrel.config import EngineConfig

_GRAMMARS = "grammars (json_schema, regex, ebnf, structural_tag)"


@dataclass(frozen=True)
class FeatureRule:
    engine_feature: str  # the engine flags that turn it on
    request_features: str
    why: str
    applies: Callable[["EngineConfig"], bool]  # the engine feature is on
    asked: Callable[[SamplingParams], str | None]  # the request field that asks for a refused feature
    message: Callable[[str], str]  # the refusal, given that field

    def check(self, config: "EngineConfig", params: SamplingParams) -> None:
        field = self.asked(params) if self.applies(config) else None
        if field is not None:
            raise UnsupportedParamError(field, self.message(field))


def _speculating(config: "EngineConfig") -> bool:
    return config.speculative.speculative_algorithm is not None


def _tensor_parallel(config: "EngineConfig") -> bool:
    return config.parallel.tp_size > 1


def _grammar_field(params: SamplingParams) -> str | None:
    return params.grammar[0] if params.grammar is not None else None


RULES: tuple[FeatureRule, ...] = (
    FeatureRule(
        "speculative_algorithm set", "prompt_logprobs",
        "a draft's DRAFT_EXTEND after each prefill chunk reads the token after it, which a prompt that is "
        "only scored never samples; scoring gains nothing from speculation anyway",
        _speculating, lambda p: "prompt_logprobs" if p.prompt_logprobs is not None else None,
        lambda field: "with speculative decoding, prompt_logprobs are not supported; serve scoring requests "
                      "without speculative_algorithm"),
    FeatureRule(
        "speculative_algorithm set", "pooling (embeddings, rerank, score)",
        "the same as prompt_logprobs: a prefill-only request samples no token for a draft to follow",
        _speculating, lambda p: "pooling" if p.pooling is not None else None,
        lambda field: "with speculative decoding, embeddings and scores are not supported; serve the pooling "
                      "model without speculative_algorithm"),
    FeatureRule(
        "tp_size > 1", _GRAMMARS,
        "a grammar's mask is filled on rank 0 after the previous step resolves; the other ranks would need "
        "it sent",
        _tensor_parallel, _grammar_field,
        lambda field: f"with tensor parallelism (tp_size > 1), {_GRAMMARS} are not supported yet; drop {field} "
                      "or serve with tp_size 1"),
)


def check_request(config: "EngineConfig", params: SamplingParams) -> None:
    """Raise UnsupportedParamError for the first rule that refuses `params` under `config`."""
    for rule in RULES:
        rule.check(config, params)


def explain_rules(config: "EngineConfig") -> list[str]:
    """The table in words, each rule marked on or off for `config`."""
    lines = ["request features refused with engine features (checked when a request is added):"]
    for rule in RULES:
        state = "on " if rule.applies(config) else "off"
        lines.append(f"  [{state}] {rule.engine_feature} x {rule.request_features}")
        lines.append(f"        why: {rule.why}")
    return lines
