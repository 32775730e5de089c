"""One step's work as the scheduler hands it to the model runner: plain data, no Request objects.

The runner reads only these fields (a tensor-parallel rank can receive them as they are); `reqs` is
the engine's side of the same batch.
"""
from __future__ import annotations

import itertools
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
    full_logits: tuple[int, ...] = ()  # requests (batch indices) with logits at every new token (prompt logprobs)
    capture_hidden: tuple[int, ...] = ()  # layers whose input hidden states are returned (see ModelRunner)
    lora_slots: list[int] = field(default_factory=list)  # per request: its LoRA adapter's pool slot, -1 none
    reqs: list["Request"] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def logit_rows(self) -> list[int]:
        """Indices among the new tokens whose logits the forward returns, in order: every token with
        `logits_at_all_tokens`, else each request's last one and all of those of `full_logits` requests."""
        if self.logits_at_all_tokens:
            return list(range(self.num_tokens))
        ends = list(itertools.accumulate(self.extend_lens))
        if not self.full_logits:
            return [e - 1 for e in ends]
        full = set(self.full_logits)
        rows: list[int] = []
        for i, (end, n) in enumerate(zip(ends, self.extend_lens)):
            rows += range(end - n, end) if i in full else [end - 1]
        return rows

    def logit_spans(self) -> list[tuple[int, int]]:
        """(first row, number of rows) of each request in the logits of `logit_rows()`."""
        full = set(range(self.batch_size)) if self.logits_at_all_tokens else set(self.full_logits)
        spans, row = [], 0
        for i, n in enumerate(self.extend_lens):
            k = n if i in full else 1
            spans.append((row, k))
            row += k
        return spans
