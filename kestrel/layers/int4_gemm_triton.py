"""W4A16 GEMM in Triton: y[M, N] = x[M, K] @ W^T with W in kestrel's int4 layout (kestrel.quant.int4).

Each program owns BLOCK_M rows x BLOCK_N outputs and one split of K. Per BLOCK_K-wide tile it loads
BLOCK_K/8 int32 words per output (the codes of 8 inputs each), shifts the nibbles out in registers,
subtracts the zero point and multiplies by the scale of each group (BLOCK_K / group_size scale rows, or
one when the tile lies inside a group), and multiplies the float tile with x's: so only the packed
bytes, the group scales and the zero points cross the memory bus. Act-order weights (`perm`) read x's
columns through the permutation that made their groups contiguous.

Two ways to multiply, one kernel (`Int4GemmConfig.dot`):
- tl.dot on tensor cores (the dequantised tile cast to x's dtype, float32 accumulation): prefill, and
  decode with BLOCK_M = 16;
- the GEMV (dot False, M <= GEMV_LIMIT_M): products in float32 registers reduced with tl.sum, no M
  padding to 16; at batch 1 a step only streams the weights.
At one row there are two GEMVs of their own besides (`Int4GemmConfig.nibbles`, `.half2`): passes over
2-D tiles of words, one nibble each in float32, or two at once as fp16x2 on CUDA (the default there).
Small M leaves few tiles, so K is split into float32 partials that a second kernel sums in a fixed order
(kestrel.layers.fp8_gemm_triton.sum_splits): the result does not depend on timing. `default_config`
follows the H100's sweep up to M = 64; every tile size, split, warp count and the GEMV / tl.dot choice are
arguments of `int4_gemm` (`Int4GemmConfig`), so a sweep on another GPU can replace it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel import envs, pdl
from kestrel.envs import triton_jit
from kestrel.layers.fp8_gemm_triton import sm_count, store_tile, sum_splits
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
    block_k: int  # a power of two >= 16, dividing the group size or a multiple of it
    split_k: int = 1
    dot: bool = True  # False: the GEMV (products on CUDA cores)
    # GEMV at one row only (_w4a16_nibble_gemv_kernel): eight passes over a [block_k / 8, block_n] tile of
    # words, one nibble each, with x's matching column loaded per pass, so the codes never form a 3-D tile
    # and no layout conversion is needed; the tile lies inside one group (block_k divides group_size), whose
    # scale multiplies the tile's sums once. The sweep times it as `gemv-nibbles`; default_config's at M = 1.
    # (Two other GEMV variants, the reduction across threads deferred to the end of the K loop and each
    # group's zero point and scale applied to its partial sums, were measured beside it on the H100 and won
    # at no shape: removed.)
    nibbles: bool = False
    # The nibble GEMV with its integer work on pairs (_w4a16_half2_gemv_kernel, CUDA only: inline PTX): one
    # 32-bit AND-OR turns nibbles j and j + 4 of a word into two fp16 values 1024 + code, and the zero point's
    # subtraction and the product with x run as fp16x2 instructions, two weights each. Implies nibbles' tile.
    half2: bool = False
    num_warps: int = 4
    num_stages: int = 3


@triton_jit
def _w4a16_kernel(X, Perm, QW, Z, S, Y, P, Bias, M, N, K, stride_xm, stride_qw, stride_z, stride_s, stride_ym,
                  stride_pk, stride_pm, split_k, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr,
                  ROWS_PER_SCALE: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                  DOT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(tiles, split_k)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, tiles)
    shifts = tl.arange(0, 8) * 4

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in range(lo, hi):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if HAS_PERM:
            cols = tl.load(Perm + offs_k, mask=k_mask, other=0)
        else:
            cols = offs_k
        x = tl.load(X + offs_m[:, None] * stride_xm + cols[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(QW + offs_w[:, None] * stride_qw + offs_n[None, :],
                        mask=(offs_w < K // 8)[:, None] & n_mask[None, :], other=0)
        codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: input 8w + j
        offs_g = k0 // GROUP + tl.arange(0, SCALE_ROWS)
        g_mask = (offs_g < K // GROUP)[:, None] & n_mask[None, :]
        s = tl.load(S + offs_g[:, None] * stride_s + offs_n[None, :], mask=g_mask, other=0.0).to(tl.float32)
        z = tl.load(Z + offs_g[:, None] * stride_z + offs_n[None, :], mask=g_mask, other=0).to(tl.float32)
        # The nibble as the low bits of the float 2^23 + code (exponent bits OR-ed in, read as a float):
        # exact, and no int-to-float conversion, which issues at a fraction of the FP32 rate. Subtracting
        # 2^23 + zero gives code - zero exactly.
        w = (codes | 0x4B000000).to(tl.float32, bitcast=True)
        w = tl.reshape(w, [SCALE_ROWS, ROWS_PER_SCALE, BLOCK_N])
        w = tl.reshape((w - (z[:, None, :] + 8388608.0)) * s[:, None, :], [BLOCK_K, BLOCK_N])
        if DOT:
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(X.dtype.element_ty))
        else:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], 1)
    store_tile(acc, Y, P, Bias, offs_m, offs_n, m_mask, n_mask, split, stride_ym, stride_pk, stride_pm, HAS_BIAS,
               PARTIAL)


@triton_jit
def _one_row_split(K, N, split_k, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """A one-row GEMV program's outputs and its range of K tiles (BLOCK_W words = 8 BLOCK_W inputs each; exact:
    K is a multiple of the group, a multiple of 8 BLOCK_W): (offs_n, n_mask, first tile, end tile)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    per_split = tl.cdiv(K // (8 * BLOCK_W), split_k)
    lo = tl.program_id(1) * per_split
    return offs_n, offs_n < N, lo, tl.minimum(lo + per_split, K // (8 * BLOCK_W))


@triton_jit
def _word_tile(QW, offs_w, offs_n, n_mask, stride_qw, EVEN_N: tl.constexpr):
    if EVEN_N:
        return tl.load(QW + offs_w[:, None] * stride_qw + offs_n[None, :])
    return tl.load(QW + offs_w[:, None] * stride_qw + offs_n[None, :], mask=n_mask[None, :], other=0)


@triton_jit
def _w4a16_nibble_gemv_kernel(X, Perm, QW, Z, S, Y, P, Bias, N, K, stride_qw, stride_z, stride_s, stride_pk,
                              split_k, GROUP: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_N: tl.constexpr,
                              PARTIAL: tl.constexpr, PDL: tl.constexpr):
    # y[n] = sum_k x[k] W[n, k] for one row of x. A tile: BLOCK_W words of each of BLOCK_N outputs (inputs
    # 8 BLOCK_W, inside one group). Pass j takes every word's nibble j with x at input 8 w + j: each thread's
    # products stay in its own registers, summed across threads once after the K loop.
    pdl.sync(PDL)
    offs_n, n_mask, lo, hi = _one_row_split(K, N, split_k, BLOCK_N, BLOCK_W)
    rows = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
    for t in range(lo, hi):
        offs_w = t * BLOCK_W + rows
        words = _word_tile(QW, offs_w, offs_n, n_mask, stride_qw, EVEN_N)
        g = t * 8 * BLOCK_W // GROUP
        s = tl.load(S + g * stride_s + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        # 2^23 + zero: the codes below become floats 2^23 + code (see _w4a16_kernel), so code - zero is exact.
        zb = tl.load(Z + g * stride_z + offs_n, mask=n_mask, other=0).to(tl.float32) + 8388608.0
        part = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
        for j in tl.static_range(8):
            if HAS_PERM:
                cols = tl.load(Perm + offs_w * 8 + j)
            else:
                cols = offs_w * 8 + j
            xj = tl.load(X + cols).to(tl.float32)
            code = ((words >> (4 * j)) & 0xF) | 0x4B000000
            part += xj[:, None] * (code.to(tl.float32, bitcast=True) - zb[None, :])
        acc += part * s[None, :]
    offs_m = tl.arange(0, 1)
    store_tile(tl.sum(acc, 0)[None, :], Y, P, Bias, offs_m, offs_n, offs_m < 1, n_mask, tl.program_id(1), 0,
               stride_pk, 0, HAS_BIAS, PARTIAL)


@triton_jit
def _f16x2(lo, hi):
    """Two float32 tensors -> one int32 tensor holding (lo, hi) as fp16x2 (lo in the low half)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton_jit
def _pair_fma(words, x2, zero2, acc):
    """acc + (codes - zero) * x as fp16x2, the codes being bits 0-3 and 16-19 of `words`: OR-ed into the
    mantissa of 1024.0 (0x6400) they are the fp16 values 1024 + code, exact; zero2 holds 1024 + zero twice."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 q; lop3.b32 q, $1, 0x000f000f, 0x64006400, 0xea; sub.f16x2 q, q, $3; "
        "fma.rn.f16x2 $0, q, $2, $4; }", "=r,r,r,r,r", [words, x2, zero2, acc], dtype=tl.int32, is_pure=True,
        pack=1)


@triton_jit
def _f32_pair(h2):
    """fp16x2 in an int32 tensor -> its (low, high) halves as float32 tensors."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 a, b; mov.b32 {a, b}, $2; cvt.f32.f16 $0, a; cvt.f32.f16 $1, b; }", "=f,=f,r", [h2],
        dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton_jit
def _w4a16_half2_gemv_kernel(X, Perm, QW, Z, S, Y, P, Bias, N, K, stride_qw, stride_z, stride_s, stride_pk,
                             split_k, GROUP: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_N: tl.constexpr,
                             PARTIAL: tl.constexpr, PDL: tl.constexpr):
    # The nibble GEMV's tiles and passes, with two nibbles per pass (j and j + 4, the low and high halves of
    # one fp16x2). fp16 holds x after it is divided by its largest magnitude over this program's inputs, so
    # a pass's products (|code - zero| <= 15) and a tile's four-term sums stay far inside fp16's range; each
    # tile's sums leave fp16 for float32 with the group's scale, and the program's total is multiplied back.
    offs_n, n_mask, lo, hi = _one_row_split(K, N, split_k, BLOCK_N, BLOCK_W)
    pdl.sync(PDL)
    inputs = tl.arange(0, 8 * BLOCK_W)
    big = tl.zeros([8 * BLOCK_W], tl.float32)
    for t in range(lo, hi):
        if HAS_PERM:
            cols = tl.load(Perm + t * 8 * BLOCK_W + inputs)
        else:
            cols = t * 8 * BLOCK_W + inputs
        big = tl.maximum(big, tl.abs(tl.load(X + cols).to(tl.float32)))
    x_max = tl.max(big, 0)
    x_max = tl.where(x_max > 0.0, x_max, 1.0)
    inv = 1.0 / x_max
    rows = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_W, BLOCK_N], tl.float32)
    for t in range(lo, hi):
        offs_w = t * BLOCK_W + rows
        words = _word_tile(QW, offs_w, offs_n, n_mask, stride_qw, EVEN_N)
        g = t * 8 * BLOCK_W // GROUP
        s = tl.load(S + g * stride_s + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(Z + g * stride_z + offs_n, mask=n_mask, other=0).to(tl.float32) + 1024.0
        zero2 = _f16x2(z, z)
        h = tl.zeros([BLOCK_W, BLOCK_N], tl.int32)  # fp16x2 (+0, +0)
        for j in tl.static_range(4):
            if HAS_PERM:
                c_lo = tl.load(Perm + offs_w * 8 + j)
                c_hi = tl.load(Perm + offs_w * 8 + j + 4)
            else:
                c_lo = offs_w * 8 + j
                c_hi = c_lo + 4
            x2 = _f16x2(tl.load(X + c_lo).to(tl.float32) * inv, tl.load(X + c_hi).to(tl.float32) * inv)
            h = _pair_fma(words >> (4 * j), tl.broadcast_to(x2[:, None], (BLOCK_W, BLOCK_N)),
                          tl.broadcast_to(zero2[None, :], (BLOCK_W, BLOCK_N)), h)
        h_lo, h_hi = _f32_pair(h)
        acc += (h_lo + h_hi) * s[None, :]
    offs_m = tl.arange(0, 1)
    store_tile((tl.sum(acc, 0) * x_max)[None, :], Y, P, Bias, offs_m, offs_n, offs_m < 1, n_mask,
               tl.program_id(1), 0, stride_pk, 0, HAS_BIAS, PARTIAL)


# Per M range: (block_m, block_n, block_k, tl.dot, programs to aim for per SM). From the config sweep at
# Llama-3.1-8B's four projection shapes on the H100 (kestrel/bench/kernels/int4_gemm.py, docs/benchmarks.md):
# the fastest or within 3 % of it at every shape, K split up to 8 ways (the sweep's largest).
TILES = ((1, (1, 64, 128, False, 16)), (16, (16, 128, 128, True, 8)), (64, (64, 128, 128, True, 1)))
MAX_SPLIT = 8
# At M = 1, the nibble-pass GEMV (Int4GemmConfig.nibbles) instead of TILES' GEMV when set: (block_n, block_k
# at most, programs per SM to aim for). The H100's sweep (docs/benchmarks.md): 64 x 128 with K split 8 ways was
# the fastest config at all four of Llama-3.1-8B's shapes, the projections' sum 2.85 ms against 3.43 ms for
# the best of the other GEMVs; a batch-1 step 3.92 -> 3.67 ms with 128 x 128 tiles.
NIBBLE_TILE: tuple[int, int, int] | None = (64, 128, 16)
# On CUDA, NIBBLE_TILE's GEMV with its integer work on pairs (Int4GemmConfig.half2). On the H100 it was the
# fastest at all four of Llama-3.1-8B's shapes (gate_up 0.0335 against 0.0393 ms) and a batch-1 step of
# llama-3.1-8b-awq took 3.31 ms against 3.48 (one process each; docs/benchmarks.md).
HALF2 = True


def default_config(m: int, n: int, k: int, device: torch.device, group_size: int = 128) -> Int4GemmConfig:
    """The measured tiles of TILES for M (the GEMV up to GEMV_MAX_M rows), K split until the programs
    reach the aim or a split would hold fewer than 4 K tiles; past M = 64, unmeasured large tiles."""
    if m == 1 and NIBBLE_TILE is not None:
        block_n, block_k, per_sm = NIBBLE_TILE
        block_k = min(block_k, group_size)
        split = _split(triton.cdiv(n, block_n), triton.cdiv(k, block_k), per_sm, device)
        half2 = HALF2 and device.type == "cuda"
        return Int4GemmConfig(1, block_n, block_k, split, dot=False, nibbles=not half2, half2=half2)
    for top, (block_m, block_n, block_k, dot, per_sm) in TILES:
        if m <= top and (dot or m <= GEMV_MAX_M):
            break
    else:
        block_m, block_n, block_k, dot, per_sm = 128, 128, 64, True, 2
    if not dot:
        block_m = triton.next_power_of_2(max(m, 1))
    split = _split(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, block_k), per_sm, device)
    return Int4GemmConfig(block_m, block_n, block_k, split, dot, num_warps=4 if m <= 64 else 8)


def _split(tiles: int, k_tiles: int, per_sm: int, device: torch.device) -> int:
    """K split in powers of two until the programs reach per_sm per SM or a split would hold < 4 K tiles."""
    split = 1
    while split < MAX_SPLIT and tiles * split < per_sm * sm_count(device) and k_tiles >= 8 * split:
        split *= 2
    return split


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
    cfg = config or default_config(m, n, k, x.device, group_size)
    bk = cfg.block_k
    if bk & (bk - 1) or bk < 16 or (bk % group_size and group_size % bk):
        raise ValueError(f"block_k must be a power of two >= 16 that divides group_size {group_size} or is a "
                         f"multiple of it, got {bk}")
    if cfg.dot and cfg.block_m < 16:
        raise ValueError(f"the tl.dot path needs block_m >= 16, got {cfg.block_m}")
    if (cfg.nibbles or cfg.half2) and (cfg.dot or m != 1 or group_size % bk):
        raise ValueError(f"nibbles and half2 are GEMVs of their own at one row (dot off, M = 1) whose block_k "
                         f"divides group_size {group_size}; got {cfg} at M = {m}")
    if cfg.half2 and (not x.is_cuda or envs.triton_interpret()):
        raise ValueError("half2 runs inline PTX: CUDA only (not the CPU or Triton's interpreter)")
    if not cfg.dot and m > GEMV_LIMIT_M:
        raise ValueError(f"the GEMV takes at most {GEMV_LIMIT_M} rows of x (got {m})")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    partial = y if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    if cfg.nibbles or cfg.half2:
        kernel = _w4a16_half2_gemv_kernel if cfg.half2 else _w4a16_nibble_gemv_kernel
        kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
            x, perm if perm is not None else qweight, qweight, zeros, scales, y, partial,
            bias if bias is not None else y, n, k, qweight.stride(0), zeros.stride(0), scales.stride(0),
            partial.stride(0), cfg.split_k, GROUP=group_size, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
            BLOCK_N=cfg.block_n, BLOCK_W=bk // PACK, EVEN_N=n % cfg.block_n == 0, PARTIAL=cfg.split_k > 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device))
        if cfg.split_k > 1:
            sum_splits(partial, y, bias, cfg.split_k)
        return y
    block_m = cfg.block_m if cfg.dot else triton.next_power_of_2(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _w4a16_kernel[grid](
        x, perm if perm is not None else qweight, qweight, zeros, scales, y, partial,
        bias if bias is not None else y, m, n, k, x.stride(0), qweight.stride(0), zeros.stride(0),
        scales.stride(0), y.stride(0), partial.stride(0), partial.stride(1) if cfg.split_k > 1 else 0,
        cfg.split_k, GROUP=group_size, SCALE_ROWS=max(1, bk // group_size), ROWS_PER_SCALE=min(bk, group_size),
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=bk, PARTIAL=cfg.split_k > 1, DOT=cfg.dot, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device))
    if cfg.split_k > 1:
        sum_splits(partial, y, bias, cfg.split_k)
    return y
