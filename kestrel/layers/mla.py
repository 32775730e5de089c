"""Multi-head Latent Attention (DeepSeek-V3) as the model sees it: queries and the compressed KV in, the
running MLA backend does the rest (docs/design/attention-backends.md §7).

The model computes, per new token, the query split into its no-rope part [T, heads, qk_nope_head_dim]
and its rotated rope part [T, heads, qk_rope_head_dim], and the compressed KV: the latent [T,
kv_lora_rank] after the KV norm and the rotated rope key [T, qk_rope_head_dim], which all heads share.
This layer holds the one weight attention needs beyond them: the up-projection `kv_b_proj` from a latent
to each head's no-rope key and value, [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] with
head h's key rows first, then its value rows (the checkpoint's `kv_b_proj.weight`, in the model dtype:
a block-scaled FP8 checkpoint's is dequantised before it is copied in).

The math, per head h with key rows W_UK[h] and value rows W_UV[h]:
    score(t, s) = scale * (q_nope[t,h] . W_UK[h] latent[s] + q_rope[t,h] . k_rope[s])
    out[t, h]   = W_UV[h] sum_s softmax(score)(t, s) latent[s]
Backends either up-project the latents to per-head keys and values (the MHA form) or fold W_UK into the
query and W_UV after the sum (the absorbed form): q_nope[t,h] @ W_UK[h] is a query in latent space.

Tensor parallelism: `num_heads` is this rank's heads, from `first_head`; the latent and the rope key
are whole on every rank (the KV layout is the same on every rank).
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention.mla.base import mla_backend
from kestrel.core.forward_batch import ForwardBatch
from kestrel.layers.linear import Slice


class MLAAttention(nn.Module):
    """`scaling`: the softmax scale, qk_head_dim^-0.5 times YaRN's mscale^2 where the config's rope
    scaling has `mscale_all_dim` (the model computes it)."""

    def __init__(self, layer_id: int, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scaling: float, first_head: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scaling = scaling
        self.first_head = first_head
        self.kv_b_proj = nn.Parameter(torch.empty(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank),
                                      requires_grad=False)

    def checkpoint_slice(self, param_name: str, shard_id: int | None) -> Slice:
        """This rank's heads' rows of the checkpoint's [all heads * (nope + v), kv_lora_rank] weight."""
        rows = self.qk_nope_head_dim + self.v_head_dim
        return Slice(0, self.first_head * rows, self.num_heads * rows)

    @property
    def w_uk(self) -> torch.Tensor:
        """[heads, qk_nope_head_dim, kv_lora_rank]: latent -> each head's no-rope key (a view)."""
        return self.kv_b_proj.view(self.num_heads, -1, self.kv_lora_rank)[:, :self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """[heads, v_head_dim, kv_lora_rank]: latent -> each head's value (a view)."""
        return self.kv_b_proj.view(self.num_heads, -1, self.kv_lora_rank)[:, self.qk_nope_head_dim:]

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q_nope [T, heads, nope], q_rope [T, heads, rope], latent [T, kv_lora_rank], k_rope [T, rope]
        -> [T, heads * v_head_dim]. Stores latent | k_rope at the new tokens' slots first."""
        return mla_backend(batch).forward_mla(q_nope, q_rope, latent, k_rope, self, batch)
