"""The engine on CUDA equals transformers' greedy tokens (float32) and runs in bfloat16."""
from __future__ import annotations

import pytest

from kestrel import Engine, SamplingParams
from tests.e2e.conftest import ARCHS, assert_pool_full, hf_greedy
from tests.e2e.test_engine import prompts_with_shared_prefixes
from tests.tiny_models import make_tiny_model

PARAMS = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_float32_greedy_matches_transformers(tmp_path, arch):
    model = str(make_tiny_model(arch, tmp_path, with_tokenizer=True))
    prompts = prompts_with_shared_prefixes(8, seed=4)
    expected = hf_greedy(model, prompts, PARAMS.max_new_tokens)
    with Engine(model=model, device="cuda", dtype="float32", max_total_tokens=4096, chunked_prefill_size=16) as e:
        assert e.runner.device.type == "cuda"
        assert [o.token_ids for o in e.generate(prompt_token_ids=prompts, sampling_params=PARAMS)] == expected
        assert_pool_full(e)


def test_cuda_bfloat16_with_memory_sized_pool(tmp_path):
    model = str(make_tiny_model("qwen3", tmp_path, with_tokenizer=True, hidden_size=256, intermediate_size=512,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=32))
    prompts = prompts_with_shared_prefixes(8, seed=5)
    with Engine(model=model, mem_fraction_static=0.3) as e:  # device and dtype resolve to cuda / bfloat16
        assert e.config.device == "cuda" and e.config.model.dtype == "bfloat16"
        assert e.kv_memory.allocator.size > 100_000
        outs = e.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert all(len(o.token_ids) == 16 for o in outs)
        again = e.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert all(o.meta["cached_tokens"] > 0 for o in again)
        assert_pool_full(e)


def test_cuda_overlap_schedule_equals_synchronous_loop(tmp_path):
    """On CUDA the overlapped step really runs ahead of the host; outputs must not change: greedy with
    real eos stops, seeded sampling, logprobs, a tight pool (retraction), CUDA graphs on."""
    model = str(make_tiny_model("llama", tmp_path, with_tokenizer=True))
    prompts = prompts_with_shared_prefixes(12, seed=6)
    params = [SamplingParams(max_new_tokens=24, temperature=0.0),
              SamplingParams(max_new_tokens=20, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_new_tokens=18, temperature=0.0, logprobs=1, ignore_eos=True)] * 4
    outs = {}
    for disable in (True, False):
        with Engine(model=model, device="cuda", dtype="float32", max_total_tokens=400, schedule_conservativeness=0,
                    disable_overlap_schedule=disable) as e:
            got = e.generate(prompt_token_ids=prompts, sampling_params=params)
            assert_pool_full(e)
            outs[disable] = [(o.token_ids, o.meta["finish_reason"]) for o in got]
            assert e.scheduler.num_retractions > 0
    assert outs[False] == outs[True]
