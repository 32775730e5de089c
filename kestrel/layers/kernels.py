"""Which kernel implementations a model's layers use, chosen once by the model runner."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernels:
    """`triton_rope`: rope as a Triton kernel (attention.decisions.shared_triton_kernel decides: it runs in
    both phases). `triton_elementwise`: fused add+RMSNorm and SiLU-and-mul Triton kernels (CUDA only).
    `triton_fp8`: FP8 linear layers run the Triton FP8 GEMM (CUDA only; else their torch reference).
    `triton_int4`: AWQ / GPTQ linear layers run the Triton W4A16 GEMM (CUDA only; else the dequantised
    weight in torch). `triton_gemv`: float linear layers at one row (batch-1 decode) run the Triton GEMV
    (kestrel.layers.one_row_gemv; CUDA only)."""

    triton_rope: bool = False
    triton_elementwise: bool = False
    triton_fp8: bool = False
    triton_int4: bool = False
    triton_gemv: bool = False
