"""The multi-head latent attention layer as a model sees it: shapes in, the running backend does the work."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.core.forward_batch import ForwardBatch


class MLAAttentionLayer(nn.Module):
    """What an MLA backend needs to know about one layer: this rank's `num_heads`, the latent width
    (`kv_lora_rank`), each head's key (nope | rope) and value widths, and the softmax scale.

    forward: q_nope [T, heads, nope], q_rope [T, heads, rope] (rotated), latent [T, kv_lora_rank] (normed),
    k_rope [T, rope] (rotated), W_UK [heads, nope, kv_lora_rank], W_UV [heads, v, kv_lora_rank] ->
    [T, heads * v]. The backend stores [latent | k_rope] at the batch's slots and attends with head h's
    key [W_UK[h] latent | k_rope] and value W_UV[h] latent."""

    def __init__(self, layer_id: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id, self.num_heads, self.kv_lora_rank = layer_id, num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scaling = scaling

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                w_uk: torch.Tensor, w_uv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return batch.attn_backend.forward_mla(q_nope, q_rope, latent, k_rope, w_uk, w_uv, self, batch)
