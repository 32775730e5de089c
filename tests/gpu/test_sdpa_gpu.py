"""The sdpa backend on CUDA: its fast path (cuDNN / flash in bf16) and its Triton fallback against
torch_native at the Llama-3.1-8B attention shape, and greedy tokens in the engine."""
from __future__ import annotations

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.attention import sdpa
from kestrel.attention.sdpa import SdpaBackend, takes_fast_path
from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.attention.triton_backend import TritonBackend
from kestrel.layers.attention import AttentionLayer
from tests.e2e.test_engine import prompts_with_shared_prefixes
from tests.tiny_models import make_tiny_model
from tests.unit.test_sdpa_backend import paged_batch, run

CASES = {  # (prefix lens, extend lens), fast path expected
    "one prompt": ([0], [2048], True),
    "after a prefix": ([1500], [700], True),
    "mixed lengths": ([0, 0, 300], [256, 1000, 513], True),
    "many short (fallback)": ([0] * 12, [40] * 12, False),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_sdpa_bf16_matches_torch_native(case, page_size, monkeypatch):
    monkeypatch.setattr(sdpa, "FAST_MIN_EXTEND", 256)  # the cases' sizes; the engine's threshold is higher
    prefixes, extends, fast = CASES[case]
    gen = torch.Generator().manual_seed(page_size + len(prefixes))
    layer = AttentionLayer(0, 32, 8, 128, scaling=128 ** -0.5)
    pools, req_to_token, batch, qkv = paged_batch(prefixes, extends, page_size, gen, shape=(32, 8, 128),
                                                  device="cuda", dtype=torch.bfloat16)
    assert takes_fast_path(batch, on_cuda=True) == fast
    ref_pools = pools.clone()
    fallback = TritonBackend(pools, req_to_token, upcast=False)
    out = run(SdpaBackend, pools, req_to_token, batch, qkv, layer, fallback=fallback, on_cuda=True)
    ref = run(TorchNativeBackend, ref_pools, req_to_token, batch, qkv, layer)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(pools.kv.k, ref_pools.kv.k) and torch.equal(pools.kv.v, ref_pools.kv.v)


def test_sdpa_prefill_greedy_tokens_on_cuda(tmp_path, monkeypatch):
    """Tiny prompts: the thresholds are lowered so the fast path (not only the Triton fallback) runs."""
    monkeypatch.setattr(sdpa, "FAST_MIN_EXTEND", 1)
    fast_calls = []
    attend = sdpa.causal_attention
    monkeypatch.setattr(sdpa, "causal_attention", lambda *args: fast_calls.append(args[3]) or attend(*args))
    model = str(make_tiny_model("llama", tmp_path, with_tokenizer=True))
    prompts = prompts_with_shared_prefixes(8, seed=8)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for prefill in ("torch_native", "sdpa"):
        with Engine(model=model, device="cuda", dtype="float32", max_total_tokens=8192, chunked_prefill_size=32,
                    prefill_attention_backend=prefill, decode_attention_backend="triton") as e:
            first = e.generate(prompt_token_ids=prompts[:4], sampling_params=params)
            second = e.generate(prompt_token_ids=prompts[4:], sampling_params=params)  # radix hits
            results[prefill] = [o.token_ids for o in first + second]
    assert results["sdpa"] == results["torch_native"]
    assert 0 in fast_calls and any(prefix > 0 for prefix in fast_calls)
