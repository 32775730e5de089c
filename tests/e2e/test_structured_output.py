"""Structured outputs in the offline Engine: JSON schema, regex, EBNF and structural tags on a tiny
random model (the grammar, not the weights, makes the output valid), the grammar's end, errors, and
overlap scheduling's exactness (its deferred masks against the non-overlapped engine's)."""
from __future__ import annotations

import dataclasses
import json
import re
import threading

import jsonschema
import pytest

from kestrel import Engine, SamplingParams
from kestrel.server.tool_parsers import parse_tool_calls, tool_parser
from tests.e2e.conftest import assert_pool_full
from tests.grammar_model import make_grammar_model
from tests.tiny_models import make_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        # Not maxLength: xgrammar 0.2.9 then lets raw control characters into the string (invalid JSON).
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}
PROMPT = "Describe a person as JSON:"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_grammar_model(tmp_path_factory.mktemp("grammar-model"))


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model=model, device="cpu", dtype="float32") as e:
        yield e


def sampled(n: int, **params) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=seed, **params) for seed in range(n)]


def test_json_schema_samples_parse_and_validate(engine):
    outs = engine.generate([PROMPT] * 20, sampled(20, max_new_tokens=400, json_schema=SCHEMA))
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        # Ended by the grammar, not by the model sampling EOS (a finished grammar only allows EOS).
        assert out.meta["finish_reason"] == "stop" and out.meta["matched_stop"] is None, out.text
        assert not set(out.token_ids) & engine.eos_token_ids
    assert len({out.text for out in outs}) == 20  # the seeds matter
    assert_pool_full(engine)


def test_regex_and_ebnf_samples_match(engine):
    regex = r"(yes|no): [a-z]{1,6}\."
    for out in engine.generate([PROMPT] * 8, sampled(8, max_new_tokens=60, regex=regex)):
        assert re.fullmatch(regex, out.text) and out.meta["finish_reason"] == "stop", out.text
    ebnf = 'root ::= "[" item ("," item)* "]"\nitem ::= "x" | "y" | [0-9]'
    for out in engine.generate([PROMPT] * 8, sampled(8, max_new_tokens=60, ebnf=ebnf)):
        assert re.fullmatch(r"\[(x|y|[0-9])(,(x|y|[0-9]))*\]", out.text), out.text


def test_the_grammar_cache_is_hit_for_a_repeated_schema(engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    engine.generate(PROMPT, SamplingParams(max_new_tokens=60, json_schema=schema))
    hits, misses = engine.grammars.hits, engine.grammars.misses
    outs = engine.generate([PROMPT] * 3, [SamplingParams(max_new_tokens=60, seed=s, json_schema=json.dumps(schema))
                                          for s in range(3)])
    assert (engine.grammars.hits, engine.grammars.misses) == (hits + 3, misses)  # the text form: the same key
    assert all(0 <= json.loads(o.text)["n"] <= 9 for o in outs)


def test_a_grammar_that_ends_finishes_the_request_even_at_its_length_limit(engine):
    out = engine.generate(PROMPT, SamplingParams(max_new_tokens=50, regex="abc", ignore_eos=True))[0]
    assert out.text == "abc" and out.meta["finish_reason"] == "stop"
    exact = engine.generate(PROMPT, SamplingParams(max_new_tokens=len(out.token_ids), regex="abc"))[0]
    assert exact.token_ids == out.token_ids and exact.meta["finish_reason"] == "stop"
    cut = engine.generate(PROMPT, SamplingParams(max_new_tokens=1, regex="abcdefghij"))[0]
    assert cut.meta["finish_reason"] == "length"


def test_a_grammar_after_a_marker_leaves_the_tokens_up_to_it_free(engine):
    """grammar_after (a reasoning model's end of thinking): the output is the model's own up to the first
    appearance of the marker, then the grammar's; a marker never written leaves the output free."""
    free = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))[0]
    marker = tuple(free.token_ids[2:4])
    first = next(i for i in range(len(free.token_ids)) if tuple(free.token_ids[i:i + 2]) == marker) + 2
    params = SamplingParams(temperature=0.0, max_new_tokens=40, regex="(yes|no)!", grammar_after=marker)
    out = engine.generate([PROMPT], params)[0]
    assert out.token_ids[:first] == free.token_ids[:first]
    assert re.fullmatch("(yes|no)!", engine.tokenizer.decode(out.token_ids[first:]))
    assert out.meta["finish_reason"] == "stop"
    constrained = engine.generate([PROMPT], dataclasses.replace(params, grammar_after=None))[0]
    assert re.fullmatch("(yes|no)!", constrained.text)
    never = dataclasses.replace(params, max_new_tokens=12, grammar_after=(engine.vocab_size - 1,) * 3)
    assert engine.generate([PROMPT], never)[0].token_ids[:12] == free.token_ids[:12]
    with pytest.raises(ValueError, match="grammar_after must be a non-empty sequence of token ids"):
        engine.generate([PROMPT], dataclasses.replace(params, grammar_after=()))
    # An opener: written first, the output is free up to the marker as before; never written (biased
    # away), the grammar holds from the first token.
    opened = engine.generate([PROMPT], dataclasses.replace(params, grammar_opener=free.token_ids[0]))[0]
    assert opened.token_ids == out.token_ids
    shut = engine.vocab_size - 1
    skipped = engine.generate([PROMPT], dataclasses.replace(params, grammar_opener=shut, logit_bias={shut: -100.0}))[0]
    assert re.fullmatch("(yes|no)!", skipped.text) and skipped.meta["finish_reason"] == "stop"
    with pytest.raises(ValueError, match="grammar_opener must be a token id, with grammar_after"):
        engine.generate([PROMPT], dataclasses.replace(params, grammar_after=None, grammar_opener=3))
    assert_pool_full(engine)


@pytest.mark.parametrize("kind, text, message", [
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}', 'Unsupported type "strin"'),
    ("regex", "[a-z", "regex is invalid"),
    ("ebnf", 'root ::= "a" rest', 'Rule "rest" is not defined'),
])
def test_an_invalid_grammar_is_a_value_error_and_the_engine_keeps_serving(engine, kind, text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate([PROMPT, PROMPT], [SamplingParams(regex="a+"), SamplingParams(**{kind: text})])
    assert engine.stats().num_waiting == engine.stats().num_running == 0  # the good one was not left behind
    out = engine.generate(PROMPT, SamplingParams(max_new_tokens=8, regex="[0-9]{3}"))[0]
    assert re.fullmatch("[0-9]{3}", out.text)
    assert_pool_full(engine)


def test_overlap_scheduling_masks_exactly_and_leaves_other_requests_alone(model, engine):
    """With overlap, a grammar batch's masks are filled one step late (after the batch in flight
    resolves); without it, before the batch is launched. Same tokens either way, under retraction too,
    and requests without a grammar get what they get alone."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}}, "required": ["ok", "n"]}
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=s, json_schema=schema) if s % 2 else
              SamplingParams(max_new_tokens=30, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]
    results = {}
    for overlap in (True, False):
        with Engine(model=model, device="cpu", dtype="float32", disable_overlap_schedule=not overlap,
                    max_running_requests=6, max_total_tokens=150, chunked_prefill_size=16,
                    schedule_conservativeness=0) as e:
            outs = e.generate([PROMPT] * len(params), params)
            results[overlap] = [(o.token_ids, o.meta["finish_reason"], o.text) for o in outs]
            assert e.stats().num_retractions > 0
            assert_pool_full(e)
    assert results[True] == results[False]
    for _, reason, text in results[True][1::2]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)
    for i in range(0, len(params), 2):
        assert engine.generate(PROMPT, params[i])[0].token_ids == results[True][i][0]


@pytest.mark.parametrize("parser_name", ["hermes", "llama3"])  # qwen25 is hermes' other name
def test_forced_tool_call_grammars_give_calls_that_parse(engine, parser_name):
    """The structural tag a parser builds for tool_choice "required" / a named function, as the server
    sends it: the output parses back into calls whose arguments follow the tools' schemas."""
    parser = tool_parser(parser_name)
    functions = [{"name": "get_weather", "parameters": {
                     "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {
                         "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}},
                 {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]
    schemas = {f["name"]: f["parameters"] for f in functions}
    # (With parallel calls a random model keeps calling until max_new_tokens: a trained one stops.)
    for forced, parallel in ((None, False), ("get_weather", True), ("now", False)):
        tag = json.dumps(parser.grammar(functions, forced, parallel))
        for out in engine.generate([PROMPT] * 2, sampled(2, max_new_tokens=300, structural_tag=tag)):
            assert out.meta["finish_reason"] == "stop", out.text
            content, calls = parse_tool_calls(parser, out.text, lambda: "id")
            assert content is None and calls, out.text
            assert len(calls) == 1
            for call in calls:
                assert forced in (None, call.name)
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])


SPECULATION = {"NGRAM": {}, "STANDALONE": dict(speculative_num_steps=3, speculative_eagle_topk=4,
                                               speculative_num_draft_tokens=8)}


@pytest.mark.parametrize("algorithm", sorted(SPECULATION))
def test_grammars_under_speculative_decoding_give_the_plain_engine_s_greedy_tokens(model, engine, algorithm):
    """Each node of a draft tree is masked by its request's grammar after the path to it: greedy tokens equal
    the plain engine's (JSON schema, regex, EBNF, a grammar after a marker, and a request without one in
    the same batch); sampled answers parse. STANDALONE drafts with the target itself (a tree of 8 nodes),
    so grammars end and markers complete inside accepted paths."""
    free = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))[0]
    greedy = [dict(json_schema=SCHEMA), dict(regex="(yes|no)! [a-z]{2,12}"), dict(ebnf='root ::= ("ab" | "ba")+ "."'),
              dict(regex="[0-9]{2,6}", grammar_after=tuple(free.token_ids[2:4])), dict(ignore_eos=True)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=60, **fields) for fields in greedy]
    want = [(o.token_ids, o.meta["finish_reason"]) for o in engine.generate([PROMPT] * len(params), params)]
    options = SPECULATION[algorithm]
    if algorithm == "STANDALONE":
        options = dict(options, speculative_draft_model_path=model)
    with Engine(model=model, device="cpu", dtype="float32", speculative_algorithm=algorithm, **options) as spec:
        outs = spec.generate([PROMPT] * len(params), params)
        assert [(o.token_ids, o.meta["finish_reason"]) for o in outs] == want
        if algorithm == "STANDALONE":  # the draft is not masked: it proposes what the model would say freely
            accepted = [o.meta["spec_accept_length"] for o in outs]
            assert accepted[-1] > 2 and sum(a > 1.1 for a in accepted[:-1]) >= 2, accepted
        for out in spec.generate([PROMPT] * 6, sampled(6, max_new_tokens=400, json_schema=SCHEMA)):
            jsonschema.validate(json.loads(out.text), SCHEMA)
            assert out.meta["finish_reason"] == "stop"
        assert_pool_full(spec)


def test_a_grammar_without_a_tokenizer_is_refused(tmp_path):
    bare = make_tiny_model("llama", tmp_path / "no-tokenizer")
    with Engine(model=str(bare), device="cpu", dtype="float32") as e:
        with pytest.raises(ValueError, match="regex needs a tokenizer"):
            e.add_request(prompt_token_ids=[3, 4], sampling_params=SamplingParams(regex="a"))


def hold_compiles(engine: Engine) -> threading.Event:
    """Make the engine's grammar compiles wait for the returned event (at most 20 s)."""
    engine.generate(PROMPT, SamplingParams(max_new_tokens=4, regex="[0-9]+"))  # the backend exists now
    release, compile_ = threading.Event(), engine.grammars._compile

    def held(kind: str, text: str):
        release.wait(20)
        return compile_(kind, text)

    engine.grammars._compile = held
    return release


def test_a_compiling_grammar_waits_alone_while_other_requests_run(model):
    """The compile runs off the engine loop: a plain request runs to its end while a grammar request
    waits unscheduled, a second request with the same grammar waits for the same compile, and both
    then run under their grammar."""
    with Engine(model=model, device="cpu", dtype="float32") as e:
        release = hold_compiles(e)
        misses = e.grammars.misses
        regex = "(yes|no), [a-z]{2,5}"
        constrained = [e.add_request(PROMPT, sampling_params=p) for p in sampled(2, max_new_tokens=40, regex=regex)]
        plain = e.add_request(PROMPT, sampling_params=SamplingParams(max_new_tokens=12, ignore_eos=True))
        while not e.request(plain).finished:
            e.step()
        assert len(e.request(plain).output_ids) == 12
        assert not any(e.request(rid).output_ids for rid in constrained)  # never scheduled
        assert e.stats().num_waiting == 2 and e.has_work()
        assert e.grammars.misses == misses + 1  # one compile for both
        release.set()
        while not all(e.request(rid).finished for rid in constrained):
            e.step()
        for rid in constrained:
            assert re.fullmatch(regex, e.output(e.pop(rid)).text)
        assert_pool_full(e)


def test_a_grammar_past_the_compile_timeout_fails_its_request_only(model):
    with Engine(model=model, device="cpu", dtype="float32", grammar_compile_timeout=0.2) as e:
        release = hold_compiles(e)
        with pytest.raises(ValueError, match=r"regex is invalid: it did not compile within 0.2 s"):
            e.generate([PROMPT, PROMPT], [SamplingParams(max_new_tokens=4), SamplingParams(regex="[a-f]+")])
        assert e.stats().num_waiting == e.stats().num_running == 0  # the other one was not left behind
        rid = e.add_request(PROMPT, sampling_params=SamplingParams(regex="[g-k]+"))  # the caller that steps
        while not e.request(rid).finished:
            e.step()
        out = e.output(e.pop(rid))
        assert out.meta["finish_reason"] == "error" and "did not compile within 0.2 s" in out.meta["error"]
        release.set()
        with pytest.raises(ValueError, match="grammar_max_length"):
            e.add_request(PROMPT, sampling_params=SamplingParams(regex="a" * 200_001))
        assert re.fullmatch("[0-9]+", e.generate(PROMPT, SamplingParams(max_new_tokens=4, regex="[0-9]+"))[0].text)
        assert_pool_full(e)


def test_the_grammar_bench_runs_its_smoke_setting(model, tmp_path):
    from kestrel.bench import grammar as bench

    out = tmp_path / "grammar.json"
    bench.main(["--model", model, "--device", "cpu", "--smoke", "--grammar", "json", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["workload"]["batch_size"] == 4 and result["steps_timed"]["plain"] > 0
    assert result["mask"]["steps"] > 0 and result["mask"]["mask_ms"] > 0
    assert result["mask_share_of_step"] == result["mask"]["mask_ms"] / result["step_ms"]["plain"]
