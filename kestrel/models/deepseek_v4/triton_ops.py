"""Parts of a V4 layer as one Triton launch each, on CUDA (the model's `fused` flag): at batch 1 a V4 decode
layer is launch-bound (its rope alone ran six times per ratio-4 layer at ~9 torch launches each). The
kernels round where the torch forms do (`V4Rope.forward`, `V4Attention`'s head norm, RMSNorm).

- `rope`: the pairs (x[2k], x[2k+1]) of the last `rope_dim` dims of each row turned by position x omega_k
  (negated for the inverse), angles, products and sums in float32, the result cast to x's dtype; the
  other dims copied. A program per row of D values (a token's head, or a token).
- `norm_rope`: a norm, then the rope, for q and the K=V entry of every layer: without a weight the
  attention's head norm (each row times rsqrt(mean(row^2) + eps), the statistic in float32 and cast to
  the row's dtype before the product), with one layers.norm.RMSNorm's rounding.
- `compress_decode`: a compressor's whole step for a batch of one new token per request, after its two
  projections: the position's `ape` row added to the score, both rows stored in the state rings, and for a
  request whose token closes a block, the block pooled (softmax per channel over its candidate rows),
  normalised and roped into its entry. In torch that is ~25 launches per compressor (gathers, cats,
  masks, softmax, ring scatters), and a ratio-4 layer runs two compressors every step.
- `index_scores`: the lightning indexer's block scores for a batch of one query per request, read
  straight from the indexer keys' buffer through the request's block table (torch gathers every
  request's keys into a copy first, then runs five more launches).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel import envs
from kestrel.envs import triton_jit


@triton_jit
def _rope_kernel(X, Pos, Omega, Out, rows_per_token, dim, sign, ROPE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = dim - ROPE
    offs = tl.arange(0, BLOCK_D)
    keep = offs < base  # the dims rope leaves alone; the rope dims are stored below, by other lanes
    tl.store(Out + row * dim + offs, tl.load(X + row * dim + offs, mask=keep), mask=keep)
    k = tl.arange(0, ROPE // 2)
    angle = tl.load(Pos + row // rows_per_token).to(tl.float32) * tl.load(Omega + k) * sign
    cos, sin = tl.cos(angle), tl.sin(angle)
    even = tl.load(X + row * dim + base + 2 * k).to(tl.float32)
    odd = tl.load(X + row * dim + base + 2 * k + 1).to(tl.float32)
    tl.store(Out + row * dim + base + 2 * k, (even * cos - odd * sin).to(Out.dtype.element_ty))
    tl.store(Out + row * dim + base + 2 * k + 1, (even * sin + odd * cos).to(Out.dtype.element_ty))


def rope(x: torch.Tensor, positions: torch.Tensor, omega: torch.Tensor, rope_dim: int, inverse: bool) -> torch.Tensor:
    """x [T, ..., D] at positions [T], omega float32 [rope_dim // 2] -> a new tensor, x's shape and dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim, tokens = x.shape[-1], x.shape[0]
    if x.numel():
        rows = x.numel() // dim
        _rope_kernel[(rows,)](x, positions, omega, out, rows // tokens, dim, -1.0 if inverse else 1.0,
                              ROPE=rope_dim, BLOCK_D=triton.next_power_of_2(dim))
    return out


@triton_jit
def _norm_rope_kernel(X, Wt, Pos, Omega, Out, rows_per_token, dim, eps, HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    xf = tl.load(X + row * dim + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)
    if not HAS_WEIGHT:  # the head norm casts its statistic to the row's dtype before the product
        rstd = rstd.to(X.dtype.element_ty).to(tl.float32)
    normed = (xf * rstd).to(Out.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        normed = (normed * tl.load(Wt + offs, mask=mask, other=0.0).to(tl.float32)).to(Out.dtype.element_ty)
    base = dim - ROPE
    keep = offs < base  # the dims the rope leaves alone; the rope dims are stored below, by other lanes
    tl.store(Out + row * dim + offs, normed.to(Out.dtype.element_ty), mask=keep)
    k = tl.arange(0, ROPE // 2)
    even = tl.load(X + row * dim + base + 2 * k).to(tl.float32)
    odd = tl.load(X + row * dim + base + 2 * k + 1).to(tl.float32)
    even = (even * rstd).to(Out.dtype.element_ty).to(tl.float32)
    odd = (odd * rstd).to(Out.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        even = (even * tl.load(Wt + base + 2 * k).to(tl.float32)).to(Out.dtype.element_ty).to(tl.float32)
        odd = (odd * tl.load(Wt + base + 2 * k + 1).to(tl.float32)).to(Out.dtype.element_ty).to(tl.float32)
    angle = tl.load(Pos + row // rows_per_token).to(tl.float32) * tl.load(Omega + k)
    cos, sin = tl.cos(angle), tl.sin(angle)
    tl.store(Out + row * dim + base + 2 * k, (even * cos - odd * sin).to(Out.dtype.element_ty))
    tl.store(Out + row * dim + base + 2 * k + 1, (even * sin + odd * cos).to(Out.dtype.element_ty))


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor, omega: torch.Tensor,
              rope_dim: int) -> torch.Tensor:
    """x [T, ..., D] -> rope(norm(x)) in one launch: with `weight`, the RMSNorm of layers.norm (D-wide weight),
    else the head norm (module docstring); then `rope` at positions [T]. x's shape and dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim, tokens = x.shape[-1], x.shape[0]
    if x.numel():
        rows = x.numel() // dim
        _norm_rope_kernel[(rows,)](x, weight if weight is not None else x, positions, omega, out, rows // tokens, dim,
                                   eps, HAS_WEIGHT=weight is not None, ROPE=rope_dim,
                                   BLOCK_D=triton.next_power_of_2(dim))
    return out


@triton_jit
def _compress_decode_kernel(
    KV, Score, Ape, RingKV, RingScore, Rows, Pos, Table, NormW, Omega, Out, Slots,
    stride_proj, stride_ape, stride_ring_row, stride_ring_pos, stride_table, ring_len, eps,
    RATIO: tl.constexpr, OVERLAP: tl.constexpr, DIM: tl.constexpr, WIDTH: tl.constexpr, CAND: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + b)
    row = tl.load(Rows + b).to(tl.int64)
    # 1. This token's rows, the score with its place in the block's `ape` row, into the rings.
    ring_base = row * stride_ring_row + (pos % ring_len) * stride_ring_pos
    for w0 in tl.static_range(0, WIDTH, BLOCK_W):
        offs = w0 + tl.arange(0, BLOCK_W)
        ok = offs < WIDTH
        kv = tl.load(KV + b * stride_proj + offs, mask=ok)
        score = tl.load(Score + b * stride_proj + offs, mask=ok) + \
            tl.load(Ape + (pos % RATIO) * stride_ape + offs, mask=ok)
        tl.store(RingKV + ring_base + offs, kv, mask=ok)
        tl.store(RingScore + ring_base + offs, score, mask=ok)
    index = pos // RATIO
    complete = (pos + 1) % RATIO == 0
    # A request that closes no block writes its (zero) entry to BLOCK slot 0, which no request reads.
    slot = tl.load(Table + row * stride_table + index * RATIO) // RATIO
    tl.store(Slots + b, tl.where(complete, slot, 0))
    offs_c = tl.arange(0, BLOCK_C)
    if complete:
        tl.debug_barrier()  # the rows stored above are read back below, by other threads of the program
        # 2. The block's candidates: its own RATIO rows (with overlap, their second half of channels), and
        # with overlap the previous block's rows' first half (none before block 0: weight 0).
        j = tl.arange(0, CAND)
        own = j >= (RATIO if OVERLAP else 0)
        cand_pos = index * RATIO - (RATIO if OVERLAP else 0) + j  # own: the block's, else the one before
        real = cand_pos >= 0
        cand_off = (cand_pos % ring_len) * stride_ring_pos + tl.where(own, DIM if OVERLAP else 0, 0)
        sumsq = 0.0
        for c0 in tl.static_range(0, DIM, BLOCK_C):
            ch = c0 + offs_c
            ch_ok = ch < DIM
            ptr = row * stride_ring_row + cand_off[:, None] + ch[None, :]
            m = real[:, None] & ch_ok[None, :]
            s = tl.load(RingScore + ptr, mask=m, other=float("-inf"))
            v = tl.load(RingKV + ptr, mask=m, other=0.0)
            p = tl.exp(s - tl.max(s, 0)[None, :])
            pooled = tl.sum(p * v, 0) / tl.sum(p, 0)
            pooled = pooled.to(Out.dtype.element_ty)  # the entry's dtype before the norm, as in torch
            pf = pooled.to(tl.float32)
            sumsq += tl.sum(tl.where(ch_ok, pf * pf, 0.0), 0)
            tl.store(Out + b * DIM + ch, pooled, mask=ch_ok)
        # 3. RMSNorm (as layers.norm.RMSNorm rounds), then the rope at the block's first position.
        rstd = 1.0 / tl.sqrt(sumsq / DIM + eps)
        tl.debug_barrier()
        for c0 in tl.static_range(0, DIM, BLOCK_C):
            ch = c0 + offs_c
            ch_ok = ch < DIM
            h = tl.load(Out + b * DIM + ch, mask=ch_ok).to(tl.float32)
            normed = (h * rstd).to(Out.dtype.element_ty).to(tl.float32)
            normed = normed * tl.load(NormW + ch, mask=ch_ok).to(tl.float32)
            tl.store(Out + b * DIM + ch, normed.to(Out.dtype.element_ty), mask=ch_ok)
        tl.debug_barrier()
        k = tl.arange(0, ROPE // 2)
        base = DIM - ROPE
        angle = (index * RATIO).to(tl.float32) * tl.load(Omega + k)
        cos, sin = tl.cos(angle), tl.sin(angle)
        even = tl.load(Out + b * DIM + base + 2 * k).to(tl.float32)
        odd = tl.load(Out + b * DIM + base + 2 * k + 1).to(tl.float32)
        tl.debug_barrier()  # every lane has read its pair before any is overwritten
        tl.store(Out + b * DIM + base + 2 * k, (even * cos - odd * sin).to(Out.dtype.element_ty))
        tl.store(Out + b * DIM + base + 2 * k + 1, (even * sin + odd * cos).to(Out.dtype.element_ty))
    else:
        for c0 in tl.static_range(0, DIM, BLOCK_C):
            ch = c0 + offs_c
            tl.store(Out + b * DIM + ch, tl.zeros([BLOCK_C], Out.dtype.element_ty), mask=ch < DIM)


def compress_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, rings: tuple[torch.Tensor, torch.Tensor],
                    rows: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, omega: torch.Tensor, rope_dim: int, ratio: int, overlap: bool,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per request b at positions[b], held in REQUEST row rows[b]: kv, score [B, width] float32
    (the projections; score without `ape`), rings (kv, score) [R, ring_len, width] float32, `table` the
    req_to_token table. Returns (entries [B, dim] in `dtype`, BLOCK slots [B]): the normalised, roped entry
    of the block each token closes, else zeros for slot 0. `Compressor.forward` computes the same in torch."""
    B, width = kv.shape
    dim = width // (2 if overlap else 1)
    out = torch.empty(B, dim, dtype=dtype, device=kv.device)
    slots = torch.empty(B, dtype=torch.int64, device=kv.device)
    if B:
        ring_kv, ring_score = rings
        kv, score, rows, positions = kv.contiguous(), score.contiguous(), rows.contiguous(), positions.contiguous()
        _compress_decode_kernel[(B,)](
            kv, score, ape, ring_kv, ring_score, rows, positions, table, norm_weight, omega, out, slots,
            kv.stride(0), ape.stride(0), ring_kv.stride(0), ring_kv.stride(1), table.stride(0), ring_kv.shape[1], eps,
            RATIO=ratio, OVERLAP=overlap, DIM=dim, WIDTH=width, CAND=ratio * (2 if overlap else 1), ROPE=rope_dim,
            BLOCK_C=min(64, triton.next_power_of_2(dim)), BLOCK_W=min(256, triton.next_power_of_2(width)))
    return out, slots


@triton_jit
def _index_scores_kernel(Q, W, Keys, Slots, Visible, Out, scale, stride_qt, stride_qh, stride_wt, stride_key,
                         stride_slots, stride_out, n_blocks,
                         HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seen = offs_n < tl.load(Visible + t)  # block i is visible from its last token on
    in_table = offs_n < n_blocks
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < HEADS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DIM
    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                other=0.0)
    slots = tl.load(Slots + t * stride_slots + offs_n, mask=seen & in_table, other=0)
    keys = tl.load(Keys + slots[:, None].to(tl.int64) * stride_key + offs_d[None, :],
                   mask=(seen & in_table)[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter computes bf16 products wrong: float32 there
        q, keys = q.to(tl.float32), keys.to(tl.float32)
    s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N], float32 sums
    # Rounded where torch's products in q's dtype round: each head's score, the weights, the sum.
    s = tl.maximum(s.to(Q.dtype.element_ty).to(tl.float32), 0.0)
    w = tl.load(W + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32) * scale
    w = w.to(Q.dtype.element_ty).to(tl.float32)
    score = tl.sum(w[:, None] * s, 0).to(Q.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * stride_out + offs_n, tl.where(seen, score, float("-inf")), mask=in_table)


def index_scores(q: torch.Tensor, w: torch.Tensor, scale: float, keys: torch.Tensor, slots: torch.Tensor,
                 visible: torch.Tensor) -> torch.Tensor:
    """One query per request: q [B, heads, dim], w [B, heads] (the weights' projection, before `scale`),
    keys [BLOCK slots, dim] (q's dtype), slots [B, N] the requests' block tables, visible [B] how many of
    their blocks each query sees -> float32 [B, N]: sum_h (w_h * scale) ReLU(q_h . key_n), -inf past
    `visible`. `Indexer.forward` computes the same in torch."""
    B, heads, dim = q.shape
    n = slots.shape[1]
    out = torch.empty(B, n, dtype=torch.float32, device=q.device)
    if B and n:
        q, w, slots, visible = q.contiguous(), w.contiguous(), slots.contiguous(), visible.contiguous()
        _index_scores_kernel[(B, triton.cdiv(n, 64))](
            q, w, keys, slots, visible, out, scale, q.stride(0), q.stride(1), w.stride(0), keys.stride(0),
            slots.stride(0), out.stride(0), n, HEADS=heads, DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(heads)),
            BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=64, UPCAST=envs.triton_interpret(),
            # float32 stays float32 (TF32 would round differently from torch's float32 matmul)
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return out
