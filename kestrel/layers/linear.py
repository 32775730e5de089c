"""Linear layers that fuse several checkpoint projections into one matmul."""
from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One weight [sum(shard_sizes), in] holding several projections stacked on the output dim
    (q|k|v, or gate|up): one GEMM reads the input once instead of once per projection."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]

    def shard(self, param: torch.Tensor, shard_id: int) -> torch.Tensor:
        """The rows of `param` (weight or bias) that hold projection `shard_id`."""
        start = self.shard_offsets[shard_id]
        return param[start:start + self.shard_sizes[shard_id]]
