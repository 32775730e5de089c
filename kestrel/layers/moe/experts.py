"""A layer's routed experts, stacked: this rank's share of them and of each one's width.

Expert parallelism puts `num_experts / ep_size` consecutive experts on each expert-parallel rank;
tensor parallelism of the experts splits each expert's intermediate width over the
`tp_size / ep_size` ranks that hold the same experts (the gate and up rows, and the down projection's
input columns, as a Llama MLP splits). The ranks' partial outputs are summed once, by the layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.moe.config import MoEConfig
from kestrel.layers.moe.loading import QWEN_EXPERTS, ExpertCheckpoint, ExpertLoader


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts (global ids `first` .. `first + count - 1`) and its slice of their
    intermediate width (`inter_start`, `inter` columns). `adds_down_bias`: the down projection's bias is
    added by one rank of those that share an expert's width, not by each."""

    first: int
    count: int
    inter_start: int
    inter: int
    adds_down_bias: bool

    @staticmethod
    def of(num_experts: int, intermediate_size: int, parallel: ParallelState) -> ExpertShard:
        ep, tp = parallel.ep_size, parallel.tp_size
        if num_experts % ep:
            raise ValueError(f"ep_size {ep} must divide the model's number of routed experts ({num_experts})")
        width_split = tp // ep  # ranks that share each expert, splitting its width
        if intermediate_size % width_split:
            raise ValueError(f"the experts' intermediate size {intermediate_size} does not split over the "
                             f"{width_split} tensor-parallel ranks that share each expert (tp_size {tp} / ep_size "
                             f"{ep}); use ep_size = tp_size or a tp_size that divides it")
        count, inter = num_experts // ep, intermediate_size // width_split
        width_rank = parallel.tp_rank // ep
        return ExpertShard(parallel.ep_rank * count, count, width_rank * inter, inter, width_rank == 0)


class Experts(nn.Module):
    """`w13` [count, 2 * inter, H]: each expert's gate rows, then its up rows; `w2` [count, H, inter];
    with expert biases `b13` [count, 2 * inter] (gate, then up) and `b2` [count, H]. In the model dtype
    (a quantised checkpoint is dequantised into them at load: `loading.py`). `checkpoint`: how the
    family's checkpoint names them."""

    def __init__(self, cfg: MoEConfig, parallel: ParallelState, checkpoint: ExpertCheckpoint = QWEN_EXPERTS) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.shard = ExpertShard.of(cfg.num_experts, cfg.intermediate_size, parallel)
        self.first, self.count = self.shard.first, self.shard.count
        self.num_experts = cfg.num_experts
        self.intermediate_size = cfg.intermediate_size
        count, inter, hidden = self.count, self.shard.inter, cfg.hidden_size
        self.w13 = nn.Parameter(torch.zeros(count, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.zeros(count, hidden, inter))
        self.b13 = nn.Parameter(torch.zeros(count, 2 * inter)) if cfg.expert_bias else None
        self.b2 = nn.Parameter(torch.zeros(count, hidden)) if cfg.expert_bias else None

    def tensor_loader(self) -> ExpertLoader:
        """What the model loader hands this module's checkpoint tensors to (names relative to it)."""
        return ExpertLoader(self, self.checkpoint)

    def down_bias(self) -> torch.Tensor | None:
        """`b2` where this rank adds it (see ExpertShard), else None."""
        return self.b2 if self.shard.adds_down_bias else None

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count
