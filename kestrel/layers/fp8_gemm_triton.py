"""FP8 GEMM with 128 x 128 block-scaled weights and per-token activation groups, in Triton.

y[M, N] = x[M, K] @ dequant(w)[N, K]^T: every 128-wide slice of the reduction has one activation scale
per token (x's group amax / 448, quantized on the fly) and one weight scale per 128 output rows, so a
program multiplies each block's FP8 dot product by the two scales and accumulates in float32.

Two ways to get the FP8 activations, chosen by the size of M:
- small M (decode): each program quantizes the bf16 activation tile it needs in registers. The tile is
  tiny and read from L2 by every program over N, and one launch per linear saves what counts at batch 1;
- large M (prefill): one quantization kernel first, since re-quantizing the tile for each of N/BLOCK_N
  programs would cost a fraction of the tensor-core time on CUDA cores.
When the grid has too few programs to fill the GPU (small M and N), the reduction is split over K into
float32 partials, which a second kernel sums, biases and casts.

For M up to GEMV_LIMIT_M (decode at batch 1 to 8) there is also a GEMV (`GemvConfig`; default_config picks
it for M <= GEMV_MAX_M): at such M a step only streams the weights, and tl.dot pads M to 16 and holds few
weight bytes in flight per program. Each GEMV program owns BLOCK_N output rows and a range of K, loads
BLOCK_K-wide strips of FP8 weights, converts them in registers and reduces with tl.sum on CUDA cores, the
activations quantized as above. The same kernel with SCALED off takes bf16/fp16 weights without scales
(`gemv`, measured by kestrel/bench/kernels/fp8.py only).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kestrel import envs, pdl
from kestrel.envs import triton_jit
from kestrel.quant.fp8 import BLOCK
from kestrel.quant.fp8_triton import to_fp8

# The largest M whose activations are quantized inside the GEMM (see the module docstring).
FUSED_QUANT_MAX_M = 64
# The largest M that default_config gives the GEMV (at most GEMV_LIMIT_M). Batch-1 decode of Llama-3.1-8B with
# --quantization fp8 on one H100 (at 956925d, `scripts/gpu.sh OUT one-batch-fp8`, both settings on one machine):
# 4.25 ms a step through tl.dot, 3.88 ms through the GEMV. M = 2-8 are not measured end to end: tl.dot there.
GEMV_MAX_M = 1
# The largest M the GEMV takes: a weight byte costs M FMAs on CUDA cores, and at M = 8 streaming the H200's
# 4.8 TB/s already asks 8 x 4.8e12 FMA/s = 77 TFLOP/s, above its ~67 TFLOP/s of float32. Past that, tl.dot.
GEMV_LIMIT_M = 8
# Whether default_gemv_config quantizes the activations as the tl.dot path does (GemvConfig.quantize_x). Off:
# on the H100 the sweep's fastest config at one row was W8A16 at three of Llama-3.1-8B's four shapes (gate_up
# 0.0438 against 0.0458 ms at the default tile) and a batch-1 step took 3.66 ms against 3.71 (one process
# each, docs/benchmarks.md). A module constant so that a benchmark can set it in its process first.
GEMV_QUANTIZE_X = False


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int  # 16, 32, 64 or 128: a tile's rows then share one weight scale
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fused_quant: bool = True


@dataclass(frozen=True)
class GemvConfig:
    """The GEMV path (M <= GEMV_LIMIT_M): programs of block_n output rows x one split of K, each iteration
    one block_k-wide strip of every row (block_k bytes of FP8, or 2 x block_k of bf16, per row)."""
    block_n: int = 16  # divides 128: a program's rows share one weight scale per 128 inputs
    block_k: int = 512  # a multiple of 128: whole activation groups per strip
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fused_quant: bool = True  # False: quantize_activations first (one more launch, no per-program quantizing)
    # At one row only: the products summed into a [block_n, block_k] float32 tile over the K loop and
    # reduced across threads once at the end, instead of once per strip (warp shuffles each time). On the
    # H100 it won for bf16 at all four of Llama-3.1-8B's shapes and for FP8 at o (docs/benchmarks.md).
    defer_reduce: bool = False
    # FP8 weights only. False: x stays in its float dtype (W8A16: the weight's scale goes onto x, x is not
    # rounded to e4m3), which spares each strip the per-group max and rounding that fp8_gemm's numerics
    # need; more exact than them, no longer bit-equal to the tl.dot path's. GEMV_QUANTIZE_X sets the default.
    quantize_x: bool = True


@triton_jit
def _quant_tile(x, EXACT_ROUND: tl.constexpr):
    """(e4m3 tile, float32 per-row scale) of a float32 [rows, 128] tile: kestrel.quant.fp8.quantize_token_groups
    (448: e4m3's largest value)."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-12)
    q = to_fp8(x * (448.0 / amax)[:, None], tl.float8e4nv, 448.0, EXACT_ROUND)
    return q, amax / 448.0


@triton_jit
def _quant_kernel(X, Q, S, M, K, stride_xm, stride_qm, stride_sm, BLOCK_R: tl.constexpr, EXACT_ROUND: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.sync(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1)
    offs_k = kb * 128 + tl.arange(0, 128)
    mask = (rows < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s = _quant_tile(x, EXACT_ROUND)
    tl.store(Q + rows[:, None] * stride_qm + offs_k[None, :], q, mask=mask)
    tl.store(S + rows * stride_sm + kb, s, mask=rows < M)


@triton_jit
def _gemm_kernel(X, X_s, W, W_s, Y, P, Bias, M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
                 stride_pk, stride_pm, HAS_BIAS: tl.constexpr, FUSED_QUANT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
                 EXACT_ROUND: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    # Tiles in groups of GROUP_M rows of tiles, so the programs running together share W tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    split = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_blocks = tl.cdiv(K, 128)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb_lo = split * per_split
    kb_hi = tl.minimum(kb_lo + per_split, k_blocks)
    w_scale_row = W_s + (pid_n * BLOCK_N // 128) * stride_wsn  # BLOCK_N divides 128: one scale row per tile

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb_lo, kb_hi):
        offs_k = kb * 128 + tl.arange(0, 128)
        k_mask = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if FUSED_QUANT:
            xq, x_s = _quant_tile(x.to(tl.float32), EXACT_ROUND)
        else:
            xq = x
            x_s = tl.load(X_s + offs_m * stride_xsm + kb, mask=m_mask, other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)
        if UPCAST:  # the interpreter stores FP8 as bytes: its dot needs real numbers
            part = tl.dot(xq.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(xq, w)  # FP8 x FP8 on tensor cores, float32 accumulate
        acc += part * (x_s[:, None] * tl.load(w_scale_row + kb))
    store_tile(acc, Y, P, Bias, offs_m, offs_n, m_mask, n_mask, split, stride_ym, stride_pk, stride_pm, HAS_BIAS,
                SPLIT_K > 1)


@triton_jit
def store_tile(acc, Y, P, Bias, offs_m, offs_n, m_mask, n_mask, split, stride_ym, stride_pk, stride_pm,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """A program's float32 [rows, cols] result: biased and cast into Y, or, split over K, into its partial."""
    mask = m_mask[:, None] & n_mask[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(P + split * stride_pk + offs_m[:, None] * stride_pm + offs_n[None, :], acc, mask=mask)


@triton_jit
def _gemv_kernel(X, X_s, W, W_s, Y, P, Bias, M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
                 stride_pk, stride_pm, split_k, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
                 FUSED_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PARTIAL: tl.constexpr, EXACT_ROUND: tl.constexpr, DEFER: tl.constexpr, QUANT_X: tl.constexpr,
                 PDL: tl.constexpr, GATED: tl.constexpr):
    # One program: BLOCK_N weight rows x one split of K, for all M tokens at once, so each weight byte is
    # read once per step. No tensor cores: products in float32 registers, tl.sum over each strip. split_k
    # is not a constexpr, so a sweep over it compiles once.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    strips = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(strips, split_k)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, strips)
    pdl.sync(PDL)
    w_scale_row = W_s + (pid_n * BLOCK_N // 128) * stride_wsn  # BLOCK_N divides 128: one scale row per program

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if DEFER:  # BLOCK_M == 1: per-thread sums over the K loop, one reduction after it
        acc_k = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for strip in range(lo, hi):
        offs_k = strip * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        if GATED:  # X holds gate | up, K wide each: x = silu(gate) * up, rounded where silu_and_mul rounds
            gate = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty)
            x = (act * tl.load(x_ptrs + K, mask=x_mask, other=0.0)).to(X.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        if SCALED:
            # Both scales go onto the activation, which is BLOCK_N times smaller than the weight strip:
            # x_k * x_scale(group) * w_scale(group), then one product per weight.
            groups = offs_k // 128
            if QUANT_X and FUSED_QUANT:  # (W8A16, QUANT_X off: only the weight's scale)
                xq, x_s = _quant_tile(tl.reshape(x, [BLOCK_M * (BLOCK_K // 128), 128]), EXACT_ROUND)
                x = tl.reshape(xq.to(tl.float32) * x_s[:, None], [BLOCK_M, BLOCK_K])
            elif QUANT_X:
                x = x * tl.load(X_s + offs_m[:, None] * stride_xsm + groups[None, :], mask=x_mask, other=0.0)
            x = x * tl.load(w_scale_row + groups, mask=k_mask, other=0.0)[None, :]
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = w.to(tl.float32)
        if DEFER:
            acc_k += w * x
        elif BLOCK_M == 1:  # batch 1: a 2-D product in the weight tile's own layout, nothing to convert
            acc += tl.sum(w * x, 1)[None, :]
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
    if DEFER:
        acc += tl.sum(acc_k, 1)[None, :]
    store_tile(acc, Y, P, Bias, offs_m, offs_n, m_mask, n_mask, split, stride_ym, stride_pk, stride_pm, HAS_BIAS,
                PARTIAL)


@triton_jit
def _split_sum_kernel(P, Y, Bias, M, N, stride_pk, stride_pm, stride_ym, SPLIT_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(P + s * stride_pk + row * stride_pm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's SM count (132, an H100's, off CUDA: what the interpreter's configs assume)."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 132


def default_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig | GemvConfig:
    """The GEMV up to GEMV_MAX_M rows, the tl.dot tiles above."""
    if m <= GEMV_MAX_M:
        return default_gemv_config(m, n, k, device)
    return default_dot_config(m, n, k, device)


def default_dot_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Tiles by M; split K when the tiles alone would leave most SMs idle (decode shapes).
    A first guess, to be replaced by what kestrel/bench/kernels/fp8.py measures on the H200."""
    sms = sm_count(device)
    if m > FUSED_QUANT_MAX_M:
        return GemmConfig(block_m=128 if m >= 128 else 64, block_n=128, num_warps=8, num_stages=3,
                          fused_quant=False)
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, BLOCK)
    split = 1
    while tiles * split < 2 * sms and k_blocks >= 8 * split:
        split *= 2
    return GemmConfig(block_m=block_m, block_n=block_n, split_k=split, num_warps=4, num_stages=4)


def default_gemv_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """On CUDA at one row, ONE_ROW_TUNED's config for the shape where it has one. Else 16 rows x 512 inputs
    per strip (8 KiB of FP8) at M = 1, the strip narrowed as M grows so the float32 products stay at 8K per
    program; K split until there are 4 programs per SM (a weight-streaming kernel needs many loads in
    flight per SM). A first guess, like default_dot_config's."""
    if m == 1 and device.type == "cuda" and (n, k) in ONE_ROW_TUNED:
        return replace(ONE_ROW_TUNED[n, k], quantize_x=GEMV_QUANTIZE_X)
    block_n = 16
    block_k = max(BLOCK, 8192 // (triton.next_power_of_2(max(m, 1)) * block_n))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=gemv_split_k(n, k, block_n, block_k, device),
                      quantize_x=GEMV_QUANTIZE_X)


# (N, K) -> the fastest config at one row in the H100's sweep (`python -m kestrel.bench.kernels.fp8 --gemv-only`,
# docs/benchmarks.md): Llama-3.1-8B's qkv, o, gate_up and down. Their sum over 32 layers 2.91 ms against the
# rule's 3.04; with W8A16, a batch-1 step 3.537 ms against 3.656. Other shapes take the rule.
# The activations' rounding is GEMV_QUANTIZE_X's (the sweep's winners were W8A16).
ONE_ROW_TUNED = {
    (6144, 4096): GemvConfig(16, 1024, 1, num_warps=8),
    (4096, 4096): GemvConfig(8, 1024, 1, num_warps=4, defer_reduce=True),
    (28672, 4096): GemvConfig(16, 512, 1, num_warps=4),
    (4096, 14336): GemvConfig(32, 512, 4, num_warps=8),
}


def gemv_split_k(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Splits of K doubled until there are 4 GEMV programs per SM, each keeping at least 4 strips."""
    programs = triton.cdiv(n, block_n)
    strips = triton.cdiv(k, block_k)
    split = 1
    while programs * split < 4 * sm_count(device) and strips >= 8 * split:
        split *= 2
    return split


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 [M, ceil(K/128)]) in one launch: quantize_token_groups on the GPU."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, triton.cdiv(k, BLOCK)), dtype=torch.float32, device=x.device)
    if m:
        block_r = 16
        _quant_kernel[(triton.cdiv(m, block_r), triton.cdiv(k, BLOCK))](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), BLOCK_R=block_r, EXACT_ROUND=envs.triton_interpret(),
            **pdl.launch_options(x.device))
    return q, s


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
             config: GemmConfig | GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (float) @ weight [N, K] (float8_e4m3fn, 128 x 128 block scales [ceil(N/128), ceil(K/128)])^T
    (+ bias) -> [M, N] in x's dtype. A GemvConfig (M <= GEMV_LIMIT_M) runs `gemv`, a GemmConfig tl.dot."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or default_config(m, n, k, x.device)
    if isinstance(cfg, GemvConfig):
        return gemv(x, weight, weight_scale_inv, bias, cfg)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("fp8_gemm needs row-major x and weight (inner stride 1)")
    if BLOCK % cfg.block_n:
        raise ValueError(f"block_n must divide {BLOCK} (one weight scale per tile), got {cfg.block_n}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if cfg.fused_quant:
        xq, x_s = x, x  # x_s unused: the kernel quantizes x itself
    else:
        xq, x_s = quantize_activations(x)
    partial = y if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    interpret = envs.triton_interpret()
    _gemm_kernel[grid](
        xq, x_s, weight, weight_scale_inv, y, partial, bias if bias is not None else y, m, n, k,
        xq.stride(0), x_s.stride(0), weight.stride(0), weight_scale_inv.stride(0), y.stride(0),
        partial.stride(0), partial.stride(1) if cfg.split_k > 1 else 0,
        HAS_BIAS=bias is not None, FUSED_QUANT=cfg.fused_quant, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        SPLIT_K=cfg.split_k, GROUP_M=8, UPCAST=interpret, EXACT_ROUND=interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device))
    if cfg.split_k > 1:
        sum_splits(partial, y, bias, cfg.split_k)
    return y


def sum_splits(partial: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, split_k: int) -> None:
    """y = sum of the float32 partials [split_k, M, N] (+ bias), in a fixed order: deterministic."""
    m, n = y.shape
    block = min(1024, triton.next_power_of_2(n))
    _split_sum_kernel[(m, triton.cdiv(n, block))](
        partial, y, bias if bias is not None else y, m, n, partial.stride(0), partial.stride(1), y.stride(0),
        SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, **pdl.launch_options(y.device))


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, config: GemvConfig | None = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] (float, M <= GEMV_LIMIT_M) @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype, on CUDA cores.
    weight float8_e4m3fn with its 128 x 128 block scales: fp8_gemm's numerics (activations quantized per
    token and 128 inputs). weight_scale_inv None: a float weight taken as it is (bf16 / fp16 decode:
    kestrel/layers/one_row_gemv.py). `gated`: x is [M, 2K], a gated MLP's gate | up, and
    the GEMV multiplies silu(gate) * up (`silu_and_mul`'s values, bit for bit) without a launch of its own."""
    m, k = x.shape
    if gated:
        k //= 2
    n = weight.shape[0]
    scaled = weight_scale_inv is not None
    if m > GEMV_LIMIT_M:
        raise ValueError(f"the GEMV takes at most {GEMV_LIMIT_M} rows of x (got {m}): use fp8_gemm's tl.dot path")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs row-major x and weight (inner stride 1)")
    cfg = config or default_gemv_config(m, n, k, x.device)
    if cfg.block_n & (cfg.block_n - 1) or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"block_n and block_k must be powers of two, got {cfg.block_n} and {cfg.block_k}")
    if scaled and (BLOCK % cfg.block_n or cfg.block_k % BLOCK):
        raise ValueError(f"with FP8 weights block_n must divide {BLOCK} and block_k be a multiple of it "
                         f"(whole scale blocks per program and strip), got {cfg.block_n} and {cfg.block_k}")
    if cfg.defer_reduce and m != 1:
        raise ValueError(f"defer_reduce is a GEMV option at one row of x (got {m})")
    if gated and (x.shape[1] != 2 * weight.shape[1] or (scaled and cfg.quantize_x and not cfg.fused_quant)):
        raise ValueError(f"a gated GEMV takes x of twice the weight's {weight.shape[1]} inputs (got {x.shape[1]}) "
                         "and quantizes activations, if at all, in the kernel (fused_quant)")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if scaled and cfg.quantize_x and not cfg.fused_quant:
        xq, x_s = quantize_activations(x)
    else:
        xq, x_s = x, x  # x_s unused: the kernel quantizes x itself, or the weight has no scales
    w_s = weight_scale_inv if scaled else weight  # unused without scales
    partial = y if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        xq, x_s, weight, w_s, y, partial, bias if bias is not None else y, m, n, k,
        xq.stride(0), x_s.stride(0), weight.stride(0), w_s.stride(0), y.stride(0),
        partial.stride(0), partial.stride(1) if cfg.split_k > 1 else 0, cfg.split_k,
        HAS_BIAS=bias is not None, SCALED=scaled, FUSED_QUANT=cfg.fused_quant, BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PARTIAL=cfg.split_k > 1, EXACT_ROUND=envs.triton_interpret(),
        DEFER=cfg.defer_reduce, QUANT_X=cfg.quantize_x, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        GATED=gated, **pdl.launch_options(x.device))
    if cfg.split_k > 1:
        sum_splits(partial, y, bias, cfg.split_k)
    return y
