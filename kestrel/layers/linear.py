"""Linear layers: projections fused into one matmul, and their tensor-parallel shards.

A sharded layer holds one rank's slice of the checkpoint tensor and says which (`checkpoint_slice`),
so the loader reads only that slice from the file. Column-parallel layers (MergedLinear) need no
communication: their outputs stay split by head / by column; a row-parallel layer sums its partial
products over the ranks. At tp_size 1 the builders return plain `nn.Linear`s: no collective runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.distributed.parallel_state import ParallelState


@dataclass(frozen=True)
class Slice:
    """Where this rank's part of a checkpoint tensor lies: `length` entries from `start` along `dim`."""

    dim: int
    start: int
    length: int


class MergedLinear(nn.Linear):
    """One weight [sum(local sizes), in] holding several projections stacked on the output dim
    (q|k|v, or gate|up): one GEMM reads the input once instead of once per projection.

    `slices[i]` (tensor parallelism): the rows of projection i's checkpoint tensor this rank holds;
    None holds every projection whole (`shard_sizes` rows each)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool,
                 slices: list[Slice] | None = None) -> None:
        local = [s.length for s in slices] if slices is not None else list(shard_sizes)
        super().__init__(in_features, sum(local), bias=bias)
        self.shard_sizes = local
        self.shard_offsets = [sum(local[:i]) for i in range(len(local))]
        self.slices = slices

    def shard(self, param: torch.Tensor, shard_id: int) -> torch.Tensor:
        """The rows of `param` (weight or bias) that hold projection `shard_id`."""
        start = self.shard_offsets[shard_id]
        return param[start:start + self.shard_sizes[shard_id]]

    def checkpoint_slice(self, param_name: str, shard_id: int | None) -> Slice | None:
        return None if self.slices is None else self.slices[shard_id]


class ColumnParallelLinear(nn.Linear):
    """y = x W^T with W's output rows split over the ranks: this rank holds the rows `part` of the
    checkpoint tensor (its heads of a projection split by heads)."""

    def __init__(self, in_features: int, part: Slice, bias: bool) -> None:
        super().__init__(in_features, part.length, bias=bias)
        self.part = part

    def checkpoint_slice(self, param_name: str, shard_id: int | None) -> Slice:
        return self.part


class RowParallelLinear(nn.Linear):
    """y = x W^T + b with W split by input columns: each rank multiplies its slice of x (the output of
    a column-parallel layer, split the same way), the partial products are summed over the ranks, and
    the bias is added once after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState) -> None:
        if in_features % parallel.tp_size:
            raise ValueError(f"{in_features} input features do not split over tp_size {parallel.tp_size}")
        local = in_features // parallel.tp_size
        super().__init__(local, out_features, bias=bias)
        self.parallel = parallel
        self._slice = Slice(1, parallel.tp_rank * local, local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def checkpoint_slice(self, param_name: str, shard_id: int | None) -> Slice | None:
        return self._slice if param_name == "weight" else None  # the bias is whole on every rank


def row_parallel_linear(in_features: int, out_features: int, bias: bool, parallel: ParallelState) -> nn.Linear:
    if parallel.tp_size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, parallel)


def column_slices(sizes: list[int], parallel: ParallelState) -> list[Slice] | None:
    """Each projection split evenly by rank (gate|up); None at tp_size 1."""
    if parallel.tp_size == 1:
        return None
    for size in sizes:
        if size % parallel.tp_size:
            raise ValueError(f"a projection of {size} rows does not split over tp_size {parallel.tp_size}")
    return [Slice(0, parallel.tp_rank * (s // parallel.tp_size), s // parallel.tp_size) for s in sizes]


def attention_heads(num_heads: int, num_kv_heads: int, parallel: ParallelState) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of this rank. Query heads split evenly; KV heads too when
    there are at least as many as ranks, else each rank keeps the one KV head its query heads read
    (a KV head is then replicated on tp_size / num_kv_heads ranks)."""
    tp, rank = parallel.tp_size, parallel.tp_rank
    if num_heads % tp:
        raise ValueError(f"num_attention_heads={num_heads} must be a multiple of tp_size={tp}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"num_key_value_heads={num_kv_heads} and tp_size={tp}: one must divide the other")
    return num_heads // tp, max(1, num_kv_heads // tp), rank * num_kv_heads // tp


def qkv_slices(num_heads: int, num_kv_heads: int, head_dim: int, parallel: ParallelState) -> list[Slice] | None:
    """The rows of q, k and v this rank holds (by head); None at tp_size 1."""
    if parallel.tp_size == 1:
        return None
    heads, kv_heads, first_kv = attention_heads(num_heads, num_kv_heads, parallel)
    q = Slice(0, parallel.tp_rank * heads * head_dim, heads * head_dim)
    kv = Slice(0, first_kv * head_dim, kv_heads * head_dim)
    return [q, kv, kv]
