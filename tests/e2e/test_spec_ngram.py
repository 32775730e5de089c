"""NGRAM speculative decoding through the engine: greedy tokens equal non-speculative greedy."""
from __future__ import annotations

import pytest

from kestrel import Engine, SamplingParams
from tests.e2e.conftest import assert_pool_full


def repetitive_prompts() -> list[list[int]]:
    """Prompts with repeats, so that n-gram drafts are sometimes right and sometimes wrong."""
    base = [7, 8, 9, 10, 11, 12]
    return [base * 3 + [40 + i] + base[:2 + i] for i in range(6)] + [[100 + i for i in range(25)]]


@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_ngram_greedy_equals_plain_greedy(tiny_model, topk, backend):
    model = tiny_model("llama")
    prompts = repetitive_prompts()
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", attention_backend=backend, max_total_tokens=1024)
    with Engine(model=model, **common) as plain:
        want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    shape = dict(speculative_num_steps=4, speculative_eagle_topk=topk, speculative_num_draft_tokens=5 if topk == 1 else 8)
    with Engine(model=model, speculative_algorithm="NGRAM", **shape, **common) as spec:
        got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want
        lengths = spec.spec_worker.accept_lengths
        assert lengths and max(lengths) > 1  # some drafts were accepted, so the rounds really ran
        assert_pool_full(spec)


def test_ngram_with_a_tiny_pool_retracts_and_stops_at_the_context(tiny_model):
    model = tiny_model("llama")
    prompts = repetitive_prompts()
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", max_total_tokens=200, context_length=48,
                  schedule_conservativeness=0)
    with Engine(model=model, **common) as plain:
        want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    with Engine(model=model, speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_eagle_topk=1,
                speculative_num_draft_tokens=4, **common) as spec:
        got = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == want
        assert spec.scheduler.num_retractions > 0
        assert_pool_full(spec)


def test_ngram_samples_reproducibly(tiny_model):
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)]
    with Engine(model=tiny_model("llama"), device="cpu", dtype="float32", speculative_algorithm="NGRAM") as spec:
        first = [o.token_ids for o in spec.generate(prompt_token_ids=repetitive_prompts()[:3], sampling_params=params)]
        assert first == [o.token_ids for o in spec.generate(prompt_token_ids=repetitive_prompts()[:3],
                                                            sampling_params=params)]


def test_ngram_penalties_equal_plain_greedy(tiny_model):
    """Repetitive prompts, where n-gram drafts repeat tokens the penalties push down: applied per node."""
    model, prompts = tiny_model("llama"), repetitive_prompts()
    params = [SamplingParams(max_new_tokens=16, temperature=0.0, **fields) for fields in
              (dict(repetition_penalty=1.5), dict(frequency_penalty=0.9), dict(presence_penalty=2.0),
               dict(min_new_tokens=10), dict(repetition_penalty=1.2, presence_penalty=0.5), {}, {})]
    with Engine(model=model, device="cpu", dtype="float32") as plain:
        want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    with Engine(model=model, device="cpu", dtype="float32", speculative_algorithm="NGRAM") as spec:
        assert [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)] == want
        assert_pool_full(spec)


def test_ngram_applies_logit_bias_in_the_verify(tiny_model):
    """logit_bias changes the target's distribution at every node alike, so speculation applies it in the
    verify: greedy equals plain greedy with the same bias, and a +100 bias forces sampled tokens."""
    model, prompts = tiny_model("llama"), repetitive_prompts()
    common = dict(device="cpu", dtype="float32", max_total_tokens=1024)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    with Engine(model=model, **common) as plain:
        unbiased = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=greedy)]
        frequent = max(range(plain.vocab_size), key=lambda t: sum(ids.count(t) for ids in unbiased))
        greedy.logit_bias = {frequent: -100.0, frequent + 1: 2.0}
        want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    assert want != unbiased and all(frequent not in ids for ids in want)
    forced = [SamplingParams(max_new_tokens=10, temperature=0.8, seed=s, ignore_eos=True, logit_bias={42: 100.0})
              for s in range(3)]
    with Engine(model=model, speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_eagle_topk=1,
                speculative_num_draft_tokens=5, **common) as spec:
        assert [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=greedy)] == want
        assert max(spec.spec_worker.accept_lengths) > 1  # drafts were accepted: the verify really ran
        outs = spec.generate(prompt_token_ids=prompts[:3], sampling_params=forced)
        assert all(o.token_ids == [42] * 10 for o in outs)
        assert_pool_full(spec)
