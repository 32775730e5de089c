"""The MTP (next-n) layer: target streams at t + embedding of token t+1 -> draft for t+2
(docs/design/deepseek-v4.md §5).

A full block (its attention sliding-window only in the released models, its MoE never hash-routed)
between the combine and its own hc_head + norm; embedding and lm head are the target's.
"""
from __future__ import annotations

import torch
from torch import nn

from kestrel.core.forward_batch import ForwardBatch
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.norm import RMSNorm
from kestrel.models.base import FeatureDraft
from kestrel.models.deepseek_v4.block import V4Block
from kestrel.models.deepseek_v4.config import V4Config
from kestrel.models.deepseek_v4.mhc import hc_head, hc_site_params


class MTPLayer(V4Block):
    """Layer id num_hidden_layers: its attention has its own sliding-window ring in the KV layout."""

    def __init__(self, cfg: V4Config, parallel: ParallelState = ParallelState()) -> None:
        super().__init__(cfg, cfg.num_hidden_layers, cfg.mtp_compress_ratio, hash_routing=False, parallel=parallel)
        d = cfg.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        hc_site_params(self, "hc_head", cfg, head=True)

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, next_embeds: torch.Tensor,
                positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """-> pre-hc_head streams [T, hc_mult, d]; `final_hidden` turns them into the lm head's input."""
        # Per stream: h_proj(hnorm(X_i)) + e_proj(enorm(E[x_{t+1}])), the e-term broadcast to all streams.
        X = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_embeds)).unsqueeze(1)
        return super().forward(X, next_ids, positions, batch)

    def final_hidden(self, X: torch.Tensor) -> torch.Tensor:
        return self.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg))


class MTPDraft(FeatureDraft):
    """A DeepSeek-V4 target's MTP layer as a NEXTN feature draft, in the shape a ModelRunner runs.

    forward(input_ids, positions, batch): the tokens at t + 1 and, in `batch.spec_features`, streams at
    t flat [T, hc_mult * d] (the target's pre-hc_head streams, or while drafting the MTP layer's own
    output at t - 1, as VLLM feeds them back) -> the MTP layer's streams, flat: they are both the next
    draft step's feature and what `compute_logits` reads. Weights are the target's (shared, not copied).
    """

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self.target = target
        self.config = target.config
        self.feature_size = target.config.hc_mult * target.config.hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert batch.spec_features is not None, "the MTP layer's forward needs the streams of its positions"
        return self.target.mtp_streams(batch.spec_features, input_ids, positions, batch).flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.mtp_logits(hidden)
