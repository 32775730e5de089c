"""A MoE layer's routed experts for a few tokens (decode), as two Triton GEMV kernels over the (token, slot)
assignments: no sort and no tiles, static shapes (CUDA-graph safe).

At batch 1 the grouped GEMM (fused_moe.py) pads each hit expert's one row to a 16-row tile and builds the
tiles with a sort, searchsorted and scatters per layer. Here each assignment a = token * k + slot is its own
row, and a program reads its expert id from `ids` directly:
- `_up_kernel`, a program per (assignment, BLOCK_N activation columns): x[token] times its expert's w1 and
  w3 rows (plus their biases), the gated activation (config.ExpertActivation: ACT 0 silu, 1 clamped_silu,
  2 gpt_oss), written to the assignment's row of act [T * k, I];
- `_down_kernel`, a program per (assignment, BLOCK_N output columns): act[a] times the expert's w2 rows
  (plus its bias), times the routing weight, written to row a of a float32 [T * k, H] buffer (`gemv_rows`);
  `gemv_moe` then sums a token's k rows by a reshape + sum (no atomics: the result does not depend on
  scheduling);
- `_combine_kernel` (`combine_rows`, the fused decode route's last launch: layer.py), a program per (token,
  BLOCK_N columns): the same sum of the token's k rows, in slot order, plus the shared expert's output
  (scaled by the sigmoid of its gate) in float32, stored once in the layer's output dtype: it replaces the
  zeros, the sum, the add and the cast that surround `gemv_moe` on the "gemv" path.
An assignment to another rank's expert returns at once: its act row is never read and its output row is
not written (`gemv_moe` zeroes the buffer first; the combine kernel skips the row by its id). Products are
float32 in registers, reduced with tl.sum (exact for fp32 weights: no TF32). Each hit expert's weights are
read once per assignment, so a step reads what it hits (twice where two tokens share an expert: the grouped
GEMM wins once tokens share experts; the benchmark decides where).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel import pdl
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


# The down GEMV's config where it differs from the up GEMV's (None: the same). Its reduction is the
# intermediate width (768 for Qwen3-30B-A3B, 2880 for gpt-oss-20b), the up GEMV's the hidden one: fewer,
# longer steps per program. kestrel/bench/kernels/moe_paths.py sweeps it (`DOWN_SWEEP`); on the H100 at one
# token the whole GEMV path took 0.0418 / 0.0907 ms with it against 0.0455 / 0.0939 with the up GEMV's
# config (Qwen3-30B-A3B / gpt-oss-20b, docs/benchmarks.md). A module constant so that a benchmark can set it
# in its process before the model runs.
DOWN_CONFIG: GemvConfig | None = GemvConfig(block_n=8, block_k=1024, num_warps=4)


@triton_jit
def _up_kernel(X, Ids, W13, B13, Act, first, count, top_k, d, inter, limit, alpha,
               stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_am,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
               PDL: tl.constexpr):
    pdl.sync(PDL)
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
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
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
             b2: torch.Tensor | None = None, cfg: GemvConfig = GemvConfig(),
             down_cfg: GemvConfig | None = None) -> torch.Tensor:
    """[T, d] float32: what fused_moe.fused_moe returns (same arguments), one assignment per program.
    x [T, d]; ids, weights [T, k]; w13 [count, 2I, d] (w1 rows, then w3 rows); w2 [count, d, I];
    b13 [count, 2I] and b2 [count, d] or None (no bias)."""
    T, d = x.shape
    rows = torch.zeros(ids.numel(), d, dtype=torch.float32, device=x.device)  # other ranks' rows stay 0
    gemv_rows(x, ids, weights, w13, w2, first, activation, b13, b2, rows, cfg, down_cfg)
    return rows.view(T, ids.shape[1], d).sum(1)


def gemv_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              first: int, activation: ExpertActivation, b13: torch.Tensor | None, b2: torch.Tensor | None,
              rows: torch.Tensor, cfg: GemvConfig = GemvConfig(), down_cfg: GemvConfig | None = None) -> None:
    """rows [T * k, d] float32, row token * k + slot = that assignment's expert output times its routing
    weight; the rows of other ranks' experts are not written. Arguments as `gemv_moe`; down_cfg: the down
    GEMV's config (None: DOWN_CONFIG, else cfg)."""
    down = down_cfg or DOWN_CONFIG or cfg
    d = x.shape[1]
    count, inter = expert_shapes(x, w13, w2)
    n = ids.numel()
    if n == 0:
        return
    x = x.contiguous()
    flat_ids = ids.reshape(-1).contiguous()
    flat_weights = weights.reshape(-1).float().contiguous()
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)  # other ranks' rows: never written nor read
    # A missing bias passes its weight as a never-read pointer (HAS_BIAS False compiles the loads out).
    b13_arg, b2_arg = (b13 if b13 is not None else w13), (b2 if b2 is not None else w2)
    _up_kernel[(n, triton.cdiv(inter, cfg.block_n))](
        x, flat_ids, w13, b13_arg, act, first, count, ids.shape[1], d, inter, float(activation.limit),
        float(activation.alpha), x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), b13_arg.stride(0),
        act.stride(0), ACT=ACTIVATIONS.index(activation.kind), HAS_BIAS=b13 is not None, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **pdl.launch_options(x.device))
    _down_kernel[(n, triton.cdiv(d, down.block_n))](
        act, flat_ids, w2, b2_arg, flat_weights, rows, first, count, d, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), b2_arg.stride(0), rows.stride(0),
        HAS_BIAS=b2 is not None, BLOCK_N=down.block_n, BLOCK_K=down.block_k, num_warps=down.num_warps,
        **pdl.launch_options(x.device))


@triton_jit
def _combine_kernel(Rows, Ids, Shared, Gate, Out, first, count, d, stride_rm, stride_st, stride_gt, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr,
                    PDL: tl.constexpr):
    pdl.sync(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < d
    routed = tl.zeros([BLOCK_N], tl.float32)
    for slot in tl.static_range(TOP_K):
        assignment = token * TOP_K + slot
        expert = tl.load(Ids + assignment) - first
        # Another rank's row was never written: read none of its columns.
        cols = tl.where((expert >= 0) & (expert < count), d, 0)
        routed += tl.load(Rows + assignment * stride_rm + offs_n, mask=offs_n < cols, other=0.0)
    if HAS_SHARED:
        shared = tl.load(Shared + token * stride_st + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_GATE:
            shared = shared * tl.sigmoid(tl.load(Gate + token * stride_gt).to(tl.float32))
        routed = shared + routed
    tl.store(Out + token * stride_ot + offs_n, routed.to(Out.dtype.element_ty), mask=n_ok)


def combine_rows(rows: torch.Tensor, ids: torch.Tensor, first: int, count: int, out: torch.Tensor,
                 shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                 block_n: int = 256) -> None:
    """out [T, d] (any float dtype) = shared * sigmoid(shared_gate) + the sum of a token's k rows of `rows`
    [T * k, d] float32 (`gemv_rows`), in float32, cast once at the store; a row whose expert (ids [T, k],
    global) is not this rank's (`first` .. `first + count - 1`) adds 0. shared [T, d] or None;
    shared_gate [T, 1] (the logit of the shared expert's gate) or None."""
    T, d = out.shape
    if T == 0:
        return
    ids = ids.contiguous()
    shared_arg = shared if shared is not None else rows
    gate_arg = shared_gate if shared_gate is not None else rows
    _combine_kernel[(T, triton.cdiv(d, block_n))](
        rows, ids, shared_arg, gate_arg, out, first, count, d, rows.stride(0), shared_arg.stride(0),
        gate_arg.stride(0), out.stride(0), TOP_K=ids.shape[1], BLOCK_N=block_n, HAS_SHARED=shared is not None,
        HAS_GATE=shared_gate is not None, num_warps=4, **pdl.launch_options(out.device))
