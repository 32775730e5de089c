"""Matrix-vector products for one-row activations (batch-1 decode), as Triton kernels.

At batch 1 every linear layer is a pure weight read. cuBLAS splits the long reductions (o_proj,
down_proj) over several blocks and adds a second "split-K reduce" kernel; these kernels give each
program a band of output rows and the whole reduction instead, so one launch does the job. The
gate_up variant also applies SiLU-and-mul to its band, saving the activation kernel.

Each program keeps a [BLOCK_N, BLOCK_K] float32 partial sum and reduces it across K once at the
end, so the loop body is loads and multiply-adds only. Outputs round to the weight dtype as
torch's GEMM does (then, for logits, widen to float32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_w, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # SILU_MUL: the up rows, N further down W
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(X + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(W + offs_n[:, None] * stride_w + k[None, :], mask=w_mask, other=0.0)
        acc += w.to(tl.float32) * x
        if SILU_MUL:
            u = tl.load(W + (offs_n[:, None] + N) * stride_w + k[None, :], mask=w_mask, other=0.0)
            acc_up += u.to(tl.float32) * x
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    dtype = W.dtype.element_ty
    y = y.to(dtype)
    if SILU_MUL:  # round gate and up as the unfused GEMM would, then as SiluAndMul does
        up = tl.sum(acc_up, 1)
        if HAS_BIAS:
            up += tl.load(B + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        gate = y.to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(dtype) * up.to(dtype)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_mask)


def _block_n(rows: int) -> int:
    # Enough programs to cover the SMs a few times over: narrow bands for the short outputs.
    return 8 if rows <= 8192 else 16 if rows <= 32768 else 32


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         out_dtype: torch.dtype | None = None, block_n: int | None = None, block_k: int = 512,
         num_warps: int = 4) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N]; with `silu_mul`, weight holds gate rows then up
    rows and the result is silu(gate) * up, [1, N/2]. `out_dtype` widens the rounded result."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == weight.shape[1], "gemv takes one row"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    rows, k = weight.shape
    n = rows // 2 if silu_mul else rows
    y = torch.empty((1, n), dtype=out_dtype or weight.dtype, device=x.device)
    block_n = block_n or _block_n(n)
    x = x.contiguous()
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=num_warps)
    return y
