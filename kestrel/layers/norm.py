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
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.use_triton and x.dim() == 2:
            from kestrel.layers.fused_triton import add_rmsnorm

            out = add_rmsnorm(x, residual, self.weight, self.eps)  # updates residual in place
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
