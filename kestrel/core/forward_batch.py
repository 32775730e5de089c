"""The tensors one model forward needs, built by the model runner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kestrel.core.forward_mode import ForwardMode

if TYPE_CHECKING:
    from kestrel.attention.base import AttentionBackend


@dataclass
class ForwardBatch:
    """Flattened batch: requests' new tokens are concatenated in request order.

    For request i: `prefix_lens[i]` tokens already have KV in the pool, `extend_lens[i]` new tokens
    are in this batch (1 for a decode), `seq_lens[i] = prefix_lens[i] + extend_lens[i]`. The new
    tokens' KV goes to `out_cache_loc`; all of request i's slots are in
    `req_to_token[req_pool_indices[i], :seq_lens[i]]` once this forward has run.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    # Host copies of the lengths; None in a CUDA-graph batch, whose lengths change between replays.
    seq_lens_cpu: list[int] | None
    prefix_lens_cpu: list[int] | None
    extend_lens_cpu: list[int] | None
    logits_indices: torch.Tensor  # [B] row of each request's last new token in the flat batch
    attn_backend: "AttentionBackend"

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]
