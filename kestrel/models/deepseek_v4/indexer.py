"""The lightning indexer of ratio-4 layers (spec §2.6): picks each query's top-k compressed blocks.

Its own compressor (ratio 4, overlap, width index_head_dim) makes the block keys K^I. The score of a
visible block i for query t is sum_h w_{t,h} ReLU(q^I_{t,h} . K^I_i). The Hadamard rotation and FP4
round-trip of the reference are quantisation-aware training details: the rotation is orthogonal, so
without the round-trip it leaves q . k unchanged and is left out.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention.dsv4 import DSV4Backend
from kestrel.models.deepseek_v4.compressor import Compressor
from kestrel.models.deepseek_v4.config import V4Config
from kestrel.models.deepseek_v4.rope import V4Rope

RATIO = 4


class Indexer(nn.Module):
    def __init__(self, cfg: V4Config, rope: V4Rope) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.dim, RATIO, rope, cfg.rms_norm_eps,
                                     state=("idx_kv", "idx_score"), entries="idx_k")
        self.rope = rope
        self.weight_scale = (self.dim * self.heads) ** -0.5

    def forward(self, x: torch.Tensor, c_q: torch.Tensor, positions: torch.Tensor, backend: DSV4Backend,
                layer_id: int) -> list[torch.Tensor]:
        """Per request, bool [extend, seq // 4]: the blocks each new query attends to."""
        self.compressor(x, positions, backend, layer_id)
        q = self.rope(self.wq_b(c_q).unflatten(-1, (self.heads, self.dim)), positions).float()
        weights = self.weights_proj(x).float() * self.weight_scale
        chosen = []
        for span, keys in zip(backend.spans, backend.read_blocks(layer_id, "idx_k", RATIO)):
            n = keys.shape[0]
            scores = torch.einsum("thc,bc->thb", q[span.tokens], keys.float()).relu()
            scores = (weights[span.tokens, :, None] * scores).sum(1)  # [extend, blocks]
            visible = (positions[span.tokens, None] + 1) // RATIO
            blocks = torch.arange(n, device=x.device)[None, :]
            scores = scores.masked_fill(blocks >= visible, float("-inf"))
            picked = scores.topk(min(self.topk, n), dim=-1).indices
            # topk fills up with invisible blocks when fewer than k are visible: send those to a spare column.
            picked = torch.where(picked < visible, picked, n)
            mask = torch.zeros(span.extend, n + 1, dtype=torch.bool, device=x.device)
            chosen.append(mask.scatter_(1, picked, True)[:, :n])
        return chosen
