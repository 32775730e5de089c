"""W4A16 GEMM in Triton: y[M, N] = x[M, K] @ W^T with W in kestrel's int4 layout (kestrel.quant.int4).

Each program owns BLOCK_M rows x BLOCK_N outputs and one split of K. Per BLOCK_K-wide tile it loads
BLOCK_K/8 int32 words per output (the codes of 8 inputs each) and the group scales and zero points of
those inputs; nibble j of every word is shifted out, dequantised in registers and multiplied with the x
columns 8i + j it stands for, eight slices per tile, so the codes are never interleaved back into input
order and only the packed bytes, scales and zero points cross the memory bus. Act-order weights
(`perm`) read x's columns through the permutation that made their groups contiguous.

Two ways to multiply, one kernel (`Int4GemmConfig.dot`):
- tl.dot on tensor cores (the dequantised tile cast to x's dtype, float32 accumulation): prefill, and
  decode with BLOCK_M = 16;
- the GEMV (dot False, M <= GEMV_LIMIT_M): products summed per lane in float32 registers and reduced
  over K once at the end, no M padding to 16; at batch 1 a step only streams the weights.
Small M leaves few tiles, so K is split into float32 partials that a second kernel sums in a fixed order
(kestrel.layers.fp8_gemm_triton.sum_splits): the result does not depend on timing. `default_config` is
a first guess for the H100/H200, unmeasured: every tile size, split, warp count and the GEMV / tl.dot
choice are arguments of `int4_gemm` (`Int4GemmConfig`), so a sweep on the GPU replaces it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.envs import triton_jit
from kestrel.layers.fp8_gemm_triton import _sms, store_tile, sum_splits
from kestrel.quant.int4 import PACK

# The largest M the GEMV takes: past it each weight costs more float32 FMAs than CUDA cores issue at
# the memory's bandwidth (as for the FP8 GEMV).
GEMV_LIMIT_M = 8
# default_config gives the GEMV M <= GEMV_MAX_M; a guess until measured on the GPU.
GEMV_MAX_M = 1


@dataclass(frozen=True)
class Int4GemmConfig:
    block_m: int  # tl.dot: >= 16
    block_n: int
    block_k: int  # a power of two (>= 128 for tl.dot, >= 16 else), dividing the group size or a multiple of it
    split_k: int = 1
    dot: bool = True  # False: the GEMV (products on CUDA cores)
    num_warps: int = 4
    num_stages: int = 3


@triton_jit
def _w4a16_kernel(X, Perm, QW, Z, S, Y, P, Bias, M, N, K, stride_xm, stride_qw, stride_z, stride_s, stride_ym,
                  stride_pk, stride_pm, split_k, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr,
                  HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, WORDS)
    m_mask = offs_m < M
    n_mask = offs_n < N
    tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(tiles, split_k)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, tiles)

    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:  # per-lane partial sums, one reduction over K after the loop
        acc3 = tl.zeros([BLOCK_M, WORDS, BLOCK_N], tl.float32)
    for t in range(lo, hi):
        k0 = t * BLOCK_K
        w_ok = (k0 // 8 + offs_i) < K // 8
        words = tl.load(QW + (k0 // 8 + offs_i)[:, None] * stride_qw + offs_n[None, :],
                        mask=w_ok[:, None] & n_mask[None, :], other=0)
        # The group of input 8 * (k0 / 8 + i) + j for every j: one row per tile when it lies in one group.
        if SCALE_ROWS == 1:
            g_rows = k0 // GROUP + tl.zeros([1], tl.int32)
        else:
            g_rows = (k0 + 8 * offs_i) // GROUP
        g_mask = (g_rows < K // GROUP)[:, None] & n_mask[None, :]
        s = tl.load(S + g_rows[:, None] * stride_s + offs_n[None, :], mask=g_mask, other=0.0).to(tl.float32)
        z = tl.load(Z + g_rows[:, None] * stride_z + offs_n[None, :], mask=g_mask, other=0).to(tl.float32)
        z = z + 8388608.0
        # Nibble j of word i is input k0 + 8i + j: the tile is eight [WORDS, BLOCK_N] slices, each multiplied
        # with the x columns it stands for, so the codes are never interleaved back into one [BLOCK_K, N]
        # tile (a register shuffle through shared memory). A nibble becomes a float by OR-ing it into the
        # low bits of 2^23 (exact, no int-to-float conversion, which issues at a fraction of the FP32 rate);
        # subtracting 2^23 + zero leaves code - zero exactly.
        for j in tl.static_range(8):
            cols = k0 + 8 * offs_i + j
            if HAS_PERM:
                cols = tl.load(Perm + cols, mask=w_ok, other=0)
            x = tl.load(X + offs_m[:, None] * stride_xm + cols[None, :], mask=m_mask[:, None] & w_ok[None, :],
                        other=0.0)
            w = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            w = (w - z) * s
            if DOT:
                if IEEE:
                    acc += tl.dot(x, w, input_precision="ieee")
                else:
                    acc += tl.dot(x, w.to(X.dtype.element_ty))
            else:
                acc3 += x.to(tl.float32)[:, :, None] * w[None, :, :]
    if not DOT:
        acc = tl.sum(acc3, 1)
    store_tile(acc, Y, P, Bias, offs_m, offs_n, m_mask, n_mask, split, stride_ym, stride_pk, stride_pm, HAS_BIAS,
               PARTIAL)


def default_config(m: int, n: int, k: int, device: torch.device) -> Int4GemmConfig:
    """The GEMV up to GEMV_MAX_M rows, tl.dot above; K split until the tiles reach twice the SMs
    (keeping >= 4 K tiles per split). A first guess, to be replaced by the H100's measurements."""
    if m <= GEMV_MAX_M:
        block_m, block_n, block_k, dot = triton.next_power_of_2(max(m, 1)), 32, 128, False
    elif m <= 16:
        block_m, block_n, block_k, dot = 16, 64, 128, True
    elif m <= 64:
        block_m, block_n, block_k, dot = 64, 64, 128, True
    else:
        block_m, block_n, block_k, dot = 128, 128, 128, True
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 2 * _sms(device) and k_tiles >= 8 * split:
        split *= 2
    return Int4GemmConfig(block_m, block_n, block_k, split, dot, num_warps=4 if m <= 64 else 8)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
              config: Int4GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (float) @ W^T (+ bias) -> [M, N] in x's dtype, W given as kestrel.quant.int4.Int4Weight's
    tensors: qweight int32 [K/8, N], zeros uint8 [K/g, N], scales [K/g, N], perm int32 [K] or None."""
    m, k = x.shape
    n = scales.shape[1]
    if qweight.shape != (k // PACK, n) or k % group_size:
        raise ValueError(f"int4_gemm: x {tuple(x.shape)} does not fit qweight {tuple(qweight.shape)} with "
                         f"group_size {group_size}")
    if x.stride(1) != 1 or qweight.stride(1) != 1:
        raise ValueError("int4_gemm needs row-major x and qweight (inner stride 1)")
    cfg = config or default_config(m, n, k, x.device)
    bk = cfg.block_k
    least = 128 if cfg.dot else 16  # tl.dot multiplies BLOCK_K / 8 inputs at a time: at least 16
    if bk & (bk - 1) or bk < least or (bk % group_size and group_size % bk):
        raise ValueError(f"block_k must be a power of two >= {least} that divides group_size {group_size} or is "
                         f"a multiple of it, got {bk}")
    if cfg.dot and cfg.block_m < 16:
        raise ValueError(f"the tl.dot path needs block_m >= 16, got {cfg.block_m}")
    if not cfg.dot and m > GEMV_LIMIT_M:
        raise ValueError(f"the GEMV takes at most {GEMV_LIMIT_M} rows of x (got {m})")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    partial = y if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    block_m = cfg.block_m if cfg.dot else triton.next_power_of_2(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _w4a16_kernel[grid](
        x, perm if perm is not None else qweight, qweight, zeros, scales, y, partial,
        bias if bias is not None else y, m, n, k, x.stride(0), qweight.stride(0), zeros.stride(0),
        scales.stride(0), y.stride(0), partial.stride(0), partial.stride(1) if cfg.split_k > 1 else 0,
        cfg.split_k, GROUP=group_size, SCALE_ROWS=max(1, bk // group_size), HAS_PERM=perm is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=bk, PARTIAL=cfg.split_k > 1, DOT=cfg.dot, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        sum_splits(partial, y, bias, cfg.split_k)
    return y
