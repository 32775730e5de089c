"""Writes the new tokens' K and V into the paged pool in one launch (two index_put kernels in torch)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel import pdl
from kestrel.envs import triton_jit
from kestrel.quant.fp8_triton import fp8_store_args, to_storage


@triton_jit
def _store_kv_kernel(K, V, K_buf, V_buf, slots, stride_k, stride_v, stride_kb, stride_vb, width, k_scale, v_scale,
                     BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, EXACT_ROUND: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    k = tl.load(K + t * stride_k + offs, mask=mask)
    v = tl.load(V + t * stride_v + offs, mask=mask)
    tl.store(K_buf + slot * stride_kb + offs, to_storage(k, k_scale, K_buf.dtype.element_ty, FP8_MAX, EXACT_ROUND),
             mask=mask)
    tl.store(V_buf + slot * stride_vb + offs, to_storage(v, v_scale, V_buf.dtype.element_ty, FP8_MAX, EXACT_ROUND),
             mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k/v: [T, kv_heads * head_dim] (rows may be strided views); k_buf/v_buf: [num_slots, kv_heads, head_dim],
    FP8 buffers storing value / scale (kestrel.quant.kv.to_pool)."""
    tokens, width = k.shape
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        _store_kv_kernel[(tokens, triton.cdiv(width, block))](
            k, v, k_buf, v_buf, slots, k.stride(0), v.stride(0), k_buf.stride(0), v_buf.stride(0), width,
            k_scale, v_scale, BLOCK=block, **fp8_store_args(k_buf.dtype), **pdl.launch_options(k.device))
