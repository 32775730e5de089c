"""The feature-refusal table and the finishing decision, without a model."""
from __future__ import annotations

import pytest

from kestrel.config import EngineConfig, ParallelConfig, SpeculativeConfig
from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams, UnsupportedParamError
from kestrel.engine.feature_rules import RULES, check_request, explain_rules
from kestrel.engine.finishing import Finish, Finishing

SPECULATIVE = EngineConfig(speculative=SpeculativeConfig(speculative_algorithm="NGRAM"))
TENSOR_PARALLEL = EngineConfig(parallel=ParallelConfig(tp_size=2))


@pytest.mark.parametrize("config, params, field", [
    (SPECULATIVE, SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
    (TENSOR_PARALLEL, SamplingParams(json_schema={"type": "string"}), "json_schema"),
])
def test_each_rule_refuses_its_field_only_with_its_engine_feature(config, params, field):
    with pytest.raises(UnsupportedParamError) as refused:
        check_request(config, params)
    assert refused.value.param == field and field in str(refused.value)
    check_request(EngineConfig(), params)  # plain engine: served


def test_grammars_penalties_and_min_tokens_are_served_with_speculative_decoding():
    check_request(SPECULATIVE, SamplingParams(regex="a+", repetition_penalty=1.2, frequency_penalty=0.3,
                                              min_new_tokens=2, max_new_tokens=4))


def test_explain_lists_every_rule_and_marks_those_in_force():
    lines = explain_rules(TENSOR_PARALLEL)
    assert sum("[on ]" in line for line in lines) == 1
    assert sum("[off]" in line for line in lines) == len(RULES) - 1


def test_finishing_order_stop_token_then_length_and_nothing_before_a_token():
    finishing = Finishing(eos_token_ids={2}, context_length=100)
    req = Request("r", [5, 6], SamplingParams(max_new_tokens=2, stop_token_ids=[9]), seed=0, arrival=0)
    assert finishing.decide(req) is None
    req.output_ids.append(7)
    assert finishing.decide(req, 7) is None
    req.output_ids.append(9)  # the stop token and the length limit meet: the stop token wins
    assert finishing.decide(req, 9) == Finish("stop", 9)
    req.output_ids[-1] = 2
    assert finishing.decide(req, 2) == Finish("stop", 2)
    req.output_ids[-1] = 8
    assert finishing.decide(req, 8) == Finish("length")
    empty = Request("e", [5], SamplingParams(max_new_tokens=0), seed=0, arrival=1)
    assert finishing.decide(empty) == Finish("length")
