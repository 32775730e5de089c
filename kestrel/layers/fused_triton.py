"""Triton kernels for the elementwise steps of a decoder layer, each one launch instead of several.

At batch size 1 a Llama-8B decode step runs ~400 kernels; the elementwise ones move little data, so
their count, not their bytes, is what costs. Both kernels round exactly where the torch path does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel import pdl
from kestrel.envs import triton_jit


@triton_jit
def _add_rmsnorm_kernel(X, R, W, OUT, stride_x, stride_r, stride_o, hidden, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual += x, in the activation dtype, and normalize the sum
        x = (x + tl.load(R + row * stride_r + offs, mask=mask, other=0.0)).to(X.dtype.element_ty)
        tl.store(R + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, (normed * w).to(OUT.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x + residual) * weight; with a residual, it is updated in place to x + residual."""
    out = torch.empty_like(x)
    rows, hidden = x.shape
    if rows:
        _add_rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, x.stride(0),
                                     residual.stride(0) if residual is not None else 0, out.stride(0), hidden, eps,
                                     HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
                                     **pdl.launch_options(x.device))
    return out


@triton_jit
def _head_rmsnorm_kernel(X, WQ, WK, OUT, stride_x, stride_o, q_heads, head_dim, eps, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.sync(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    x = tl.load(X + row * stride_x + head * head_dim + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / head_dim + eps)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    # The query heads come first and take the query weight; the rest take the key weight (both are
    # D values, read from L2 by every program).
    wq = tl.load(WQ + offs, mask=mask, other=0.0).to(tl.float32)
    wk = tl.load(WK + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.where(head < q_heads, wq, wk)
    tl.store(OUT + row * stride_o + head * head_dim + offs, (normed * w).to(OUT.dtype.element_ty), mask=mask)


def head_rmsnorm(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int,
                 eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of queries and keys in one launch: x [T, (q_heads + k_heads) x D] (the query
    heads, then the key heads, side by side; rows may be strided) -> the same, each head normed with
    q_weight or k_weight [D]. The torch path takes ~17 launches in bf16 (two RMSNorms over reshaped views and
    a cat): at batch 1 under CUDA graphs their count is what costs."""
    rows, width = x.shape
    head_dim = q_weight.numel()
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        _head_rmsnorm_kernel[(rows, width // head_dim)](x, q_weight, k_weight, out, x.stride(0), out.stride(0),
                                                        q_heads, head_dim, eps,
                                                        BLOCK=triton.next_power_of_2(head_dim),
                                                        **pdl.launch_options(x.device))
    return out


@triton_jit
def _head_rmsnorm_rope_kernel(X, WQ, WK, OUT, positions, cos_sin, stride_x, stride_o, stride_c, q_heads, eps,
                              HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    # A head as its two rope halves: normed as _head_rmsnorm_kernel does, then rotated as rope_triton does,
    # rounding to the activation dtype at the same two places.
    pdl.sync(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    src = X + row * stride_x + head * (2 * HALF) + offs
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
    is_q = head < q_heads  # the query weight for the query heads, as _head_rmsnorm_kernel picks it
    w1 = tl.where(is_q, tl.load(WQ + offs, mask=mask, other=0.0), tl.load(WK + offs, mask=mask, other=0.0))
    w2 = tl.where(is_q, tl.load(WQ + HALF + offs, mask=mask, other=0.0),
                  tl.load(WK + HALF + offs, mask=mask, other=0.0))
    w1, w2 = w1.to(tl.float32), w2.to(tl.float32)
    dt = OUT.dtype.element_ty
    n1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
    n2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    pos = tl.load(positions + row)
    cos = tl.load(cos_sin + pos * stride_c + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(cos_sin + pos * stride_c + HALF + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    dst = OUT + row * stride_o + head * (2 * HALF) + offs
    tl.store(dst, (n1 * cos - n2 * sin).to(dt), mask=mask)
    tl.store(dst + HALF, (n2 * cos + n1 * sin).to(dt), mask=mask)


def head_rmsnorm_rope(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, eps: float,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """`head_rmsnorm`, then rope_triton's rotation (neox style over the whole head; cos_sin_cache float32
    [max_pos, D], cos | sin) at `positions` [T], in one launch instead of two: Qwen3's q and k before
    attention."""
    rows, width = x.shape
    head_dim = q_weight.numel()
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        _head_rmsnorm_rope_kernel[(rows, width // head_dim)](
            x, q_weight, k_weight, out, positions, cos_sin_cache, x.stride(0), out.stride(0), cos_sin_cache.stride(0),
            q_heads, eps, HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            **pdl.launch_options(x.device))
    return out


@triton_jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0)
    # torch rounds silu(gate) to the activation dtype before the multiply: so do we.
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty)
    tl.store(OUT + row * stride_o + offs, (act * up).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) → [T, I]."""
    rows, width = x.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter, BLOCK=block,
                                                                   **pdl.launch_options(x.device))
    return out
