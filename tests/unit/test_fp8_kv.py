"""FP8 KV cache: the store round trip, the Triton kernels (interpreter) against torch_native over the same
FP8 pool, and the KV accounting."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.cache.kv_layout import Indexing, KVBuffer, KVGroup, KVLayout
from kestrel.cache.kv_memory import KVPools, pool_size
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.config import CacheConfig
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer
from kestrel.quant.kv import from_pool, kv_cache_dtype, to_pool

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SLOTS, KV_HEADS, HEAD_DIM = 200, 2, 32


def fp8_layout(dtype: torch.dtype, k_scale: float, v_scale: float, layers: int = 1) -> KVLayout:
    entry = (KV_HEADS, HEAD_DIM)
    return KVLayout((KVGroup("full", tuple(range(layers)), Indexing.TOKEN,
                             (KVBuffer("k", entry, dtype, k_scale), KVBuffer("v", entry, dtype, v_scale))),))


def make_batch(mode: ForwardMode, prefix: list[int], extend: list[int], gen: torch.Generator):
    """A batch over scattered slots (never slot 0): req_to_token rows, new slots, and the request rows."""
    seq = [p + e for p, e in zip(prefix, extend)]
    r2t = ReqToTokenPool(len(seq) + 1, max(seq) + 1, "cpu")
    perm = torch.randperm(SLOTS - 1, generator=gen) + 1
    used, new = 0, []
    for row, (p, n) in enumerate(zip(prefix, seq)):
        r2t.table[row, :n] = perm[used:used + n]
        new.append(perm[used + p:used + n])
        used += n
    batch = ForwardBatch(
        forward_mode=mode, input_ids=torch.zeros(sum(extend), dtype=torch.int64),
        positions=torch.zeros(sum(extend), dtype=torch.int64), out_cache_loc=torch.cat(new),
        req_pool_indices=torch.arange(len(seq)), seq_lens=torch.tensor(seq), prefix_lens=torch.tensor(prefix),
        extend_lens=torch.tensor(extend), seq_lens_cpu=seq, prefix_lens_cpu=prefix, extend_lens_cpu=extend,
        max_extend=max(extend), logits_indices=torch.tensor(extend).cumsum(0) - 1, attn_backend=None)
    return batch, r2t


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_store_then_read_is_quantize_dequantize(dtype, scale):
    """torch_native's store + the read it attends over == to_pool/from_pool of the input: an FP8 pool
    keeps value / scale rounded to the nearest FP8 value, with out-of-range values saturated."""
    gen = torch.Generator().manual_seed(1)
    pools = KVPools(fp8_layout(dtype, scale, 2 * scale), SLOTS, 4, "cpu")
    batch, r2t = make_batch(ForwardMode.EXTEND, [0, 0], [7, 5], gen)
    layer = AttentionLayer(0, KV_HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    k = torch.randn(12, KV_HEADS * HEAD_DIM, generator=gen) * 3
    v = torch.randn(12, KV_HEADS * HEAD_DIM, generator=gen) * 1e-2
    k[0, 0], k[1, 1], v[2, 2] = 1e6, -1e6, 1e9  # beyond every FP8 range: clipped, not inf
    TorchNativeBackend(pools, r2t).forward(k, k, v, layer, batch)
    kv = pools.layer(0)
    assert kv.k.dtype == dtype and kv.k_scale == scale and kv.v_scale == 2 * scale
    stored_k = from_pool(kv.k[batch.out_cache_loc], torch.float32, kv.k_scale).flatten(1)
    stored_v = from_pool(kv.v[batch.out_cache_loc], torch.float32, kv.v_scale).flatten(1)
    assert torch.isfinite(stored_k).all() and torch.isfinite(stored_v).all()
    limit = torch.finfo(dtype).max
    top = torch.tensor(limit) * scale
    assert stored_k[0, 0] == top and stored_k[1, 1] == -top
    # The oracle: round-to-nearest-even of torch's own float -> FP8 cast, after saturation.
    expect_k = (k / scale).clamp(-limit, limit).to(dtype).float() * scale
    expect_v = (v / (2 * scale)).clamp(-limit, limit).to(dtype).float() * (2 * scale)
    assert torch.equal(stored_k, expect_k) and torch.equal(stored_v, expect_v)
    # Within the normal range: at most half a step, eps / 2 of the value.
    info = torch.finfo(dtype)
    normal = (k.abs() >= info.tiny * scale) & (k.abs() <= limit * scale)
    assert ((stored_k - k).abs() / k.abs())[normal].max() <= info.eps / 2


@pytest.mark.parametrize("dtype", FP8)
def test_triton_store_writes_what_torch_stores(dtype):
    """The Triton store kernel's bytes == to_pool's, ties and carries into the next binade included."""
    pytest.importorskip("triton")
    from kestrel.attention.triton.store import store_kv

    gen = torch.Generator().manual_seed(2)
    k = torch.randn(9, KV_HEADS * HEAD_DIM, generator=gen) * 5
    v = torch.randn(9, KV_HEADS * HEAD_DIM, generator=gen) / 50
    k[0, :4] = torch.tensor([7.9375, 15.5, 1e9, -1e9]) * 0.6  # e4m3: carries into an odd exponent, and out of range
    slots = torch.randperm(SLOTS - 1, generator=gen)[:9] + 1
    k_buf = torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_buf = torch.zeros_like(k_buf)
    store_kv(k, v, k_buf, v_buf, slots, 0.6, 0.013)

    def same_bytes(buf, values, scale):
        return torch.equal(buf[slots].flatten(1).view(torch.uint8), to_pool(values, dtype, scale).view(torch.uint8))

    assert same_bytes(k_buf, k, 0.6) and same_bytes(v_buf, v, 0.013)


def _filled_pools(dtype: torch.dtype, k_scale: float, v_scale: float, gen: torch.Generator) -> KVPools:
    pools = KVPools(fp8_layout(dtype, k_scale, v_scale), SLOTS, 4, "cpu")
    kv = pools.layer(0)
    kv.k.copy_(to_pool(torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen) * 2, dtype, k_scale))
    kv.v.copy_(to_pool(torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen), dtype, v_scale))
    return pools


def _clone(pools: KVPools) -> KVPools:
    copy = KVPools(pools.layout, SLOTS, 4, "cpu")
    copy.layer(0).k.copy_(pools.layer(0).k)
    copy.layer(0).v.copy_(pools.layer(0).v)
    return copy


CASES = [  # (mode, prefix lens, extend lens, query heads per KV head, sliding window)
    (ForwardMode.DECODE, [0, 9, 40], [1, 1, 1], 2, None),
    (ForwardMode.DECODE, [5, 60], [1, 1], 4, 8),
    (ForwardMode.EXTEND, [0, 17, 3], [11, 6, 20], 2, None),
    (ForwardMode.EXTEND, [30], [9], 1, 7),
]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("mode, prefix, extend, group, window", CASES)
def test_triton_kernels_over_an_fp8_pool_match_torch_native(dtype, mode, prefix, extend, group, window):
    """Decode (its in-kernel store included) and extend, through the Triton backend in the interpreter,
    against torch_native over the same FP8 pool with non-unit scales: outputs and stored bytes."""
    pytest.importorskip("triton")
    from kestrel.attention.triton_backend import TritonBackend

    gen = torch.Generator().manual_seed(len(prefix) * 10 + group)
    pools = _filled_pools(dtype, 0.75, 0.05, gen)
    batch, r2t = make_batch(mode, prefix, extend, gen)
    layer = AttentionLayer(0, KV_HEADS * group, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=window)
    tokens = sum(extend)
    q = torch.randn(tokens, KV_HEADS * group * HEAD_DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS * HEAD_DIM, generator=gen) * 2
    v = torch.randn(tokens, KV_HEADS * HEAD_DIM, generator=gen)
    native_pools, triton_pools = pools, _clone(pools)
    want = TorchNativeBackend(native_pools, r2t).forward(q, k, v, layer, batch)
    triton = TritonBackend(triton_pools, r2t, upcast=True)
    triton.init_forward_metadata(batch)
    got = triton.forward(q, k, v, layer, batch)
    assert torch.equal(triton_pools.layer(0).k.view(torch.uint8), native_pools.layer(0).k.view(torch.uint8))
    assert torch.equal(triton_pools.layer(0).v.view(torch.uint8), native_pools.layer(0).v.view(torch.uint8))
    # torch_native dequantizes before attending, Triton folds the scales into the scores and the output.
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_fp8_pool_bytes_are_one_per_element_and_size_the_pool():
    bf16 = KVLayout.full_attention(4, 8, 128, torch.bfloat16)
    fp8 = KVLayout.full_attention(4, 8, 128, kv_cache_dtype("fp8_e4m3", torch.bfloat16))
    assert fp8.bytes_per_token == 4 * 2 * 8 * 128 == bf16.bytes_per_token / 2
    assert KVPools(fp8, 16, 2, "cpu").layer(3).v.element_size() == 1
    assert kv_cache_dtype("auto", torch.float16) == torch.float16
    assert kv_cache_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2


def test_fp8_pool_holds_twice_the_tokens_in_the_same_gpu_budget(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 20 * 2**30))
    cache = dataclasses.replace(CacheConfig(), page_size=1, mem_fraction_static=0.9)  # as resolve() leaves it
    bf16 = KVLayout.full_attention(32, 8, 128, torch.bfloat16)
    fp8 = KVLayout.full_attention(32, 8, 128, torch.float8_e4m3fn)
    tokens_bf16 = pool_size(cache, [bf16], 8, torch.device("cuda"))
    tokens_fp8 = pool_size(cache, [fp8], 8, torch.device("cuda"))
    assert tokens_bf16 == int(8 * 2**30 // (32 * 2 * 8 * 128 * 2))
    assert tokens_fp8 == 2 * tokens_bf16


def test_pool_size_counts_the_allocators_unused_blocks_as_free(monkeypatch):
    """A process that used the GPU before (a closed Engine, a training loop) holds cached blocks the driver
    reports as used: they are released before the free memory is read."""
    cached = {"bytes": 6 * 2**30}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: cached.update(bytes=0))
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (10 * 2**30 - cached["bytes"], 20 * 2**30))
    cache = dataclasses.replace(CacheConfig(), page_size=1, mem_fraction_static=0.9)
    layout = KVLayout.full_attention(32, 8, 128, torch.bfloat16)
    assert pool_size(cache, [layout], 8, torch.device("cuda")) == int(8 * 2**30 // (32 * 2 * 8 * 128 * 2))


def test_unknown_kv_cache_dtype_lists_the_valid_ones():
    with pytest.raises(ValueError, match="auto, fp8_e4m3, fp8_e5m2.*'fp16'"):
        kv_cache_dtype("fp16", torch.float16)
