"""A MoE layer's routed experts as one grouped GEMM per projection, in Triton, with static shapes (CUDA-graph
safe).

The T x k (token, slot) assignments of this rank's experts are sorted by local expert and each expert's
rows padded to a multiple of the tile height BLOCK_M, so every tile of rows belongs to one expert
(`align_assignments`, torch ops with no host read). Then two kernels over the tiles:
- `_up_kernel`: a tile's tokens (gathered from x) times its expert's w1 and w3 rows (plus their biases),
  the gated activation (config.ExpertActivation: ACT 0 silu, 1 clamped_silu, 2 gpt_oss), written as the
  tile's activation rows [padded rows, I];
- `_down_kernel`: a tile's activations times its expert's w2 (plus its bias), times each row's routing
  weight, written to
  the row's assignment (token * k + slot) of a float32 [T * k, d] buffer; a token's k rows are then summed
  by a reshape + sum. No atomics: the result does not depend on scheduling.
An expert's weights are read once per tile of its rows, so a step reads the experts it hits, not all of
them. The grids have a static upper bound of tiles (`max_tiles`: at most ceil(T k / BLOCK_M) + count); tiles
past the used ones (tile expert -1) return at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel import envs
from kestrel.envs import triton_jit
from kestrel.layers.moe.config import ACTIVATIONS, ExpertActivation


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int  # a tile's rows (assignments of one expert); tl.dot needs >= 16
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int = 4
    num_stages: int = 3


def default_config(assignments: int, count: int) -> MoeTileConfig:
    """Untuned (kestrel/bench/kernels/dsv4_moe.py measures it): the tile height follows the mean rows per local
    expert, so a decode step (a few rows per expert) pads each hit expert to 16 rows, not 64, and a
    prefill chunk gets taller tiles that reuse each weight tile over more rows."""
    rows_per_expert = assignments / count
    if rows_per_expert <= 16:
        return MoeTileConfig(block_m=16, block_n=64, block_k=128)
    if rows_per_expert <= 64:
        return MoeTileConfig(block_m=32, block_n=64, block_k=64)
    return MoeTileConfig(block_m=64, block_n=128, block_k=64, num_warps=8)


@dataclass(frozen=True)
class ExpertTiles:
    """`rows` [tiles * block_m]: each padded row's assignment index (token * k + slot), or T * k for a
    padding row; `tile_expert` [tiles]: the local expert of each tile's rows, -1 for an unused tile.
    tiles = max_tiles(T * k, count, block_m) whatever the routing."""

    rows: torch.Tensor
    tile_expert: torch.Tensor
    block_m: int


def max_tiles(assignments: int, count: int, block_m: int) -> int:
    """The most tiles any routing needs: m experts with rows take m + sum((c_e - 1) // block_m) <=
    m + (assignments - m) // block_m tiles, largest at m = min(count, assignments) (one row each, the rest
    in one expert reaches it). At most ceil(assignments / block_m) + count, and far fewer where it matters:
    a decode step of 6 assignments over 256 experts needs 6 tiles, not 257 programs that do nothing."""
    hit = min(count, assignments)
    return hit + (assignments - hit) // block_m


def align_assignments(ids: torch.Tensor, first: int, count: int, block_m: int) -> ExpertTiles:
    """Sort the assignments of ids [T, k] (global expert ids) that fall in this rank's experts `first` ..
    `first + count - 1` by local expert, each expert's rows padded to a multiple of block_m; the others
    are dropped. Static shapes and no host read: a CUDA graph can capture it."""
    n = ids.numel()
    device = ids.device
    local = ids.reshape(-1) - first
    key = torch.where((local >= 0) & (local < count), local, count)  # count: another rank's expert
    sorted_key, order = key.sort(stable=True)
    # starts[e]: the first sorted position of expert e (starts[count]: where the others begin).
    starts = torch.searchsorted(sorted_key, torch.arange(count + 1, device=device, dtype=sorted_key.dtype))
    tiles_per_expert = (starts.diff() + block_m - 1) // block_m
    tile_start = torch.zeros(count + 1, dtype=torch.int64, device=device)
    tile_start[1:] = tiles_per_expert.cumsum(0)
    tiles = max_tiles(n, count, block_m)
    padded = tiles * block_m
    # A sorted assignment's padded row: its expert's first row + its place among the expert's rows; the
    # others go to one extra row that is cut off.
    expert = sorted_key.clamp(max=count - 1)
    place = torch.arange(n, device=device) - starts[expert]
    dest = torch.where(sorted_key < count, tile_start[expert] * block_m + place, padded)
    rows = torch.full((padded + 1,), n, dtype=torch.int64, device=device)
    rows.scatter_(0, dest, order)
    tile_expert = torch.searchsorted(tile_start[1:], torch.arange(tiles, device=device), right=True)
    tile_expert = tile_expert.masked_fill(tile_expert >= count, -1)
    return ExpertTiles(rows[:padded], tile_expert, block_m)


@triton_jit
def gated_activation(gate, up, limit, alpha, ACT: tl.constexpr):
    """activation.gated in registers (float32): ACT indexes config.ACTIVATIONS (0 silu, 1 clamped_silu,
    2 gpt_oss)."""
    if ACT == 0:  # silu
        act = gate / (1.0 + tl.exp(-gate)) * up
    elif ACT == 1:  # clamped_silu
        gate = tl.minimum(gate, limit)
        act = gate / (1.0 + tl.exp(-gate)) * tl.minimum(tl.maximum(up, -limit), limit)
    else:  # gpt_oss
        gate = tl.minimum(gate, limit)
        act = (tl.minimum(tl.maximum(up, -limit), limit) + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    return act


@triton_jit
def _up_kernel(X, W13, B13, Rows, TileExpert, Act, n_assign, top_k, d, inter, limit, alpha,
               stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_am,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
               IEEE: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(TileExpert + tile).to(tl.int64)
    if expert < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(Rows + offs_m)
    row_ok = assignment < n_assign
    token = (assignment // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    w1 = W13 + expert * stride_we + offs_n[None, :] * stride_wn
    w3 = w1 + inter * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, d, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < d
        x = tl.load(X + token[:, None] * stride_xt + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        a = tl.load(w1 + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        b = tl.load(w3 + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if UPCAST:  # the interpreter's bf16 is wrong: compute in float32
            x, a, b = x.to(tl.float32), a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            gate += tl.dot(x, a, input_precision="ieee")
            up += tl.dot(x, b, input_precision="ieee")
        else:
            gate += tl.dot(x, a)
            up += tl.dot(x, b)
    if HAS_BIAS:
        bias = B13 + expert * stride_be + offs_n
        gate += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    act = gated_activation(gate, up, limit, alpha, ACT)
    out = Act + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(out, act.to(Act.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton_jit
def _down_kernel(Act, W2, B2, Rows, TileExpert, Weights, Out, n_assign, d, inter,
                 stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 IEEE: tl.constexpr, HAS_BIAS: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(TileExpert + tile).to(tl.int64)
    if expert < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(Rows + offs_m)
    row_ok = assignment < n_assign
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < d
    w = W2 + expert * stride_we + offs_n[None, :] * stride_wn
    act_rows = Act + offs_m[:, None].to(tl.int64) * stride_am
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(act_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + offs_k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(B2 + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(Weights + assignment, mask=row_ok, other=0.0)
    out = Out + assignment[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc * weight[:, None], mask=row_ok[:, None] & n_ok[None, :])


def expert_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int]:
    """(experts, intermediate width) of stacked weights w13 [count, 2I, d] and w2 [count, d, I] for x [T, d];
    ValueError if they do not fit together."""
    d = x.shape[1]
    count, inter = w2.shape[0], w2.shape[2]
    if w13.shape != (count, 2 * inter, d):
        raise ValueError(f"w13 {tuple(w13.shape)} does not match w2 {tuple(w2.shape)} and x {tuple(x.shape)}: "
                         f"expected ({count}, {2 * inter}, {d})")
    return count, inter


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              first: int, activation: ExpertActivation, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, cfg: MoeTileConfig | None = None) -> torch.Tensor:
    """[T, d] float32: sum over each token's k routed experts that this rank holds (global ids `first` ..
    `first + count - 1`) of weight x (W2 act(W1 x + b1, W3 x + b3) + b2), act the gated `activation`.
    x [T, d]; ids, weights [T, k]; w13 [count, 2I, d] (w1 rows, then w3 rows); w2 [count, d, I];
    b13 [count, 2I] and b2 [count, d] or None (no bias)."""
    T, d = x.shape
    count, inter = expert_shapes(x, w13, w2)
    n = ids.numel()
    if n == 0:
        return torch.zeros(T, d, dtype=torch.float32, device=x.device)
    cfg = cfg or default_config(n, count)
    tiles = align_assignments(ids, first, count, cfg.block_m)
    num_tiles = tiles.tile_expert.shape[0]
    x = x.contiguous()
    act = torch.empty(num_tiles * cfg.block_m, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(n, d, dtype=torch.float32, device=x.device)  # other ranks' assignments stay 0
    flat_weights = weights.reshape(-1).float().contiguous()
    upcast = envs.triton_interpret()
    ieee = upcast or x.dtype == torch.float32  # fp32 weights mean an exact product, not TF32
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=upcast, IEEE=ieee,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # A missing bias passes its weight as a never-read pointer (HAS_BIAS False compiles the loads out).
    b13_arg, b2_arg = (b13 if b13 is not None else w13), (b2 if b2 is not None else w2)
    _up_kernel[(num_tiles, triton.cdiv(inter, cfg.block_n))](
        x, w13, b13_arg, tiles.rows, tiles.tile_expert, act, n, ids.shape[1], d, inter, float(activation.limit),
        float(activation.alpha), x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), b13_arg.stride(0),
        act.stride(0), ACT=ACTIVATIONS.index(activation.kind), HAS_BIAS=b13 is not None, **common)
    _down_kernel[(num_tiles, triton.cdiv(d, cfg.block_n))](
        act, w2, b2_arg, tiles.rows, tiles.tile_expert, flat_weights, out, n, d, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), b2_arg.stride(0), out.stride(0),
        HAS_BIAS=b2 is not None, **common)
    return out.view(T, ids.shape[1], d).sum(1)
