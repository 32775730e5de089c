"""DeepSeek-V3 through the engine on the torch_native MLA backend: fp32 greedy tokens equal transformers'
for a batch, whole or in chunks, cold and on radix hits."""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from kestrel import Engine, SamplingParams
from tests.model.dsv3_tiny import make_dsv3

PROMPTS = [[5, 17, 99, 3, 64, 2, 120], [45, 7, 7, 31, 88, 11, 0, 54, 23]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_dsv3(tmp_path_factory.mktemp("dsv3"))
    hf = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    expected = []
    for tokens in PROMPTS:
        ids = torch.tensor([tokens])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        expected.append(out[0, len(tokens):].tolist())
    return str(path), expected


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked"])
def test_greedy_matches_transformers_batched_chunked_and_on_radix_hits(tiny, chunk):
    path, expected = tiny
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    kwargs = {} if chunk is None else {"chunked_prefill_size": chunk}
    with Engine(model=path, device="cpu", dtype="float32", **kwargs) as engine:
        assert [o.token_ids for o in engine.generate(prompt_token_ids=PROMPTS, sampling_params=params)] == expected
        again = engine.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        assert [o.token_ids for o in again] == expected
        assert all(o.meta["cached_tokens"] > 0 for o in again)
        one = [engine.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids for p in PROMPTS]
        assert one == expected
