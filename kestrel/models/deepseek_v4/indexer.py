"""The lightning indexer of ratio-4 layers: picks each query's top-k compressed blocks
(docs/design/deepseek-v4.md §2.6).

Its own compressor (ratio 4, overlap, width index_head_dim) makes the block keys K^I. The score of a
visible block i for query t is sum_h w_{t,h} ReLU(q^I_{t,h} . K^I_i). The Hadamard rotation and FP4
round-trip of the reference are quantisation-aware training details: the rotation is orthogonal, so
without the round-trip it leaves q . k unchanged and is left out.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention.dsv4 import DSV4Backend
from kestrel.models.deepseek_v4 import compressor as compressor_module
from kestrel.models.deepseek_v4.compressor import Compressor
from kestrel.models.deepseek_v4.config import V4Config
from kestrel.models.deepseek_v4.rope import V4Rope

RATIO = 4


class Indexer(nn.Module):
    def __init__(self, cfg: V4Config, rope: V4Rope, fused: bool = False) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.dim, RATIO, rope, cfg.rms_norm_eps,
                                     state=("idx_kv", "idx_score"), entries="idx_k", fused=fused)
        self.rope = rope
        self.weight_scale = (self.dim * self.heads) ** -0.5
        self.fused = fused

    def forward(self, x: torch.Tensor, c_q: torch.Tensor, positions: torch.Tensor, backend: DSV4Backend,
                layer_id: int) -> torch.Tensor:
        """[T, k]: each query's top-k visible blocks (ordinals in its request's blocks; -1 = none)."""
        self.compressor(x, positions, backend, layer_id)
        q = self.rope(self.wq_b(c_q).unflatten(-1, (self.heads, self.dim)), positions)
        buffer, slots, visible = backend.block_entries(layer_id, "idx_k", RATIO)
        n = slots.shape[1]
        k = min(self.topk, n)
        chosen = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=x.device)
        if k == 0:
            return chosen
        if (self.fused and compressor_module.DECODE_KERNEL and backend.decode_rows() is not None
                and buffer is not None and buffer.dtype == q.dtype):  # FP8 entries take the torch path
            from kestrel.models.deepseek_v4.triton_ops import index_scores  # triton is optional

            scores = index_scores(q, self.weights_proj(x), self.weight_scale, buffer, slots, visible)
            return _top_visible(scores, visible[:, None], k)
        weights = (self.weights_proj(x).float() * self.weight_scale).to(q.dtype)[:, None, :]  # [T, 1, heads]
        keys, _ = backend.read_blocks(layer_id, "idx_k", RATIO, q.dtype)  # [B, N, c]
        blocks = torch.arange(n, device=x.device)[None, :]
        per_token = self.heads * n * q.element_size() * 2 + n * 4 * 2 + n * self.dim * q.element_size()
        for a, b, r0, r1 in backend.query_tiles(per_token):
            if r1 - r0 == 1:  # one request: its keys once, not per query
                scores = (q[a:b].flatten(0, 1) @ keys[r0].T).view(b - a, self.heads, n)
            else:
                scores = torch.bmm(q[a:b], backend.per_token(keys, a, b, r0, r1).transpose(1, 2))
            # sum_h w_h ReLU(q_h . k): the ReLU sits between the two products, so [t, heads, n] is needed.
            scores = torch.bmm(weights[a:b], scores.relu_()).squeeze(1).float()  # [t, n]
            seen = visible[a:b, None]
            chosen[a:b] = _top_visible(scores.masked_fill(blocks >= seen, float("-inf")), seen, k)
        return chosen


def _top_visible(scores: torch.Tensor, seen: torch.Tensor, k: int) -> torch.Tensor:
    """The k best blocks of scores [t, n] (-inf past each query's `seen` [t, 1] blocks); topk fills up with
    invisible blocks when fewer than k are visible: those are "none" (-1)."""
    picked = scores.topk(k, dim=-1).indices
    return torch.where(picked < seen, picked, -1)
