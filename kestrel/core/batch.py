"""One step's work as the scheduler hands it to the model runner: plain data, no Request objects.

The runner reads only these fields (a tensor-parallel rank can receive them as they are); `reqs` is
the engine's side of the same batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kestrel.core.forward_mode import ForwardMode

if TYPE_CHECKING:
    from kestrel.core.request import Request


@dataclass
class ScheduledBatch:
    """Request i has `prefix_lens[i]` tokens with KV and `extend_lens[i]` new ones in this step (1 for a
    plain decode, several for a verify or a prefill chunk); its new tokens are concatenated into
    `input_ids` / `positions` / `out_cache_loc` in request order.

    `table_writes` ([3, W] int64 on the host: row, column, slot) are the `req_to_token` entries that
    changed since the previous batch (this step's new slots, a radix hit's prefix, a KV rollback) and
    `kv_moves` the KV copies a rollback needs; the runner applies both before the forward, so device
    memory is only ever written in stream order.
    """

    mode: ForwardMode
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]  # a token still on the device is -1 - its FutureTokens index
    positions: list[int]
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64 on the host
    table_writes: torch.Tensor  # [3, W] int64 on the host
    kv_moves: torch.Tensor  # [2, M] int64 on the host: KV to copy from slot [0] to slot [1] first (rollback)
    num_prefill: int = 0  # the first num_prefill requests are prefill work, the rest decodes
    # Over each request's new tokens, [n_i, n_i] bool flattened and concatenated: new token a sees new
    # token b iff mask[a, b] (a verify tree). None: causal among the new tokens.
    tree_mask: torch.Tensor | None = None
    logits_at_all_tokens: bool = False  # False: logits at each request's last new token only
    capture_hidden: tuple[int, ...] = ()  # layers whose input hidden states are returned (see ModelRunner)
    reqs: list["Request"] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
