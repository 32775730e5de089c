"""MLA attention cases on random weights, and a naive dense reference: each head's keys and values
up-projected from every latent, causal softmax in float64 (the model's MHA form, written out)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.cache.kv_layout import KVLayout
from kestrel.cache.kv_memory import KVPools
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.mla import MLAAttention
from kestrel.quant.kv import from_pool, to_pool

HEADS, NOPE, ROPE, V_DIM, RANK = 4, 16, 8, 12, 32


@dataclass
class Case:
    """One batch: request i has `prefix[i]` latents in the pool and `extend[i]` new tokens."""

    layer: MLAAttention
    pools: KVPools
    req_to_token: ReqToTokenPool
    batch: ForwardBatch
    q_nope: torch.Tensor  # [T, heads, nope] for the new tokens
    q_rope: torch.Tensor
    latent: torch.Tensor  # [T, rank]
    k_rope: torch.Tensor  # [T, rope]
    entries: list[torch.Tensor]  # per request, every position's latent | k_rope as the pool holds it


def make_case(prefix: list[int], extend: list[int], page_size: int, seed: int = 0, mode: ForwardMode | None = None,
              pool_dtype: torch.dtype = torch.float32, dtype: torch.dtype = torch.float32, device: str = "cpu",
              heads: int = HEADS) -> Case:
    gen = torch.Generator().manual_seed(seed)
    layer = MLAAttention(0, heads, NOPE, ROPE, V_DIM, RANK, scaling=(NOPE + ROPE) ** -0.5 * 1.3)
    with torch.no_grad():
        layer.kv_b_proj.copy_(torch.randn(layer.kv_b_proj.shape, generator=gen) * 0.3)
    layer.to(device=device, dtype=dtype)
    seqs = [p + e for p, e in zip(prefix, extend)]
    # Slots page by page: each request's pages are scattered over the pool (never page 0), and
    # consecutive positions of a request share a page up to `page_size`.
    pages_each = [-(-s // page_size) for s in seqs]
    num_pages = sum(pages_each) + 3
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    pools = KVPools(KVLayout.latent_attention(1, RANK, ROPE, pool_dtype), num_pages * page_size, len(seqs) + 2, device)
    req_to_token = ReqToTokenPool(len(seqs) + 1, max(seqs) + 2, device)
    rows = torch.randperm(len(seqs), generator=gen)
    entries, new_slots = [], []
    for i, (p, s) in enumerate(zip(prefix, seqs)):
        own, pages = pages[:pages_each[i]], pages[pages_each[i]:]
        slots = torch.tensor([own[j // page_size] * page_size + j % page_size for j in range(s)])
        req_to_token.table[rows[i], :s] = slots.to(device)
        values = torch.randn(s, RANK + ROPE, generator=gen).to(device=device, dtype=dtype)
        stored = to_pool(values, pool_dtype, 1.0)
        pools.layer(0).latent[slots[:p].to(device)] = stored[:p]  # the cached prefix
        entries.append(from_pool(stored, torch.float64, 1.0))
        new_slots.append(slots[p:])
    total = sum(extend)
    new_values = torch.cat([e[p:] for e, p in zip(entries, prefix)]).to(dtype)
    if mode is None:
        mode = ForwardMode.DECODE if all(e == 1 for e in extend) else ForwardMode.EXTEND
    lens = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    batch = ForwardBatch(
        forward_mode=mode, input_ids=torch.zeros(total, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seqs)]).to(device),
        out_cache_loc=torch.cat(new_slots).to(device), req_pool_indices=rows.to(device), seq_lens=lens(seqs),
        prefix_lens=lens(prefix), extend_lens=lens(extend), seq_lens_cpu=seqs, prefix_lens_cpu=list(prefix),
        extend_lens_cpu=list(extend), max_extend=max(extend), logits_indices=torch.arange(total, device=device),
        attn_backend=None)
    q_nope = torch.randn(total, heads, NOPE, generator=gen).to(device=device, dtype=dtype)
    q_rope = torch.randn(total, heads, ROPE, generator=gen).to(device=device, dtype=dtype)
    return Case(layer, pools, req_to_token, batch, q_nope, q_rope, new_values[:, :RANK].contiguous(),
                new_values[:, RANK:].contiguous(), entries)


def reference(case: Case) -> torch.Tensor:
    """[T, heads * v_dim] in float64: per-head K/V up-projected from every position's latent."""
    layer = case.layer
    w = layer.kv_b_proj.double().view(layer.num_heads, NOPE + V_DIM, RANK)
    outs, start = [], 0
    for entries, p, e in zip(case.entries, case.batch.prefix_lens_cpu, case.batch.extend_lens_cpu):
        latent, k_rope = entries[:, :RANK], entries[:, RANK:]
        k = torch.cat([torch.einsum("hnr,sr->hsn", w[:, :NOPE], latent),
                       k_rope[None].expand(layer.num_heads, -1, -1)], dim=-1)  # [heads, seq, nope + rope]
        v = torch.einsum("hvr,sr->hsv", w[:, NOPE:], latent)
        q = torch.cat([case.q_nope[start:start + e], case.q_rope[start:start + e]], dim=-1).double().transpose(0, 1)
        s = torch.einsum("hqd,hkd->hqk", q, k) * layer.scaling
        visible = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
        s = s.masked_fill(~visible.to(s.device), float("-inf"))
        outs.append(torch.einsum("hqk,hkv->qhv", s.softmax(-1), v).reshape(e, -1))
        start += e
    return torch.cat(outs)


def run(backend, case: Case) -> torch.Tensor:
    case.batch.attn_backend = backend
    backend.init_forward_metadata(case.batch)
    return case.layer(case.q_nope, case.q_rope, case.latent, case.k_rope, case.batch)
