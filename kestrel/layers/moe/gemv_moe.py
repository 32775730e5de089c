"""A MoE layer's routed experts for a few tokens (decode), as two Triton GEMV kernels over the (token, slot)
assignments: no sort and no tiles, static shapes (CUDA-graph safe).

At batch 1 the grouped GEMM (fused_moe.py) pads each hit expert's one row to a 16-row tile and builds the
tiles with a sort, searchsorted and scatters per layer. Here each assignment a = token * k + slot is its own
row, and a program reads its expert id from `ids` directly:
- `_up_kernel`, a program per (assignment, BLOCK_N activation columns): x[token] times its expert's w1 and
  w3 rows (plus their biases), the gated activation (config.ExpertActivation: ACT 0 silu, 1 clamped_silu,
  2 gpt_oss), written to the assignment's row of act [T * k, I];
- `_down_kernel`, a program per (assignment, BLOCK_N output columns): act[a] times the expert's w2 rows
  (plus its bias), times the routing weight, written to row a of a float32 [T * k, H] buffer; a token's k
  rows are then summed by a reshape + sum (no atomics: the result does not depend on scheduling).
An assignment to another rank's expert returns at once: its act row is never read and its output row
stays 0. Products are float32 in registers, reduced with tl.sum (exact for fp32 weights: no TF32).
Each hit expert's weights are read once per assignment, so a step reads what it hits (twice where two
tokens share an expert: the grouped GEMM wins once tokens share experts; the benchmark decides where).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.envs import triton_jit
from kestrel.layers.moe.config import ACTIVATIONS, ExpertActivation
from kestrel.layers.moe.fused_moe import expert_shapes, gated_activation


@dataclass(frozen=True)
class GemvConfig:
    """A weight block is BLOCK_N rows by BLOCK_K contiguous columns (bf16: 512 bytes a row at 256), so the
    loads coalesce along the reduction. The default is kestrel/bench/kernels/moe_paths.py's fastest on the
    H100 for Qwen3-30B-A3B at one token (0.046 ms against 0.050 at 32 x 128) and within 4 % of it for
    gpt-oss-20b (docs/benchmarks.md)."""

    block_n: int = 16  # output columns (weight rows) per program
    block_k: int = 256  # reduction step
    num_warps: int = 4


@triton_jit
def _up_kernel(X, Ids, W13, B13, Act, first, count, top_k, d, inter, limit, alpha,
               stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_am,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr):
    assignment = tl.program_id(0)
    expert = tl.load(Ids + assignment).to(tl.int64) - first
    if (expert < 0) | (expert >= count):  # another rank's expert
        return
    token = (assignment // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    w1 = W13 + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    w3 = w1 + inter * stride_wn
    gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, d, BLOCK_K):  # per-lane partial sums; one tl.sum at the end
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < d
        x = tl.load(X + token * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w_mask = n_ok[:, None] & k_ok[None, :]
        gate += tl.load(w1 + offs_k[None, :] * stride_wk, mask=w_mask, other=0.0).to(tl.float32) * x
        up += tl.load(w3 + offs_k[None, :] * stride_wk, mask=w_mask, other=0.0).to(tl.float32) * x
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    if HAS_BIAS:
        bias = B13 + expert * stride_be + offs_n
        g += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)
        u += tl.load(bias + inter, mask=n_ok, other=0.0).to(tl.float32)
    act = gated_activation(g, u, limit, alpha, ACT)
    tl.store(Act + assignment.to(tl.int64) * stride_am + offs_n, act.to(Act.dtype.element_ty), mask=n_ok)


@triton_jit
def _down_kernel(Act, Ids, W2, B2, Weights, Out, first, count, d, inter,
                 stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_om,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    assignment = tl.program_id(0)
    expert = tl.load(Ids + assignment).to(tl.int64) - first
    if (expert < 0) | (expert >= count):  # another rank's expert: its output row stays 0
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < d
    w = W2 + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    act_row = Act + assignment.to(tl.int64) * stride_am
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(act_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(w + offs_k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :],
                       other=0.0).to(tl.float32) * a
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B2 + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    weight = tl.load(Weights + assignment)
    tl.store(Out + assignment.to(tl.int64) * stride_om + offs_n, y * weight, mask=n_ok)


def gemv_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             first: int, activation: ExpertActivation, b13: torch.Tensor | None = None,
             b2: torch.Tensor | None = None, cfg: GemvConfig = GemvConfig()) -> torch.Tensor:
    """[T, d] float32: what fused_moe.fused_moe returns (same arguments), one assignment per program.
    x [T, d]; ids, weights [T, k]; w13 [count, 2I, d] (w1 rows, then w3 rows); w2 [count, d, I];
    b13 [count, 2I] and b2 [count, d] or None (no bias)."""
    T, d = x.shape
    count, inter = expert_shapes(x, w13, w2)
    n = ids.numel()
    if n == 0:
        return torch.zeros(T, d, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    flat_ids = ids.reshape(-1).contiguous()
    flat_weights = weights.reshape(-1).float().contiguous()
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)  # other ranks' rows: never written nor read
    out = torch.zeros(n, d, dtype=torch.float32, device=x.device)
    common = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    # A missing bias passes its weight as a never-read pointer (HAS_BIAS False compiles the loads out).
    b13_arg, b2_arg = (b13 if b13 is not None else w13), (b2 if b2 is not None else w2)
    _up_kernel[(n, triton.cdiv(inter, cfg.block_n))](
        x, flat_ids, w13, b13_arg, act, first, count, ids.shape[1], d, inter, float(activation.limit),
        float(activation.alpha), x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), b13_arg.stride(0),
        act.stride(0), ACT=ACTIVATIONS.index(activation.kind), HAS_BIAS=b13 is not None, **common)
    _down_kernel[(n, triton.cdiv(d, cfg.block_n))](
        act, flat_ids, w2, b2_arg, flat_weights, out, first, count, d, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), b2_arg.stride(0), out.stride(0),
        HAS_BIAS=b2 is not None, **common)
    return out.view(T, ids.shape[1], d).sum(1)
