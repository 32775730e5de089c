"""Triton kernels of the segmented LoRA matmul (ops.py states the layout): a shrink s = x A[slot]^T and an
expand y += s B[slot]^T, each token reading its own slot's weights; a token of slot -1 is skipped.

One program per (token, block of output columns): a token's adapter is its own, so rows of different
adapters never share a tile. Decode (one token per request) is a batched GEMV either way; LoRA work is
rank / out of the base projection's, so per-token programs cost little beside it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.envs import triton_jit


@triton_jit
def _shrink_kernel(x_ptr, slots_ptr, a_ptr, s_ptr, K, NR, stride_x, stride_as, stride_an, stride_s,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_an + ks[None, :],
                     mask=(cols[:, None] < NR) & (ks[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(s_ptr + t * stride_s + cols, acc, mask=cols < NR)


@triton_jit
def _expand_kernel(y_ptr, s_ptr, slots_ptr, b_ptr, N, R, END0, END1, stride_y, stride_s, stride_bs, stride_bn,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    # Which merged part each output column belongs to (q|k|v: 0, 1, 2): its shrink columns start at part * R.
    part = (cols >= END0).to(tl.int32) + (cols >= END1).to(tl.int32)
    live = cols < N
    sv = tl.load(s_ptr + t * stride_s + part[:, None] * R + rs[None, :], mask=live[:, None] & (rs[None, :] < R),
                 other=0.0)
    bv = tl.load(b_ptr + slot * stride_bs + cols[:, None] * stride_bn + rs[None, :],
                 mask=live[:, None] & (rs[None, :] < R), other=0.0).to(tl.float32)
    delta = tl.sum(sv * bv, axis=1)
    yv = tl.load(y_ptr + t * stride_y + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + cols, (yv + delta).to(y_ptr.dtype.element_ty), mask=live)


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       part_sizes: tuple[int, ...]) -> torch.Tensor:
    """y (updated in place and returned) += the LoRA delta of x; up to 3 merged parts."""
    assert len(part_sizes) <= 3, "a merged projection of at most 3 parts (q|k|v)"
    t, k = x.shape
    _, nr, _ = a.shape
    n, r = y.shape[1], nr // len(part_sizes)
    x, y = x.contiguous(), y.contiguous()
    shrink = torch.zeros(t, nr, dtype=torch.float32, device=x.device)
    if t == 0:
        return y
    block_n = 16
    _shrink_kernel[(t, triton.cdiv(nr, block_n))](
        x, slots, a, shrink, k, nr, x.stride(0), a.stride(0), a.stride(1), shrink.stride(0),
        BLOCK_N=block_n, BLOCK_K=128)
    ends = [sum(part_sizes[:i + 1]) for i in range(len(part_sizes))] + [n] * (3 - len(part_sizes))
    block_out = 64
    _expand_kernel[(t, triton.cdiv(n, block_out))](
        y, shrink, slots, b, n, r, ends[0], ends[1], y.stride(0), shrink.stride(0), b.stride(0), b.stride(1),
        BLOCK_N=block_out, BLOCK_R=triton.next_power_of_2(r))
    return y
