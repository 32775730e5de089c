"""The shared expert: a gated MLP every token runs beside its routed experts.

Its width is split like the routed experts' (over the `tp_size / ep_size` ranks that share an expert);
the ranks holding the same slice (one per expert-parallel rank) add it once between them, so the
layer's one all-reduce sums it with the routed experts (`adds` says whether this rank does)."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.linear import Slice
from kestrel.layers.moe.activation import gated
from kestrel.layers.moe.config import ExpertActivation


class SlicedLinear(nn.Linear):
    """A linear holding `slice` of its checkpoint weight (None: all of it); it communicates nothing."""

    def __init__(self, in_features: int, out_features: int, weight_slice: Slice | None) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.weight_slice = weight_slice

    def checkpoint_slice(self, param_name: str, shard_id: int | None) -> Slice | None:
        return self.weight_slice


class SharedExpert(nn.Module):
    """`w1` (gate) and `w3` (up) [inter, H], `w2` (down) [H, inter]: this rank's slice of the width."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: ExpertActivation,
                 parallel: ParallelState) -> None:
        super().__init__()
        split = parallel.tp_size // parallel.ep_size
        if intermediate_size % split:
            raise ValueError(f"the shared expert's intermediate size {intermediate_size} does not split over "
                             f"{split} tensor-parallel ranks (tp_size / ep_size)")
        inter, rank = intermediate_size // split, parallel.tp_rank // parallel.ep_size
        rows = Slice(0, rank * inter, inter) if split > 1 else None
        cols = Slice(1, rank * inter, inter) if split > 1 else None
        self.w1 = SlicedLinear(hidden_size, inter, rows)
        self.w3 = SlicedLinear(hidden_size, inter, rows)
        self.w2 = SlicedLinear(inter, hidden_size, cols)
        self.activation = activation
        self.adds = parallel.ep_rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(gated(self.w1(x), self.w3(x), self.activation))
