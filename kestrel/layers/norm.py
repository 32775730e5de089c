"""RMSNorm over the last dimension, optionally fused with the residual add."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / rms(x)); the statistics are computed in float32 and the normalized value
    is cast back to x's dtype before the weight multiply, matching transformers bit for bit in fp32.

    Called with a residual, it first forms `residual + x` (in x's dtype) and returns
    (normed sum, the sum), the sum being the next residual.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, use_triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.triton_kernel = None
        if use_triton:  # imported only here: triton is optional
            from kestrel.layers.fused_triton import add_rmsnorm

            self.triton_kernel = add_rmsnorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.triton_kernel is not None and x.dim() == 2:
            out = self.triton_kernel(x, residual, self.weight, self.eps)  # updates residual in place
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
