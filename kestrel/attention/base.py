"""The interface every attention backend implements."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kestrel.core.forward_batch import ForwardBatch
    from kestrel.layers.attention import AttentionLayer


class AttentionBackend(Protocol):
    """Writes the new tokens' K/V into the KV pool and attends over each request's KV.

    `name` is the stamp: what this object really is (set by its factory, never taken from the
    config), so per-forward code can ask the running backend instead of the launch flags.
    """

    name: str

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        """Prepare per-batch metadata once, before the layers run."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "AttentionLayer",
                batch: "ForwardBatch") -> torch.Tensor:
        """q: [T, num_heads * head_dim], k/v: [T, num_kv_heads * head_dim] → [T, num_heads * head_dim]."""
