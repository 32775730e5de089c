"""The grammar backend (xgrammar): masks against an enumerated oracle, padded vocabularies, the cache,
compiler errors, the compile's time and size bounds, grammar ends, and the mask on the logits against a
naive reference."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import wait

import pytest
import torch

from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.grammar import GrammarBackend, GrammarError, GrammarLimits, apply_grammar_mask
from tests.tiny_tokenizer import build_tokenizer

MODEL_VOCAB = 530  # the logits' width: past the tokenizer's, as padded checkpoints have
WORDS = ["def add", "def sub", "class Foo"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), 512)


@pytest.fixture
def backend(tok):
    return GrammarBackend(tok, MODEL_VOCAB, {tok.eos_token_id})


def compiled(backend: GrammarBackend, params: SamplingParams):
    """The request's grammar state once its compile is over (GrammarError if it failed)."""
    state = backend.state(params)
    wait([state.compiled])
    assert state.poll()
    if state.error is not None:
        raise state.error
    return state


def result(backend: GrammarBackend, kind: str, text: str):
    return backend.compile(kind, text).result()


def allowed(mask_row: torch.Tensor) -> set[int]:
    """Token ids whose bit is set, read bit by bit."""
    return {i for i in range(MODEL_VOCAB) if (int(mask_row[i // 32]) >> (i % 32)) & 1}


def test_masks_allow_exactly_the_tokens_that_keep_a_word_reachable(tok, backend):
    # The oracle for a finite language: after text s, token t is allowed iff s + t starts some word
    # (stop tokens once s is a word); special tokens and padded ids never.
    regex = "|".join(w.replace(" ", "\\ ") for w in WORDS)
    state = compiled(backend, SamplingParams(regex=regex))
    texts = {i: tok.decode([i]) for i in range(len(tok))}
    special = set(tok.all_special_ids)
    target, done = tok.encode("def sub", add_special_tokens=False), ""
    for step in range(len(target) + 1):
        expected = {i for i, t in texts.items() if i not in special and t
                    and any(w.startswith(done + t) for w in WORDS)}
        if done in WORDS:
            expected.add(tok.eos_token_id)
        assert allowed(backend.fill([state])[0]) == expected, (step, done)
        assert state.ended() == (done in WORDS and not expected - {tok.eos_token_id})
        if step < len(target):
            assert state.accept(target[step])
            done += texts[target[step]]
    assert done == "def sub" and state.ended()


def test_padded_ids_are_never_allowed(tok, backend):
    state = compiled(backend, SamplingParams(json_schema={"type": "object"}))
    row = backend.fill([state])[0]
    assert row.shape[0] * 32 >= MODEL_VOCAB
    assert allowed(row) and max(allowed(row)) < len(tok)


def test_a_grammar_that_can_go_on_has_not_ended(tok, backend):
    state = compiled(backend, SamplingParams(regex="[0-9]+"))
    assert state.accept(tok.encode("1", add_special_tokens=False)[0])
    assert not state.ended()  # complete, but more digits may follow: the model picks EOS or a digit
    assert tok.eos_token_id in allowed(backend.fill([state])[0])
    assert state.accept(tok.eos_token_id) and state.ended()


def test_the_cache_is_hit_for_a_repeated_grammar_and_keeps_its_errors(backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = result(backend, "json_schema", json.dumps(schema))
    assert (backend.hits, backend.misses) == (0, 1)
    # A dict schema's key is its JSON text: the same grammar.
    assert result(backend, *SamplingParams(json_schema=schema).grammar) is first
    assert (backend.hits, backend.misses) == (1, 1)
    result(backend, "regex", "[a-z]+")
    assert (backend.hits, backend.misses) == (1, 2)
    for _ in range(2):
        with pytest.raises(GrammarError):
            result(backend, "regex", "a(b")
    assert (backend.hits, backend.misses) == (2, 3)
    with pytest.raises(GrammarError, match="parenthesis is not closed"):  # known to fail: refused at once
        backend.state(SamplingParams(regex="a(b"))


def test_the_cache_evicts_the_least_recently_used(tok):
    backend = GrammarBackend(tok, MODEL_VOCAB, {tok.eos_token_id}, cache_size=2)
    for text in ["a+", "b+", "a+", "c+", "a+"]:  # c+ evicts b+, the least recently used
        result(backend, "regex", text)
    assert (backend.hits, backend.misses) == (2, 3)
    result(backend, "regex", "b+")
    assert backend.misses == 4


@pytest.mark.parametrize("kind, text, message", [
    ("json_schema", '{"type": "strin"}', 'Unsupported type "strin"'),
    ("json_schema", "{not json", "Failed to parse JSON"),
    ("regex", "a(b", "parenthesis is not closed"),
    ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', "nope"),
])
def test_invalid_grammars_raise_the_compilers_message(backend, kind, text, message):
    with pytest.raises(GrammarError) as info:
        compiled(backend, SamplingParams(**{kind: text}))
    assert isinstance(info.value, ValueError) and info.value.param == kind
    assert str(info.value).startswith(f"{kind} is invalid: ") and message in str(info.value)
    assert ".cc:" not in str(info.value)  # the compiler's source location is noise for a user


def slow_compile(backend: GrammarBackend) -> threading.Event:
    """Make the backend's compile thread wait for the returned event before each compile."""
    release, compile_ = threading.Event(), backend._compile

    def held(kind: str, text: str):
        release.wait(30)
        return compile_(kind, text)

    backend._compile = held
    return release


def test_compiles_run_off_the_callers_thread_once_per_grammar(tok):
    backend = GrammarBackend(tok, MODEL_VOCAB, {tok.eos_token_id})
    release = slow_compile(backend)
    first = backend.state(SamplingParams(regex="[0-9]+"))  # returns while the compile is held
    second = backend.state(SamplingParams(regex="[0-9]+"))
    assert first.waiting and not first.poll() and second.compiled is first.compiled
    assert (backend.hits, backend.misses) == (1, 1)  # the second request waits for the same compile
    release.set()
    wait([first.compiled])
    assert first.poll() and second.poll() and first.matcher is not None and second.matcher is not first.matcher


def test_a_compile_past_the_timeout_fails_the_request_and_serves_later_ones(tok):
    backend = GrammarBackend(tok, MODEL_VOCAB, {tok.eos_token_id}, GrammarLimits(compile_timeout=0.05))
    release = slow_compile(backend)
    late = backend.state(SamplingParams(regex="[0-9]+"))
    time.sleep(0.1)
    assert late.poll() and late.matcher is None
    assert isinstance(late.error, GrammarError) and late.error.param == "regex"
    assert "did not compile within 0.05 s (grammar_compile_timeout)" in str(late.error)
    release.set()
    wait([late.compiled])
    assert compiled(backend, SamplingParams(regex="[0-9]+")).matcher is not None  # from the cache


def test_a_grammar_over_the_size_bound_is_refused_without_compiling(tok):
    backend = GrammarBackend(tok, MODEL_VOCAB, {tok.eos_token_id}, GrammarLimits(max_length=10))
    with pytest.raises(GrammarError, match=r"regex is invalid: it is 11 characters long; at most 10 are compiled"):
        backend.state(SamplingParams(regex="[0-9]{1,99}"))
    assert backend.misses == 0
    assert compiled(backend, SamplingParams(regex="[0-9]{1,9}")).matcher is not None


def test_sampling_params_take_at_most_one_grammar():
    with pytest.raises(ValueError, match="json_schema and regex are both set"):
        SamplingParams(json_schema="{}", regex="a").validate()
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        SamplingParams(regex="").validate()
    with pytest.raises(ValueError, match="ebnf must be a non-empty string or None"):
        SamplingParams(ebnf={"a": 1}).validate()
    SamplingParams(json_schema={"type": "object"}).validate()
    assert SamplingParams().grammar is None


def test_the_mask_on_the_logits_equals_a_naive_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, MODEL_VOCAB, generator=g)
    words = (MODEL_VOCAB + 31) // 32
    mask = torch.randint(-2**31, 2**31, (2, words), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 1])
    out = apply_grammar_mask(logits, rows, mask)
    expected = logits.clone()
    for j, row in enumerate(rows.tolist()):
        for token in range(MODEL_VOCAB):
            if not (int(mask[j, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.isfinite(logits).all()  # the input is left as it was
