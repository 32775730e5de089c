"""The length-aware decode split: its plan's invariants, and the kernel under it against the naive
reference, the uniform split and torch_native over an FP8 pool."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")
from kestrel.attention.triton.decode import LengthAwareSplit, length_aware_plan  # noqa: E402
from tests.unit.test_triton_kernels import DEVICE, UPCAST, paged_layout, reference, run_decode  # noqa: E402

# min_chunk 8 with a target that never asks for more: the chunk is 8 keys. Lengths: one key, a few
# (one chunk), exactly two chunks (16), several chunks with a remainder (37: 5 pieces, the last 5 keys),
# and one past max_splits (100: 6 pieces of 17).
POLICY = LengthAwareSplit(target_programs=10_000, max_splits=6, min_chunk=8)
SEQ = [1, 5, 16, 37, 100]


@pytest.mark.parametrize("policy", [POLICY, LengthAwareSplit(target_programs=64, max_splits=16, min_chunk=64),
                                    LengthAwareSplit(target_programs=10**6, max_splits=4, min_chunk=1)])
def test_plan_cuts_each_request_into_near_equal_chunks_that_cover_it(policy):
    seq = torch.tensor([1, 5, 16, 37, 100, 8, 9, 3000])
    plan = length_aware_plan(seq, 2, policy)
    chunk = max(policy.min_chunk, math.ceil(2 * int(seq.sum()) / policy.target_programs))
    for n, c, k in zip(seq.tolist(), plan.split_chunks.tolist(), plan.split_counts.tolist()):
        assert 1 <= k <= policy.max_splits and (k - 1) * c < n <= k * c  # k chunks, none empty, all keys
        wanted = math.ceil(n / chunk)
        if wanted == 1:
            assert k == 1
        elif wanted <= policy.max_splits:
            assert chunk / 2 < c <= chunk  # equal pieces of at most one chunk
        else:
            assert c == math.ceil(n / policy.max_splits)  # too long for the chunk: fewer, bigger pieces


def test_plan_of_the_kernel_tests():
    plan = length_aware_plan(torch.tensor(SEQ), 2, POLICY)
    assert plan.split_counts.tolist() == [1, 1, 2, 5, 6] and plan.split_chunks.tolist() == [1, 5, 8, 8, 17]


def _inputs(group, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    table, rows = paged_layout(SEQ, 300, gen)
    k_buf = torch.randn(300, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_buf = torch.randn(300, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(SEQ), kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k_buf, v_buf, table, rows


@pytest.mark.parametrize("group, head_dim, dtype, window", [
    (2, 64, torch.float32, None), (4, 64, torch.float16, None), (4, 64, torch.float32, 7),
    (2, 64, torch.bfloat16, 20),
])
def test_length_aware_decode_matches_reference_and_the_uniform_split(group, head_dim, dtype, window):
    q, k_buf, v_buf, table, rows = _inputs(group, head_dim, dtype, group * 10 + head_dim)
    scale = 1 / math.sqrt(head_dim)
    ref = reference(q, k_buf, v_buf, table, rows, [s - 1 for s in SEQ], [1] * len(SEQ), scale, window)
    plan = length_aware_plan(torch.tensor(SEQ, device=DEVICE), k_buf.shape[1], POLICY)
    # The buffers hold the pool as it was: run_decode blanks the new tokens' slots and checks the kernel
    # writes them back, under each policy in turn.
    pool = k_buf.clone(), v_buf.clone()
    got = run_decode(q, k_buf, v_buf, table, rows, SEQ, scale, window, UPCAST, 1, block_n=16, split_plan=plan)
    uniform = run_decode(q, *pool, table, rows, SEQ, scale, window, UPCAST, 3, block_n=16)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), uniform.float(), atol=tol, rtol=tol)


def test_length_aware_with_one_split_writes_the_output_directly():
    """max_splits 1 takes the single-split path (no merge): the whole row in one program."""
    q, k_buf, v_buf, table, rows = _inputs(2, 64, torch.float32, 3)
    scale = 1 / math.sqrt(64)
    ref = reference(q, k_buf, v_buf, table, rows, [s - 1 for s in SEQ], [1] * len(SEQ), scale, None)
    plan = length_aware_plan(torch.tensor(SEQ, device=DEVICE), 2, LengthAwareSplit(max_splits=1, min_chunk=8))
    got = run_decode(q, k_buf, v_buf, table, rows, SEQ, scale, None, UPCAST, 16, block_n=16, split_plan=plan)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 8])
def test_length_aware_backend_over_an_fp8_pool_matches_torch_native(window):
    """Through the backend (plan made in init_forward_metadata, the new K/V stored by the kernel) over
    an FP8 pool with non-unit scales, against torch_native on the same pool: outputs and stored bytes."""
    from kestrel.attention.torch_native import TorchNativeBackend
    from kestrel.attention.triton_backend import TritonBackend
    from kestrel.core.forward_mode import ForwardMode
    from kestrel.layers.attention import AttentionLayer
    from tests.unit.test_fp8_kv import HEAD_DIM, KV_HEADS, _clone, _filled_pools, make_batch

    gen = torch.Generator().manual_seed(5)
    pools = _filled_pools(torch.float8_e4m3fn, 0.75, 0.05, gen)
    prefix = [0, 7, 31, 60]
    batch, r2t = make_batch(ForwardMode.DECODE, prefix, [1] * len(prefix), gen)
    layer = AttentionLayer(0, KV_HEADS * 2, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=window)
    q = torch.randn(len(prefix), KV_HEADS * 2 * HEAD_DIM, generator=gen)
    k = torch.randn(len(prefix), KV_HEADS * HEAD_DIM, generator=gen) * 2
    v = torch.randn(len(prefix), KV_HEADS * HEAD_DIM, generator=gen)
    native_pools, triton_pools = pools, _clone(pools)
    want = TorchNativeBackend(native_pools, r2t).forward(q, k, v, layer, batch)
    triton = TritonBackend(triton_pools, r2t, upcast=True, decode_split=POLICY)
    triton.init_forward_metadata(batch)
    assert triton._split_plan.split_counts.tolist() == [1, 1, 4, 6]  # the split this test is about
    got = triton.forward(q, k, v, layer, batch)
    assert torch.equal(triton_pools.layer(0).k.view(torch.uint8), native_pools.layer(0).k.view(torch.uint8))
    assert torch.equal(triton_pools.layer(0).v.view(torch.uint8), native_pools.layer(0).v.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
