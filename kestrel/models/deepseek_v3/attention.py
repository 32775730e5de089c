"""DeepSeek-V3's attention sublayer: the projections around multi-head latent attention (MLA).

Per token: q (through the q LoRA `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`, or one `q_proj`) split per
head into a nope part and a rope part; `kv_a_proj_with_mqa` gives the latent (normed by
`kv_a_layernorm`) and one rope key shared by every head. The latent and the rotated rope key are all
the KV cache holds; `kv_b_proj` holds each head's up-projections of the latent, to its key's nope part
(W_UK) and to its value (W_UV), which the MLA layer applies (absorbed into q and the output on decode).

Tensor parallelism splits the heads (q_b_proj / q_proj and kv_b_proj by rows, o_proj by columns); the
latent path (q_a_proj, kv_a_proj_with_mqa) is replicated, so every rank caches the same latent.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.core.forward_batch import ForwardBatch
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.linear import ColumnParallelLinear, Slice, row_parallel_linear
from kestrel.layers.mla import MLAAttention
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.deepseek_v3.config import V3Config


def head_rows(all_heads: int, rows_per_head: int, parallel: ParallelState) -> list[Slice] | None:
    """The rows of a by-head projection this rank holds; None at tp_size 1."""
    if parallel.tp_size == 1:
        return None
    if all_heads % parallel.tp_size:
        raise ValueError(f"num_attention_heads={all_heads} must be a multiple of tp_size={parallel.tp_size}")
    heads = all_heads // parallel.tp_size
    return [Slice(0, parallel.tp_rank * heads * rows_per_head, heads * rows_per_head)]


def by_heads(in_features: int, all_heads: int, rows_per_head: int, parallel: ParallelState) -> nn.Linear:
    """A column-parallel projection to this rank's heads (a plain linear at tp_size 1)."""
    slices = head_rows(all_heads, rows_per_head, parallel)
    if slices is None:
        return nn.Linear(in_features, all_heads * rows_per_head, bias=False)
    return ColumnParallelLinear(in_features, slices[0], bias=False)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope dims paired (0, 1), (2, 3), ... -> (i, i + d/2), the pairing `RotaryEmbedding` rotates. The
    same permutation of q's and k's rope dims leaves q . k unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class V3Attention(nn.Module):
    """forward: positions [T], hidden [T, H] -> [T, H], summed over the ranks."""

    def __init__(self, cfg: V3Config, layer_id: int, rotary: RotaryEmbedding, parallel: ParallelState,
                 fused: bool = False) -> None:
        super().__init__()
        all_heads = cfg.num_attention_heads
        self.heads = all_heads // parallel.tp_size
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.interleaved = cfg.kv_lora_rank, cfg.rope_interleave
        if cfg.q_lora_rank is None:
            self.q_proj = by_heads(cfg.hidden_size, all_heads, cfg.qk_head_dim, parallel)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, use_triton=fused)
            self.q_b_proj = by_heads(cfg.q_lora_rank, all_heads, cfg.qk_head_dim, parallel)
        self.q_lora = cfg.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, use_triton=fused)
        self.o_proj = row_parallel_linear(all_heads * cfg.v_head_dim, cfg.hidden_size, False, parallel)
        self.rotary_emb = rotary
        # kv_b_proj (W_UK | W_UV per head) lives on the MLA layer: `self_attn.attn.kv_b_proj`.
        self.attn = MLAAttention(layer_id, self.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                 cfg.kv_lora_rank, cfg.softmax_scale, first_head=parallel.tp_rank * self.heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.q_lora else self.q_proj(hidden)
        q_nope, q_rope = q.view(-1, self.heads, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        rope_in = torch.cat([q_rope, k_rope.unsqueeze(1)], dim=1)  # one rope call rotates q's heads and k
        if self.interleaved:
            rope_in = deinterleave(rope_in)
        rotated = self.rotary_emb(positions, rope_in.flatten(1)).view(-1, self.heads + 1, self.rope_dim)
        q_rope, k_rope = rotated[:, :self.heads], rotated[:, self.heads]
        return self.o_proj(self.attn(q_nope, q_rope, latent, k_rope, batch))
