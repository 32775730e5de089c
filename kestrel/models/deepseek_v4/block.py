"""One V4 decoder block: attention and MoE sublayers, each between its own mHC pre/post
(docs/design/deepseek-v4.md §3)."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.core.forward_batch import ForwardBatch
from kestrel.layers.norm import RMSNorm
from kestrel.models.deepseek_v4.attention import V4Attention
from kestrel.models.deepseek_v4.config import V4Config
from kestrel.models.deepseek_v4.mhc import hc_post, hc_pre, hc_site_params
from kestrel.distributed.parallel_state import ParallelState
from kestrel.models.deepseek_v4.moe import v4_moe


class V4Block(nn.Module):
    """Attention and MoE sublayers, each between its own mHC pre/post."""

    def __init__(self, cfg: V4Config, layer_id: int, ratio: int, hash_routing: bool,
                 parallel: ParallelState = ParallelState(), fused: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=fused)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_triton=fused)
        hc_site_params(self, "hc_attn", cfg)
        hc_site_params(self, "hc_ffn", cfg)
        self.attn = V4Attention(cfg, layer_id, ratio, fused)
        self.ffn = v4_moe(cfg, hash_routing, parallel)

    def forward(self, X: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Streams X [T, hc_mult, d] -> the same after both sublayers."""
        x, post, comb = hc_pre(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        X = hc_post(self.attn(self.attn_norm(x), positions, batch), X, post, comb)
        x, post, comb = hc_pre(X, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        return hc_post(self.ffn(self.ffn_norm(x), input_ids), X, post, comb)
