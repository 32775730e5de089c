"""Triton kernels at real shapes in bf16, and split launches on CUDA giving identical greedy tokens."""
from __future__ import annotations

import math

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.attention.triton.extend import extend_attention
from tests.e2e.test_engine import prompts_with_shared_prefixes
from tests.tiny_models import make_tiny_model
from tests.unit.test_triton_kernels import paged_layout, reference, run_decode

SHAPES = [(32, 8, 128), (28, 4, 128), (16, 16, 64)]  # (heads, kv heads, head_dim): Llama-8B, Qwen2-7B, small


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_extend_bf16_real_shapes(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    prefix, extend = [0, 1000, 37, 2048], [512, 300, 1, 129]
    seq = [p + e for p, e in zip(prefix, extend)]
    table, rows = paged_layout(seq, sum(seq) + 100, gen)
    k_buf = torch.randn(sum(seq) + 100, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    q = torch.randn(sum(extend), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ext = torch.tensor(extend, device="cuda")
    extend_attention(q, k_buf, v_buf, out, table, rows, torch.tensor(prefix, device="cuda"), ext,
                     torch.cumsum(ext, 0) - ext, max(extend), 1 / math.sqrt(head_dim), None, False)
    ref = reference(q, k_buf, v_buf, table, rows, prefix, extend, 1 / math.sqrt(head_dim), None)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_bf16_real_shapes(heads, kv_heads, head_dim, num_splits):
    gen = torch.Generator().manual_seed(heads + num_splits)
    seq = [1, 4096, 777, 2500] * 8
    table, rows = paged_layout(seq, sum(seq) + 100, gen)
    k_buf = torch.randn(sum(seq) + 100, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    q = torch.randn(len(seq), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    ref = reference(q, k_buf, v_buf, table, rows, [s - 1 for s in seq], [1] * len(seq), 1 / math.sqrt(head_dim), None)
    out = run_decode(q, k_buf, v_buf, table, rows, seq, 1 / math.sqrt(head_dim), None, False, num_splits)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_split_launches_identical_greedy_tokens_on_cuda(tmp_path):
    model = str(make_tiny_model("llama", tmp_path, with_tokenizer=True))
    prompts = prompts_with_shared_prefixes(8, seed=8)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for prefill in ("torch_native", "triton"):
        for decode in ("torch_native", "triton"):
            with Engine(model=model, device="cuda", dtype="float32", max_total_tokens=8192,
                        prefill_attention_backend=prefill, decode_attention_backend=decode) as e:
                first = e.generate(prompt_token_ids=prompts[:4], sampling_params=params)
                second = e.generate(prompt_token_ids=prompts[4:], sampling_params=params)
                results[prefill, decode] = [o.token_ids for o in first + second]
    assert all(r == results["torch_native", "torch_native"] for r in results.values())
