"""The engine's KV memory: one slot space (allocator + req_to_token) and the pools of one or more models.

The target model's pools and a draft model's pools are built from their own `KVLayout`s over the same
slot space, so one slot index (and one `req_to_token` row) addresses a token's KV in both. Attention
backends reach a layer's tensors through `KVPools.layer(layer_id)`.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.kv_layout import Indexing, KVLayout
from kestrel.cache.req_to_token import ReqToTokenPool

logger = logging.getLogger(__name__)


class LayerKV(SimpleNamespace):
    """One layer's KV tensors by buffer name (`layer.k`, `layer.v` for full attention)."""


class KVPools:
    """The tensors of one layout. TOKEN buffers: [num_slots, *shape]; BLOCK: [num_slots // ratio, *shape];
    REQUEST: [num_rows, *shape]. Slot 0's page and the padding row are never handed out, so padded
    entries of a CUDA-graph batch may write there."""

    def __init__(self, layout: KVLayout, num_slots: int, num_rows: int, device: torch.device | str) -> None:
        self.layout = layout
        self._layers: dict[int, LayerKV] = {}
        for group in layout.groups:
            entries = {Indexing.TOKEN: num_slots, Indexing.BLOCK: num_slots // group.ratio,
                       Indexing.REQUEST: num_rows}[group.indexing]
            for layer in group.layer_ids:
                kv = self._layers.setdefault(layer, LayerKV())
                for buf in group.buffers:
                    setattr(kv, buf.name, torch.zeros((entries, *buf.shape), dtype=buf.dtype, device=device))

    def layer(self, layer_id: int) -> LayerKV:
        return self._layers[layer_id]

    def token_buffers(self) -> list[torch.Tensor]:
        """Every TOKEN-indexed tensor (what a KV move between slots must copy)."""
        names = [(layer, b.name) for g in self.layout.groups if g.indexing is Indexing.TOKEN
                 for layer in g.layer_ids for b in g.buffers]
        return [getattr(self._layers[layer], name) for layer, name in names]


class KVMemory:
    """Allocator, `req_to_token` and pools, sized once from the memory budget.

    `size` tokens of slot space (rounded down to pages); `pools` is the target's; `add_pools()` builds a
    draft model's over the same slots.
    """

    def __init__(self, layout: KVLayout, size: int, page_size: int, max_requests: int, max_context: int,
                 device: torch.device | str) -> None:
        if page_size % layout.page_multiple:
            raise ValueError(f"page_size {page_size} must be a multiple of {layout.page_multiple} for this "
                             "model's compressed KV blocks")
        self.device = torch.device(device)
        self.allocator = TokenToKVPoolAllocator(size, page_size, self.device)
        self.num_slots = (self.allocator.num_pages + 1) * page_size  # + the reserved page 0
        # A request never holds more tokens than the pool or the context.
        self.max_req_len = min(max_context, self.allocator.size)
        self.req_to_token = ReqToTokenPool(max_requests, self.max_req_len + 1, self.device)
        self.pools = self.add_pools(layout)

    def add_pools(self, layout: KVLayout) -> KVPools:
        if self.allocator.page_size % layout.page_multiple:
            raise ValueError(f"page_size {self.allocator.page_size} must be a multiple of {layout.page_multiple}")
        return KVPools(layout, self.num_slots, self.req_to_token.max_requests + 1, self.device)

    @staticmethod
    def tokens_for_budget(layouts: list[KVLayout], budget_bytes: float, max_requests: int) -> int:
        """Slot-space size that the layouts' pools fill `budget_bytes` with (per-request state first)."""
        per_token = sum(layout.bytes_per_token for layout in layouts)
        fixed = (max_requests + 1) * sum(layout.bytes_per_request for layout in layouts)
        return int(max(0.0, budget_bytes - fixed) // per_token)
