"""Tensor parallelism on CPU: two ranks over gloo give the tokens one rank gives (fp32, tiny models).

Each TP=2 engine spawns one extra rank process (about 4 s on a loaded 2-core machine), so a test
builds as few engines as it can.
"""
from __future__ import annotations

import pytest

from kestrel import Engine, SamplingParams
from tests.e2e.test_engine import prompts_with_shared_prefixes

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


def run(model: str, prompts: list[list[int]], params: list[SamplingParams], **options) -> list[list[int]]:
    with Engine(model=model, device="cpu", dtype="float32", **options) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("arch, overrides", [
    # vocab 511: the vocab-parallel rows do not split evenly (rank 1 holds a padding row).
    ("llama", dict(vocab_size=511)),
    # One KV head for two ranks: each rank keeps a copy of it; tied embeddings; qk-norm; head_dim 32.
    ("qwen3", dict(num_key_value_heads=1, tie=True)),
    ("qwen2", {}),  # q/k/v biases sharded with their rows
], ids=["llama", "qwen3-kv-heads-fewer-than-ranks", "qwen2-bias"])
def test_tp2_tokens_equal_tp1(tiny_model, arch, overrides):
    model = tiny_model(arch, **overrides)
    prompts = prompts_with_shared_prefixes(4, vocab=overrides.get("vocab_size", 512), seed=3)
    # A seeded sampled request too: every rank must draw the same token (the next step's input).
    params = [GREEDY] * 3 + [SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50, seed=7, ignore_eos=True)]
    # Chunked prefill over shared prefixes: chunks, radix hits and decodes all cross the ranks.
    options = dict(chunked_prefill_size=16, enable_mixed_chunk=True)
    one = run(model, prompts, params, **options)
    assert run(model, prompts, params, tp_size=2, **options) == one
