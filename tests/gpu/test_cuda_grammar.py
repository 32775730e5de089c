"""Structured outputs on CUDA: the bitmask applied on the device (xgrammar's Triton kernel), CUDA graphs
and overlap on; outputs valid, and equal to the synchronous loop's."""
from __future__ import annotations

import json

import jsonschema

from kestrel import Engine, SamplingParams
from tests.e2e.conftest import assert_pool_full
from tests.grammar_model import make_grammar_model

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "word": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "word", "n"]}


def test_cuda_grammar_outputs_are_valid_and_overlap_changes_nothing(tmp_path):
    model = make_grammar_model(tmp_path)
    params = [SamplingParams(max_new_tokens=200, temperature=1.0, seed=s, json_schema=SCHEMA) if s % 2 else
              SamplingParams(max_new_tokens=24, temperature=0.8, seed=s, ignore_eos=True) for s in range(16)]
    outs = {}
    for disable in (True, False):
        with Engine(model=model, device="cuda", dtype="float32", max_total_tokens=600, schedule_conservativeness=0,
                    disable_overlap_schedule=disable) as e:
            got = e.generate(["Answer in JSON:"] * len(params), params)
            assert_pool_full(e)
            outs[disable] = [(o.token_ids, o.meta["finish_reason"], o.text) for o in got]
    assert outs[False] == outs[True]
    for ids, reason, text in outs[False][1::2]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_cuda_grammars_under_speculation_give_the_plain_engine_s_greedy_tokens(tmp_path):
    """A draft tree's nodes masked on the host while the verify runs (tree copied to pinned memory behind
    the draft, CUDA graphs on): greedy tokens equal the plain CUDA engine's, sampled JSON validates."""
    model = make_grammar_model(tmp_path)
    greedy = [SamplingParams(max_new_tokens=60, temperature=0.0, **fields)
              for fields in (dict(json_schema=SCHEMA), dict(regex="(yes|no)! [a-z]{2,12}"), dict(ignore_eos=True))]
    prompts = ["Answer in JSON:"] * len(greedy)
    with Engine(model=model, device="cuda", dtype="float32") as plain:
        want = [(o.token_ids, o.meta["finish_reason"]) for o in plain.generate(prompts, greedy)]
    with Engine(model=model, device="cuda", dtype="float32", speculative_algorithm="STANDALONE",
                speculative_draft_model_path=model, speculative_num_steps=3, speculative_eagle_topk=4,
                speculative_num_draft_tokens=8) as spec:
        assert [(o.token_ids, o.meta["finish_reason"]) for o in spec.generate(prompts, greedy)] == want
        sampled = [SamplingParams(max_new_tokens=200, temperature=1.0, seed=s, json_schema=SCHEMA) for s in range(8)]
        for out in spec.generate(["Answer in JSON:"] * 8, sampled):
            assert out.meta["finish_reason"] == "stop"
            jsonschema.validate(json.loads(out.text), SCHEMA)
        assert_pool_full(spec)
