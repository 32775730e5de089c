"""Prompt logprobs (SamplingParams.prompt_logprobs) from the prefill, against transformers' logits."""
from __future__ import annotations

import pytest
import torch

from kestrel import Engine, SamplingParams
from tests.e2e.conftest import assert_pool_full
from tests.e2e.test_engine import prompts_with_shared_prefixes

TOP = 3


def hf_prompt_logprobs(model_path: str, prompts: list[list[int]]) -> list[tuple[list[float], list[list[int]]]]:
    """The oracle: per prompt, the log-softmax of transformers' logits at each position scored on the next
    prompt token, and the top-TOP token ids there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            lp = torch.log_softmax(model(ids, attention_mask=torch.ones_like(ids)).logits[0].float(), dim=-1)
            chosen = lp[:-1].gather(1, ids[0, 1:, None])[:, 0]
            out.append((chosen.tolist(), lp[:-1].topk(TOP, dim=-1).indices.tolist()))
    return out


def check_against_oracle(outs, prompts, oracle) -> None:
    for out, prompt, (chosen, top_ids) in zip(outs, prompts, oracle):
        pairs = out.meta["prompt_token_logprobs"]
        assert [t for _, t in pairs] == prompt and pairs[0][0] is None and out.meta["prompt_top_logprobs"][0] is None
        assert [lp for lp, _ in pairs[1:]] == pytest.approx(chosen, abs=1e-4)
        tops = out.meta["prompt_top_logprobs"][1:]
        assert all(len(top) == TOP for top in tops)
        # Ties aside, the same top tokens in the same order; their values are each position's largest.
        assert [[t for t, _ in top] for top in tops] == top_ids
        assert all(top[0][1] >= lp - 1e-6 for top, (lp, _) in zip(tops, pairs[1:]))


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_with_shared_prefixes(4, seed=4)


@pytest.fixture(scope="module")
def oracle(model, prompts):
    return hf_prompt_logprobs(model, prompts)


@pytest.mark.parametrize("options", [{}, {"chunked_prefill_size": 7}, {"chunked_prefill_size": 5, "page_size": 4,
                                                                       "enable_mixed_chunk": True}])
def test_prompt_logprobs_equal_transformers_whole_or_chunked_with_or_without_generation(model, prompts, oracle,
                                                                                         options):
    """max_new_tokens=0 only scores the prompt; with tokens to generate the output is the plain run's."""
    with Engine(model=model, device="cpu", dtype="float32", **options) as engine:
        plain = engine.generate(prompt_token_ids=prompts,
                                sampling_params=SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
        scored = SamplingParams(max_new_tokens=0, prompt_logprobs=TOP)
        generating = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
        outs = engine.generate(prompt_token_ids=prompts + prompts, sampling_params=[scored] * len(prompts) + [generating] * len(prompts))
        assert all(o.token_ids == [] and o.meta["finish_reason"] == "length" for o in outs[:len(prompts)])
        assert [o.token_ids for o in outs[len(prompts):]] == [o.token_ids for o in plain]
        assert_pool_full(engine)
    check_against_oracle(outs[:len(prompts)], prompts, oracle)
    check_against_oracle(outs[len(prompts):], prompts, oracle)


def test_a_cached_prefix_is_recomputed_for_its_logprobs(model, prompts, oracle):
    """The radix cache holds every prompt already; a prompt-logprob request still scores each position
    (it skips the match: cached_tokens 0) and leaves the cache consistent."""
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_new_tokens=2, temperature=0))
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_new_tokens=0,
                                                                                         prompt_logprobs=TOP))
        assert all(o.meta["cached_tokens"] == 0 for o in outs)
        again = engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_new_tokens=1))
        assert all(o.meta["cached_tokens"] == len(p) - 1 for o, p in zip(again, prompts))
        assert_pool_full(engine)
    check_against_oracle(outs, prompts, oracle)


def test_a_retracted_chunked_prompt_scores_each_position_once(model, prompts, oracle, monkeypatch):
    """A tight pool retracts the chunked prefill of a long prompt-logprob request while short requests
    decode beside it (mixed chunks); resumed, it matches its own cached chunks only up to what it scored."""
    from kestrel.engine.scheduler import Scheduler

    retracted = []
    retract = Scheduler._retract
    monkeypatch.setattr(Scheduler, "_retract", lambda self, req: (retracted.append((req.rid, req.prompt_logprob_len)),
                                                                  retract(self, req)))
    long_prompt = [p for prompt in prompts for p in prompt][:80]
    (expected,) = hf_prompt_logprobs(model, [long_prompt])
    decoding = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    with Engine(model=model, device="cpu", dtype="float32", max_total_tokens=96, chunked_prefill_size=8,
                enable_mixed_chunk=True, schedule_conservativeness=0) as engine:
        rids = [engine.add_request(prompt_token_ids=p[:2], sampling_params=decoding) for p in prompts[:3]]
        rid = engine.add_request(prompt_token_ids=long_prompt, sampling_params=SamplingParams(
            max_new_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=TOP))
        while engine.has_work():
            engine.step()
        out = engine.output(engine.pop(rid))
        for r in rids:
            engine.pop(r)
        assert_pool_full(engine)
    assert any(r == rid and 0 < scored < len(long_prompt) - 1 for r, scored in retracted)  # mid-prompt
    check_against_oracle([out], [long_prompt], [expected])


def test_bad_prompt_logprobs_raise_and_a_one_token_prompt_has_only_none(model):
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        for bad in (-1, 21, 1.5, True):
            with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer in"):
                engine.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(prompt_logprobs=bad))
        (out,) = engine.generate(prompt_token_ids=[[5]], sampling_params=SamplingParams(max_new_tokens=0,
                                                                                         prompt_logprobs=0))
        assert out.meta["prompt_token_logprobs"] == [(None, 5)] and out.meta["prompt_top_logprobs"] == [None]
        (out,) = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=0,
                                                                                               prompt_logprobs=0))
        assert [len(top) for top in out.meta["prompt_top_logprobs"][1:]] == [0, 0]
        assert_pool_full(engine)
    with Engine(model=model, device="cpu", dtype="float32", speculative_algorithm="NGRAM") as spec:
        with pytest.raises(ValueError, match="with speculative decoding, prompt_logprobs are not supported"):
            spec.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(prompt_logprobs=1))
