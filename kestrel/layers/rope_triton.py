"""Rope as one Triton kernel over q and k together (neox style), instead of ~10 small torch ops."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel import pdl
from kestrel.envs import triton_jit


@triton_jit
def _rope_kernel(X, OUT, positions, cos_sin, stride_xt, stride_ot, stride_c, num_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    t = tl.program_id(0)
    pos = tl.load(positions + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    cos = tl.load(cos_sin + pos * stride_c + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin + pos * stride_c + HALF + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    base = X + t * stride_xt + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    # Round cos/sin to the activation dtype first, as the torch path (and transformers) does.
    cos = cos.to(OUT.dtype.element_ty).to(tl.float32)
    sin = sin.to(OUT.dtype.element_ty).to(tl.float32)
    out = OUT + t * stride_ot + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mask)


def rope_triton(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x: [T, heads * head_dim] → rotated copy; cos_sin_cache: float32 [max_pos, head_dim] (cos | sin)."""
    tokens, width = x.shape
    heads = width // head_dim
    out = torch.empty_like(x)
    if tokens:
        _rope_kernel[(tokens,)](x, out, positions, cos_sin_cache, x.stride(0), out.stride(0), cos_sin_cache.stride(0),
                                heads, HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(heads),
                                BLOCK_HALF=triton.next_power_of_2(head_dim // 2), **pdl.launch_options(x.device))
    return out
