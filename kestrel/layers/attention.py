"""The attention layer as the model sees it: shapes in, the running backend does the work."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.core.forward_batch import ForwardBatch
from kestrel.layers.linear import Slice


class AttentionLayer(nn.Module):
    """Holds what a backend needs to know about one layer. Its only weight is the optional per-head
    attention sink (gpt-oss): a learned logit that joins every query's softmax denominator and
    attends to nothing, so a head can put weight on "no key" (`sinks` [num_heads], this rank's heads)."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, sliding_window: int | None = None, sinks: bool = False, first_head: int = 0) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        # A query at position i sees keys at positions j with i - j < sliding_window.
        self.sliding_window = sliding_window
        # float32: the sink is compared with float32 softmax logits in every backend.
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False) if sinks else None
        self.first_head = first_head  # this rank's first query head (tensor parallelism): where its sinks lie

    def checkpoint_slice(self, param_name: str, shard_id: int | None) -> Slice:
        """This rank's heads' sinks in the checkpoint's [all heads] tensor."""
        return Slice(0, self.first_head, self.num_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return batch.attn_backend.forward(q, k, v, self, batch)
