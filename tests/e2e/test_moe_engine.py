"""The MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral) through the engine on CPU: greedy tokens = transformers'
(several requests batched, decodes crossing Mixtral's window of 8), and = themselves one at a time, with
chunked prefill, and on a radix hit."""
from __future__ import annotations

import pytest

from kestrel import Engine
from tests.e2e.conftest import assert_pool_full, hf_greedy
from tests.e2e.test_engine import GREEDY, prompts_with_shared_prefixes, run

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_matches_transformers_batched_chunked_and_one_at_a_time(tiny_model, arch):
    model = tiny_model(arch)
    prompts = prompts_with_shared_prefixes(4, seed=5)
    batched = run(model, prompts)
    assert batched == hf_greedy(model, prompts, GREEDY.max_new_tokens)
    assert run(model, prompts, chunked_prefill_size=7, enable_mixed_chunk=True) == batched
    assert [run(model, [p])[0] for p in prompts[:2]] == batched[:2]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_radix_hit_equals_cold_run(tiny_model, arch):
    model = tiny_model(arch)
    first = list(range(10, 40))
    follow = [first + [7, 8, 9], first[:20] + [5]]
    cold = run(model, follow, disable_radix_cache=True)
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        engine.generate(prompt_token_ids=[first], sampling_params=GREEDY)
        outs = engine.generate(prompt_token_ids=follow, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == cold
        assert outs[0].meta["cached_tokens"] == len(first)
        assert_pool_full(engine)
