"""Paged MLA decode attention in the absorbed form, split-K (docs/design/attention-backends.md §7).

One new token per request; every head attends to the same latent entries [c | k_r] of its request:
score = q_lat . c + q_rope . k_r, value = c. The latent query q_lat = q_nope @ W_UK and the output's
W_UV stay outside (two batched GEMMs); this kernel is the part that reads the cache.

Grid (block of heads, request, split): a program takes BLOCK_H heads over one chunk of the request's
keys, so each entry it loads serves all of them (the latent is the one KV head of every query head).
The head blocks vary fastest, so the programs that read the same chunk run side by side and all but
the first find it in L2 (with the request first, a batch read its whole latent cache once per head block
from HBM).
Chunks as the MHA decode kernel's uniform policy: ceil(seq / num_splits) keys each, from the batch size
alone, so a CUDA graph replays it; partial outputs and log-sum-exps go through the MHA kernel's merge.
Each program whose chunk holds the last position first stores the new token's entry in the pool (every
head block writes the same bytes there), so no store kernel runs before it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.attention.triton.decode import merge_splits
from kestrel.envs import triton_jit
from kestrel.quant.fp8_triton import fp8_store_args, to_storage


@triton_jit
def _mla_decode_kernel(
    Q_lat, Q_rope, Cache, New, new_slots, O, mid_o, mid_lse, req_to_token, req_pool_indices, seq_lens,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_ct, stride_nt, stride_ot, stride_oh, stride_row,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, sm_scale, kv_scale, num_heads, num_splits,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr,
    FP8_MAX: tl.constexpr, EXACT_ROUND: tl.constexpr,
):
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_lens + b)
    row = tl.load(req_pool_indices + b)
    chunk = tl.cdiv(seq, num_splits)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq)

    h_mask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    if (lo <= seq - 1) & (seq - 1 < hi):  # this chunk holds the new token: its entry goes in first
        slot = tl.load(new_slots + b)
        c_new = tl.load(New + b * stride_nt + offs_r, mask=r_mask)
        r_new = tl.load(New + b * stride_nt + RANK + offs_p, mask=p_mask)
        tl.store(Cache + slot * stride_ct + offs_r, to_storage(c_new, kv_scale, Cache.dtype.element_ty, FP8_MAX,
                                                               EXACT_ROUND), mask=r_mask)
        tl.store(Cache + slot * stride_ct + RANK + offs_p, to_storage(r_new, kv_scale, Cache.dtype.element_ty,
                                                                      FP8_MAX, EXACT_ROUND), mask=p_mask)
        tl.debug_barrier()  # every thread of the program sees the stores before the loads below
    q_lat = tl.load(Q_lat + b * stride_qlt + heads[:, None] * stride_qlh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_rope = tl.load(Q_rope + b * stride_qrt + heads[:, None] * stride_qrh + offs_p[None, :],
                     mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    if UPCAST:  # the interpreter computes bf16 wrong: work in float32 there
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(req_to_token + row * stride_row + offs_n, mask=n_mask, other=0)
        c = tl.load(Cache + slots[:, None] * stride_ct + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                    other=0.0).to(q_lat.dtype)
        k_r = tl.load(Cache + slots[:, None] * stride_ct + RANK + offs_p[None, :],
                      mask=n_mask[:, None] & p_mask[None, :], other=0.0).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(q_rope, tl.trans(k_r), input_precision=PRECISION)
        s = tl.where(n_mask[None, :], s * (sm_scale * kv_scale), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * kv_scale
    if DIRECT:  # a single split is the whole answer: no merge
        tl.store(O + b * stride_ot + heads[:, None] * stride_oh + offs_r[None, :], out.to(O.dtype.element_ty),
                 mask=h_mask[:, None] & r_mask[None, :])
    else:
        # An empty chunk (a request shorter than the splits) gets lse = -inf and weight 0 in the merge.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_i))
        o_base = b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(mid_o + o_base[:, None] + offs_r[None, :], out, mask=h_mask[:, None] & r_mask[None, :])
        tl.store(mid_lse + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


# The launch that kestrel/bench/kernels/mla_decode.py's sweep found fastest on the H100 at V3's 128 heads
# (32k context, batch 1 and 32, bf16 and FP8 pools): 64 heads a program, 32 keys a step, 8 warps, about
# two programs per SM (docs/benchmarks.md).
BLOCK_H, BLOCK_N, NUM_WARPS, PROGRAMS_PER_SM, MAX_SPLITS = 64, 32, 8, 2, 64


def mla_decode_splits(batch_size: int, num_heads: int, sms: int, block_h: int = BLOCK_H,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """About `programs_per_sm` programs per SM, at most MAX_SPLITS splits; from the batch size alone (so a
    CUDA graph replays it) and the device's SM count."""
    blocks = batch_size * triton.cdiv(num_heads, block_h)
    return max(1, min(MAX_SPLITS, triton.cdiv(programs_per_sm * sms, blocks)))


def mla_decode_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, new_entries: torch.Tensor, cache: torch.Tensor,
                         out: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, new_slots: torch.Tensor, sm_scale: float, upcast: bool,
                         num_splits: int, kv_scale: float = 1.0, block_h: int = BLOCK_H, block_n: int = BLOCK_N,
                         num_warps: int = NUM_WARPS, num_stages: int = 2) -> None:
    """q_lat [B, heads, rank] (q_nope @ W_UK), q_rope [B, heads, rope]; new_entries [B, rank + rope], the new
    tokens' latent | rope key, stored at `new_slots` [B] (position seq_len - 1); cache [slots, rank + rope]
    (FP8 entries store value / kv_scale); out [B, heads, rank]: the attention output in latent space."""
    batch, num_heads, rank = q_lat.shape
    rope = q_rope.shape[2]
    block_r = triton.next_power_of_2(rank)
    direct = num_splits == 1
    mid_shape = (1, 1, 1) if direct else (batch, num_heads, num_splits)
    mid_o = torch.empty((*mid_shape, block_r), dtype=torch.float32, device=q_lat.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q_lat.device)
    _mla_decode_kernel[(triton.cdiv(num_heads, block_h), batch, num_splits)](
        q_lat, q_rope, cache, new_entries, new_slots, out, mid_o, mid_lse, req_to_token, req_pool_indices, seq_lens,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0), new_entries.stride(0),
        out.stride(0), out.stride(1), req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), sm_scale, kv_scale, num_heads, num_splits,
        RANK=rank, ROPE=rope, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h,
        BLOCK_N=block_n, UPCAST=upcast,
        # float32 stays float32 (TF32 would drift from the reference); half types use tensor cores.
        PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32", DIRECT=direct,
        **fp8_store_args(cache.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        merge_splits(mid_o, mid_lse, out, num_splits)
