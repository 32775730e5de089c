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
def _head_weight(WQ, WK, offs, mask, is_q):
    """A head's norm weight at `offs`: the query weight for the query heads, the key weight for the rest
    (both D values, read from L2 by every program)."""
    wq = tl.load(WQ + offs, mask=mask, other=0.0)
    wk = tl.load(WK + offs, mask=mask, other=0.0)
    return tl.where(is_q, wq, wk).to(tl.float32)


@triton_jit
def _head_rmsnorm_kernel(X, WQ, WK, OUT, positions, cos_sin, stride_x, stride_o, stride_c, q_heads, head_dim, eps,
                         BLOCK: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    is_q = head < q_heads  # the query heads come first
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    src = X + row * stride_x + head * head_dim
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / head_dim + eps)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32) * _head_weight(WQ, WK, offs, mask, is_q)
    if ROPE:  # then rotated as rope_triton does (neox halves), from the normed values in the output dtype
        half = head_dim // 2
        first = offs < half
        partner = tl.where(first, offs + half, offs - half)
        xp = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
        normed_p = (xp * rstd).to(X.dtype.element_ty).to(tl.float32) * _head_weight(WQ, WK, partner, mask, is_q)
        dt = OUT.dtype.element_ty
        normed, normed_p = normed.to(dt).to(tl.float32), normed_p.to(dt).to(tl.float32)
        pos = tl.load(positions + row)
        freq = tl.where(first, offs, partner)
        cos = tl.load(cos_sin + pos * stride_c + freq, mask=mask, other=0.0).to(dt).to(tl.float32)
        sin = tl.load(cos_sin + pos * stride_c + half + freq, mask=mask, other=0.0).to(dt).to(tl.float32)
        normed = tl.where(first, normed * cos - normed_p * sin, normed * cos + normed_p * sin)
    tl.store(OUT + row * stride_o + head * head_dim + offs, normed.to(OUT.dtype.element_ty), mask=mask)


def head_rmsnorm(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, eps: float,
                 positions: torch.Tensor | None = None, cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of queries and keys in one launch: x [T, (q_heads + k_heads) x D] (the query
    heads, then the key heads, side by side; rows may be strided) -> the same, each head normed with
    q_weight or k_weight [D]. The torch path takes ~17 launches in bf16 (two RMSNorms over reshaped views and
    a cat): at batch 1 under CUDA graphs their count is what costs. With `positions` [T] and `cos_sin_cache`
    (float32 [max_pos, D], cos | sin), each head is then rotated as rope_triton rotates it, in the same launch."""
    rows, width = x.shape
    head_dim = q_weight.numel()
    rope = positions is not None
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        _head_rmsnorm_kernel[(rows, width // head_dim)](
            x, q_weight, k_weight, out, positions if rope else x, cos_sin_cache if rope else x, x.stride(0),
            out.stride(0), cos_sin_cache.stride(0) if rope else 0, q_heads, head_dim, eps,
            BLOCK=triton.next_power_of_2(head_dim), ROPE=rope, **pdl.launch_options(x.device))
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
