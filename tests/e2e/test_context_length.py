"""A context length past the checkpoint's positions, run on purpose (KESTREL_ALLOW_LONG_CONTEXT=1) with a
scaled rope: prompts past the old positions run, with transformers' tokens (it computes rope at any
position) as the oracle."""
from __future__ import annotations

from kestrel import Engine, SamplingParams
from tests.e2e.conftest import assert_pool_full, hf_greedy


def test_an_opted_in_scaled_rope_runs_past_the_checkpoints_positions(tiny_model, monkeypatch):
    model = tiny_model("llama", max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 2.0})
    prompts = [[(5 * i) % 400 + 10 for i in range(90)], [7, 8, 9]]
    monkeypatch.setenv("KESTREL_ALLOW_LONG_CONTEXT", "1")
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(model=model, device="cpu", dtype="float32", context_length=128) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.token_ids for o in outs] == hf_greedy(model, prompts, 6)
        assert_pool_full(engine)
