"""Linear layers: one-row inputs can take a Triton GEMV; several checkpoint projections fuse into one."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose one-row products (batch-1 decode) run as a Triton GEMV when `use_gemv`
    (see kestrel.layers.gemv_triton for why); every other shape goes to torch's GEMM."""

    def __init__(self, in_features: int, out_features: int, bias: bool, use_gemv: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gemv = None
        if use_gemv:  # imported only here: triton is optional
            from kestrel.layers.gemv_triton import gemv

            self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and x.shape[0] == 1:
            return self.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """One weight [sum(shard_sizes), in] holding several projections stacked on the output dim
    (q|k|v, or gate|up): one GEMM reads the input once instead of once per projection."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, use_gemv: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias, use_gemv)
        self.shard_sizes = shard_sizes
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]

    def shard(self, param: torch.Tensor, shard_id: int) -> torch.Tensor:
        """The rows of `param` (weight or bias) that hold projection `shard_id`."""
        start = self.shard_offsets[shard_id]
        return param[start:start + self.shard_sizes[shard_id]]
