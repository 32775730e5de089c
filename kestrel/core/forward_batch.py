"""The tensors one model forward needs, built by the model runner (and those a caller hands it on the device)."""
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

    `tree_mask` (a verify step): request i's new tokens see its whole prefix, and among themselves
    new token a sees new token b iff `tree_mask[tree_mask_starts[i] + a * extend_lens[i] + b]`; None
    means causal. A backend that serves such a batch must honour it.
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
    max_extend: int  # the largest extend_len (fixed per graph: tokens per request)
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are computed
    attn_backend: "AttentionBackend"
    tree_mask: torch.Tensor | None = None  # flat bool, see above
    tree_mask_starts: torch.Tensor | None = None  # [B] int64
    capture_hidden: tuple[int, ...] = ()  # layers whose input hidden state the model keeps, in this order
    captured_hidden: torch.Tensor | None = None  # set by the model: [T, hidden * len(capture_hidden)]
    spec_features: torch.Tensor | None = None  # [T, F]: a draft head's feature input (kestrel.speculative)
    lora_slots: torch.Tensor | None = None  # [T] int64: each token's LoRA adapter slot, -1 none (kestrel.lora)

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class DeviceInputs:
    """Inputs of a forward that are already on the device (a draft's tokens, a verify tree's positions),
    replacing the ScheduledBatch's host lists so that building the batch never waits for the device."""

    input_ids: torch.Tensor | None = None  # [T] int64
    positions: torch.Tensor | None = None  # [T] int64
    features: torch.Tensor | None = None  # [T, F]: a draft head's feature input (ForwardBatch.spec_features)
