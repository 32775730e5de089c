"""Triton helpers that write FP8: scale, saturate, round. Shared by the KV stores and the FP8 GEMM.

Kernels take `FP8_MAX` (0.0: the destination is not FP8) and `EXACT_ROUND` from `fp8_store_args`.
"""
from __future__ import annotations

import torch
import triton.language as tl

from kestrel import envs
from kestrel.envs import triton_jit
from kestrel.quant.fp8 import fp8_max, is_fp8


def fp8_store_args(dtype: torch.dtype) -> dict[str, object]:
    """The constexprs of a kernel that stores into `dtype`."""
    return {"FP8_MAX": fp8_max(dtype) if is_fp8(dtype) else 0.0, "EXACT_ROUND": envs.triton_interpret()}


@triton_jit
def round_to_fp8_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """float32 x rounded to the nearest value with MANT mantissa bits (ties to even; below 2**EMIN
    the subnormal step), still float32, so the cast after it is exact. Only for Triton's CPU
    interpreter: its float -> fp8 cast drops a rounding carry into an odd exponent (e4m3: 7.94 -> 4.0)
    and rounds ties away from zero; a GPU's conversion rounds correctly on its own."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    # 1.5 * 2**(e - MANT + 23): adding it leaves the float32 sum an ulp of one step of x's binade.
    c = (((e - MANT + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + c) - c
    return tl.where(bits < 0, -r, r)


@triton_jit
def to_fp8(x, DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """float32 x saturated to +-FP8_MAX and cast to the FP8 `DTYPE` (round to nearest even)."""
    y = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    if EXACT_ROUND:
        if FP8_MAX == 448.0:  # e4m3
            y = round_to_fp8_grid(y, 3, -6)
        else:  # e5m2
            y = round_to_fp8_grid(y, 2, -14)
    return y.to(DTYPE)


@triton_jit
def to_storage(x, scale, DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """What a buffer of `DTYPE` holds for x: x / scale in FP8 (kestrel.quant.kv.to_pool), else x cast."""
    if FP8_MAX > 0:
        y = to_fp8(x.to(tl.float32) / scale, DTYPE, FP8_MAX, EXACT_ROUND)
    else:
        y = x.to(DTYPE)
    return y
