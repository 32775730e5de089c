"""The sdpa backend against torch_native on paged extend batches, and its per-batch routing."""
from __future__ import annotations

import math

import pytest
import torch

from kestrel.attention import sdpa
from kestrel.attention.sdpa import SdpaBackend, takes_fast_path
from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.cache.kv_layout import Indexing, KVLayout
from kestrel.cache.kv_memory import LayerKV
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class Pools:
    """One layer's K/V buffers, as KVPools.layer() hands them out."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv = LayerKV(k=k, k_scale=1.0, k_indexing=Indexing.TOKEN, v=v, v_scale=1.0)
        self.layout = KVLayout.full_attention(1, k.shape[1], k.shape[2], k.dtype)  # the backends read has_rings

    def clone(self) -> "Pools":
        return Pools(self.kv.k.clone(), self.kv.v.clone())

    def layer(self, layer_id: int) -> LayerKV:
        return self.kv


def paged_batch(prefixes: list[int], extends: list[int], page_size: int, gen: torch.Generator,
                mode: ForwardMode = ForwardMode.EXTEND, shape: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
                device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Requests in scattered pages (slot 0's page reserved); prefix K/V random in the pool. `shape`:
    (heads, kv heads, head dim)."""
    heads, kv_heads, head_dim = shape
    seqs = [p + e for p, e in zip(prefixes, extends)]
    pages = [math.ceil(s / page_size) for s in seqs]
    order = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    slots_total = (sum(pages) + 1) * page_size
    pools = Pools(*(torch.randn(slots_total, kv_heads, head_dim, generator=gen).to(device, dtype) for _ in "kv"))
    req_to_token = ReqToTokenPool(len(seqs) + 2, max(seqs) + 5, device)
    rows = [len(seqs) + 1 - i for i in range(len(seqs))]  # not in batch order
    new_slots, used = [], 0
    for row, p, s, n in zip(rows, prefixes, seqs, pages):
        slots = torch.cat([torch.arange(page * page_size, (page + 1) * page_size) for page in order[used:used + n]])[:s]
        used += n
        req_to_token.table[row, :s] = slots
        new_slots.append(slots[p:].to(device))
    tokens = sum(extends)
    as_tensor = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
    batch = ForwardBatch(
        forward_mode=mode, input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefixes, seqs)]).to(device),
        out_cache_loc=torch.cat(new_slots), req_pool_indices=as_tensor(rows),
        seq_lens=as_tensor(seqs), prefix_lens=as_tensor(prefixes), extend_lens=as_tensor(extends),
        seq_lens_cpu=seqs, prefix_lens_cpu=prefixes, extend_lens_cpu=extends, max_extend=max(extends),
        logits_indices=torch.arange(tokens, device=device), attn_backend=None)
    qkv = [torch.randn(tokens, n * head_dim, generator=gen).to(device, dtype) for n in (heads, kv_heads, kv_heads)]
    return pools, req_to_token, batch, qkv


def run(backend_cls, pools, req_to_token, batch, qkv, layer, **kwargs):
    backend = backend_cls(pools, req_to_token, **kwargs)
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    return backend.forward(*qkv, layer, batch)


CASES = {  # (prefix lens, extend lens)
    "one prompt": ([0], [13]),
    "after a prefix": ([9], [7]),
    "mixed lengths": ([0, 5, 0, 11], [6, 1, 17, 4]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_sdpa_equals_torch_native(case, page_size, window):
    prefixes, extends = CASES[case]
    gen = torch.Generator().manual_seed(page_size * 31 + len(prefixes))
    layer = AttentionLayer(0, HEADS, KV_HEADS, HEAD_DIM, scaling=HEAD_DIM ** -0.5, sliding_window=window)
    pools, req_to_token, batch, qkv = paged_batch(prefixes, extends, page_size, gen)
    ref_pools = pools.clone()

    fallback = TorchNativeBackend(pools, req_to_token)
    calls = []
    fallback_forward = fallback.forward
    fallback.forward = lambda *args: calls.append(1) or fallback_forward(*args)
    out = run(SdpaBackend, pools, req_to_token, batch, qkv, layer, fallback=fallback, on_cuda=False)
    ref = run(TorchNativeBackend, ref_pools, req_to_token, batch, qkv, layer)

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pools.kv.k, ref_pools.kv.k) and torch.equal(pools.kv.v, ref_pools.kv.v)
    # The fast path served it unless the window is shorter than a sequence.
    assert bool(calls) == (window is not None and max(batch.seq_lens_cpu) > window)


def test_fast_path_routing_per_batch(monkeypatch):
    monkeypatch.setattr(sdpa, "FAST_MAX_REQUESTS", 2)
    monkeypatch.setattr(sdpa, "FAST_MIN_EXTEND", 8)
    gen = torch.Generator().manual_seed(0)
    few_long = paged_batch([0, 4], [8, 9], 1, gen)[2]
    many = paged_batch([0, 0, 0], [8, 8, 8], 1, gen)[2]
    short = paged_batch([0, 4], [8, 3], 1, gen)[2]
    decode = paged_batch([3, 4], [1, 1], 1, gen, ForwardMode.DECODE)[2]
    verify = paged_batch([3], [9], 1, gen, ForwardMode.TARGET_VERIFY)[2]
    verify.tree_mask, verify.tree_mask_starts = torch.ones(81, dtype=torch.bool), torch.zeros(1, dtype=torch.int64)
    assert takes_fast_path(few_long, on_cuda=True)
    assert not takes_fast_path(many, on_cuda=True) and not takes_fast_path(short, on_cuda=True)
    assert takes_fast_path(many, on_cuda=False) and takes_fast_path(short, on_cuda=False)  # no faster fallback
    for batch in (decode, verify):
        assert not takes_fast_path(batch, on_cuda=False) and not takes_fast_path(batch, on_cuda=True)
