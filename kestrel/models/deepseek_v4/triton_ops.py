"""V4's elementwise steps as one Triton launch each, on CUDA (the model's `fused` flag): at batch 1 a V4
decode layer is launch-bound, and its rope alone runs six times per ratio-4 layer at ~9 torch launches
each. Both kernels round where the torch forms do (`V4Rope.forward`, `V4Attention`'s head norm).

- `rope`: the pairs (x[2k], x[2k+1]) of the last `rope_dim` dims of each row turned by position x omega_k
  (negated for the inverse), angles, products and sums in float32, the result cast to x's dtype; the
  other dims copied. A program per row of D values (a token's head, or a token).
- `head_rms_scale`: each row times rsqrt(mean(row^2) + eps), the statistic in float32 and cast to the
  row's dtype before the product (no weight).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
def _rms_scale_kernel(X, Out, dim, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = tl.load(X + row * dim + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = (1.0 / tl.sqrt(tl.sum(xf * xf, 0) / dim + eps)).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * dim + offs, (xf * rstd).to(Out.dtype.element_ty), mask=mask)


def head_rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x * rsqrt(mean(x^2, -1) + eps) as `V4Attention` writes it in torch, one launch."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    if x.numel():
        _rms_scale_kernel[(x.numel() // dim,)](x, out, dim, eps, BLOCK_D=triton.next_power_of_2(dim))
    return out
