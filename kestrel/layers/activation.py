"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2*I] -> [..., I]: silu(gate) * up, with gate the first half and up the second
    (the layout a merged gate_up projection produces)."""

    def __init__(self, use_triton: bool = False) -> None:
        super().__init__()
        self.triton_kernel = None
        if use_triton:  # imported only here: triton is optional
            from kestrel.layers.fused_triton import silu_and_mul

            self.triton_kernel = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton_kernel is not None and x.dim() == 2:
            return self.triton_kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
