"""Paged decode attention, split-K: one new token per request attends to its whole KV row.

Stage 1 splits each request's keys into chunks; one program handles every query head of a KV head
(GQA) on one chunk and writes a partial output and its log-sum-exp. Stage 2 merges the chunks.
Splitting keeps the GPU busy when the batch is small and the sequences long.

Two split policies, both with the static grid (batch, kv_heads, num_splits) a CUDA graph needs:
- uniform: every request cut into `num_splits` chunks of ceil(seq / num_splits) keys, so a program's
  work is proportional to its request's length;
- length-aware (`length_aware_chunks`): each request gets its own chunk size, computed on the device
  from the batch's lengths, so that every program reads about the same number of keys and a batch of
  mixed lengths has no long programs left running alone at the end. Programs past a request's last
  chunk exit at once.

Stage 1 also writes the new token's K and V into the pool: the program whose chunk holds the last
position stores them before reading its chunk, so no separate store kernel runs (a launch per layer
saved, which is what counts at batch 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel import pdl
from kestrel.attention.triton.common import attend_block, sink_denominator
from kestrel.envs import triton_jit
from kestrel.quant.fp8 import is_fp8
from kestrel.quant.fp8_triton import fp8_store_args, to_storage

# Over an FP8 pool, convert the entries to fp16 and run both dots in fp16 (float32 sums; entries <= 448,
# q and the probabilities well inside fp16's range) instead of converting them to bf16: e4m3 -> fp16 is
# one instruction per pair, e4m3 -> bf16 several, and an FP8 pool reads 49-65 % of copy bandwidth against
# bf16's 85-97 % (docs/benchmarks.md). Off until measured on a GPU.
FP8_POOL_FP16_DOTS = False


@triton_jit
def _decode_partial_kernel(
    Q, K, V, O, mid_o, mid_lse, req_to_token, req_pool_indices, seq_lens, split_chunks, split_counts, K_new, V_new, new_slots,
    Sinks,
    stride_knt, stride_vnt, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_row,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, sm_scale, k_scale, v_scale, window, num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    DIRECT: tl.constexpr, PER_REQUEST_CHUNK: tl.constexpr, FP8_MAX: tl.constexpr, EXACT_ROUND: tl.constexpr,
    HAS_SINKS: tl.constexpr, RING: tl.constexpr, FP16_DOTS: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_lens + b)
    row = tl.load(req_pool_indices + b)
    if PER_REQUEST_CHUNK:
        # Past this request's last chunk: nothing to read, and the merge reads only its split_counts[b]
        # first splits, so nothing to write either.
        if split >= tl.load(split_counts + b):
            return
        chunk = tl.load(split_chunks + b)
    else:
        chunk = tl.cdiv(seq, num_splits)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq)
    if USE_WINDOW:  # the query sits at position seq - 1
        lo = tl.maximum(lo, seq - window)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    h_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if (lo <= seq - 1) & (seq - 1 < hi):  # this chunk holds the new token: put its K/V in the pool first
        slot = tl.load(new_slots + b)
        k_new = tl.load(K_new + b * stride_knt + kv_head * HEAD_DIM + offs_d, mask=d_mask)
        v_new = tl.load(V_new + b * stride_vnt + kv_head * HEAD_DIM + offs_d, mask=d_mask)
        tl.store(K + slot * stride_kt + kv_head * stride_kh + offs_d,
                 to_storage(k_new, k_scale, K.dtype.element_ty, FP8_MAX, EXACT_ROUND), mask=d_mask)
        tl.store(V + slot * stride_vt + kv_head * stride_vh + offs_d,
                 to_storage(v_new, v_scale, V.dtype.element_ty, FP8_MAX, EXACT_ROUND), mask=d_mask)
        tl.debug_barrier()  # every thread of the program sees the stores before the loads below
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:  # the interpreter computes bf16 wrong: work in float32 there
        q = q.to(tl.float32)
    elif FP16_DOTS:  # see FP8_POOL_FP16_DOTS
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        m_i, l_i, acc = attend_block(q, K, V, req_to_token, row, stride_row, kv_head, stride_kt, stride_kh,
                                     stride_vt, stride_vh, offs_n, n_mask, n_mask[None, :], offs_d, d_mask, m_i, l_i,
                                     acc, sm_scale * k_scale, PRECISION, RING)
    if HAS_SINKS and DIRECT:  # with several splits the merge adds the sink once, to the whole
        out = acc / sink_denominator(l_i, m_i, tl.load(Sinks + heads, mask=h_mask, other=0.0))[:, None] * v_scale
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
    if DIRECT:  # a single split is the whole answer: no second stage
        tl.store(O + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=h_mask[:, None] & d_mask[None, :])
    else:
        # An empty chunk (short sequence, or outside the window) gets lse = -inf and weight 0 in stage 2.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_i))
        o_base = b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(mid_o + o_base[:, None] + offs_d[None, :], out, mask=h_mask[:, None] & d_mask[None, :])
        tl.store(mid_lse + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton_jit
def _decode_merge_kernel(
    mid_o, mid_lse, O, split_counts, Sinks, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ot,
    stride_oh, num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    PER_TOKEN_COUNT: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    if PER_TOKEN_COUNT:  # splits past this count were never written
        s_mask = offs_s < tl.load(split_counts + b)
    else:
        s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))
    parts = tl.load(mid_o + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    if HAS_SINKS:  # the sink joins the denominator once, as one more part with lse = sink and value 0
        sink = tl.load(Sinks + h)
        m_all = tl.maximum(m, sink)
        w = tl.exp(lse - m_all)
        out = tl.sum(parts * w[:, None], 0) / (tl.sum(w, 0) + tl.exp(sink - m_all))
    else:
        out = tl.sum(parts * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(O + b * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_mask)


def uniform_splits(batch_size: int, num_kv_heads: int) -> int:
    """The uniform policy's split count: about 128 programs (the H200 has 132 SMs), at most 16 splits.
    From the batch size alone, so a captured graph stays valid for every replay."""
    return max(1, min(16, 128 // (batch_size * num_kv_heads)))


@dataclass(frozen=True)
class LengthAwareSplit:
    """The length-aware split policy's settings (host ints: a captured graph keeps them).

    Each step aims at `target_programs` programs of equal work: chunk = ceil(kv_heads x total keys /
    target_programs), at least `min_chunk`, and each request is cut into s_b = clamp(ceil(seq_b / chunk),
    1, max_splits) pieces of ceil(seq_b / s_b) keys. The chunk comes from the device's sum of the
    lengths, not from a host-side guess (batch size, pool size): a batch of short requests and one of
    long ones with the same size need chunks 10x apart, and only the lengths tell them apart. The
    default target, 4096 programs, is ~16 per resident slot of an H200 (132 SMs x 2 programs of this
    kernel): with a greedy hardware scheduler the last program ends at most one chunk after the
    average, about 1/16 of the step's time. Unmeasured: kestrel/bench/kernels/decode_attention.py sweeps it."""

    target_programs: int = 4096
    max_splits: int = 16  # the grid's split dimension; past it a long request's chunks grow instead
    min_chunk: int = 64  # one BLOCK_N: a smaller chunk only adds programs and merge work


@dataclass(frozen=True)
class SplitPlan:
    """One step's length-aware split, on the device: request b's keys are read by split_counts[b]
    programs of split_chunks[b] keys each (the last may be shorter)."""

    split_chunks: torch.Tensor  # [B] int64
    split_counts: torch.Tensor  # [B] int64, between 1 and max_splits for a non-empty request
    max_splits: int


def length_aware_plan(seq_lens: torch.Tensor, num_kv_heads: int, policy: LengthAwareSplit) -> SplitPlan:
    """The length-aware split of a decode batch, by torch ops on the device: no host sync, so a CUDA
    graph captures it and each replay recomputes it from that step's lengths. Once per step; every
    layer's kernel reads it."""
    target = policy.target_programs
    chunk = ((seq_lens.sum() * num_kv_heads + target - 1) // target).clamp(min=policy.min_chunk)
    splits = ((seq_lens + chunk - 1) // chunk).clamp(1, policy.max_splits)
    chunks = ((seq_lens + splits - 1) // splits).clamp(min=1)  # equal pieces: no short leftover chunk
    counts = (seq_lens + chunks - 1) // chunks  # <= splits: rounding up the pieces may leave the last empty
    return SplitPlan(chunks, counts, policy.max_splits)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     out: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, new_slots: torch.Tensor, sm_scale: float, sliding_window: int | None,
                     upcast: bool, num_splits: int, k_scale: float = 1.0, v_scale: float = 1.0, block_n: int = 64,
                     num_warps: int = 4, num_stages: int = 3, split_plan: SplitPlan | None = None,
                     sinks: torch.Tensor | None = None, ring: int = 0) -> None:
    """q/out: [B, num_heads, head_dim] (one token per request); k/v: [B, num_kv_heads * head_dim], the new
    tokens' K/V (rows may be strided views), stored at `new_slots` [B] (their req_to_token entries at
    position seq_len - 1); k_buf/v_buf: [slots, num_kv_heads, head_dim], FP8 buffers storing value / scale
    (kestrel.quant.kv), dequantized in registers.

    Without `split_plan` every request is cut into `num_splits` equal chunks (uniform policy); with one
    (length-aware policy, `length_aware_plan`) each request is cut as the plan says and `num_splits` is
    ignored for the plan's `max_splits`. One split per request writes the output directly, no merge.
    `sinks`: float32 [num_heads] attention-sink logits (None: no sink). `ring` > 0: k_buf/v_buf are
    sliding-window rings of that length, flattened to [rows * ring, ...] (kestrel.attention.window_ring),
    read without `req_to_token`; `new_slots` are then ring slots."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    if split_plan is not None:
        num_splits = split_plan.max_splits
    direct = num_splits == 1
    per_request = split_plan is not None and not direct
    mid_shape = (1, 1, 1) if direct else (batch, num_heads, num_splits)
    mid_o = torch.empty((*mid_shape, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    chunks, counts = (split_plan.split_chunks, split_plan.split_counts) if per_request else (seq_lens, seq_lens)
    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        q, k_buf, v_buf, out, mid_o, mid_lse, req_to_token, req_pool_indices, seq_lens, chunks, counts, k, v,
        new_slots, sinks if sinks is not None else mid_lse, k.stride(0), v.stride(0), q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0), mid_o.stride(0),
        mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), sm_scale, k_scale, v_scale,
        sliding_window or 0, num_splits,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, USE_WINDOW=sliding_window is not None, UPCAST=upcast,
        # float32 stays float32 (TF32 would drift from the reference); half types use tensor cores.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DIRECT=direct, PER_REQUEST_CHUNK=per_request,
        **fp8_store_args(k_buf.dtype), HAS_SINKS=sinks is not None, RING=ring,
        FP16_DOTS=FP8_POOL_FP16_DOTS and is_fp8(k_buf.dtype) and not upcast, num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_options(q.device),
    )
    if not direct:
        merge_splits(mid_o, mid_lse, out, num_splits, counts if per_request else None, sinks)


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                 split_counts: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:
    """out[t, h] = the softmax-weighted mix of the partial outputs mid_o[t, h, s] by their log-sum-exps
    mid_lse[t, h, s] (t: a query token; the decode kernel has one per request), over the first
    split_counts[t] splits when given (the others were never written), else all `num_splits`; with
    `sinks` [num_heads], head h's sink logit joins the denominator."""
    tokens, num_heads, head_dim = out.shape
    block_d = mid_o.shape[-1]
    per_token = split_counts is not None
    _decode_merge_kernel[(tokens, num_heads)](
        mid_o, mid_lse, out, split_counts if per_token else mid_lse, sinks if sinks is not None else mid_lse,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), out.stride(0),
        out.stride(1), num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), PER_TOKEN_COUNT=per_token, HAS_SINKS=sinks is not None,
        **pdl.launch_options(out.device),
    )
