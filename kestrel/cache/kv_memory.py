"""The engine's KV memory: one slot space (allocator + req_to_token) and the pools of one or more models.

The target model's pools and a draft model's pools are built from their own `KVLayout`s over the same
slot space, so one slot index (and one `req_to_token` row) addresses a token's KV in both; a
tensor-parallel rank builds the same layouts for its shard. Attention backends reach a layer's tensors
through `KVPools.layer(layer_id)`.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.kv_layout import Indexing, KVLayout
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.config import CacheConfig


class LayerKV(SimpleNamespace):
    """One layer's KV tensors by buffer name (`layer.k`, `layer.v` for full attention), and each
    buffer's scale as `<name>_scale` (`layer.k_scale`: a float, what an FP8 entry is multiplied by), its
    codec as `<name>_codec` (None, or how its packed uint8 rows map to values) and its group's indexing
    as `<name>_indexing` (a REQUEST `k` is a sliding-window ring: `window_ring`)."""


def window_ring(kv: LayerKV) -> int | None:
    """The ring length of a layer whose K/V are per-request rings ([rows, ring, kv_heads, head_dim],
    position p at p mod ring; kestrel.cache.kv_layout), None for per-slot K/V."""
    return kv.k.shape[1] if kv.k_indexing is Indexing.REQUEST else None


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
                    setattr(kv, f"{buf.name}_scale", buf.scale)
                    setattr(kv, f"{buf.name}_codec", buf.codec)
                    setattr(kv, f"{buf.name}_indexing", group.indexing)

    def layer(self, layer_id: int) -> LayerKV:
        return self._layers[layer_id]

    def token_buffers(self) -> list[torch.Tensor]:
        """Every TOKEN-indexed tensor (what a KV move between slots must copy)."""
        names = [(layer, b.name) for g in self.layout.groups if g.indexing is Indexing.TOKEN
                 for layer in g.layer_ids for b in g.buffers]
        return [getattr(self._layers[layer], name) for layer, name in names]


class KVMemory:
    """Allocator, `req_to_token` and one `KVPools` per layout (the target's first, then e.g. a draft
    model's), all over the same slot space of `size` tokens (rounded down to pages)."""

    def __init__(self, layouts: list[KVLayout], size: int, page_size: int, max_requests: int, max_context: int,
                 device: torch.device | str, step_slack: int = 0, draft_scratch: int = 0) -> None:
        multiple = math.lcm(*(layout.page_multiple for layout in layouts))
        if page_size % multiple:
            raise ValueError(f"page_size {page_size} must be a multiple of {multiple} for this model's "
                             "compressed KV blocks")
        self.device = torch.device(device)
        self.allocator = TokenToKVPoolAllocator(size, page_size, self.device)
        num_slots = (self.allocator.num_pages + 1) * page_size  # + the reserved page 0
        # A request never holds more tokens than the pool or the context.
        self.max_req_len = min(max_context, self.allocator.size)
        # `step_slack`: positions a multi-token step may score past the last one kept (a verify tree's
        # nodes beyond the context); they get slots for that step only.
        self.req_to_token = ReqToTokenPool(max_requests, self.max_req_len + 1 + step_slack, self.device)
        # `draft_scratch`: slots past the slot space that only the draft pools have (the allocator never
        # hands them out): a speculative round's draft lanes write their throw-away KV there.
        self.scratch_base = num_slots
        self.pools = [KVPools(layout, num_slots + (draft_scratch if i else 0), max_requests + 1, self.device)
                      for i, layout in enumerate(layouts)]
        self.bytes_per_token = sum(layout.bytes_per_token for layout in layouts)
        self.bytes_per_request = sum(layout.bytes_per_request for layout in layouts)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV of slots `src` to slots `dst` (device tensors) in every pool (a KV rollback)."""
        for pools in self.pools:
            for buf in pools.token_buffers():
                buf[dst] = buf[src]


def pool_size(cache: CacheConfig, layouts: list[KVLayout], max_requests: int, device: torch.device) -> int:
    """KV slot space in tokens: `max_total_tokens` when set (always on CPU); on CUDA what is free after
    the weights, minus the share kept for activations, filled by the layouts (per-request state first).
    Blocks the caching allocator holds but no tensor uses (a closed Engine's pool, a training loop's
    activations in the same process) go back to the driver first, so they count as free."""
    if cache.max_total_tokens is not None:
        return cache.max_total_tokens
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = free - total * (1 - cache.mem_fraction_static)
    fixed = (max_requests + 1) * sum(layout.bytes_per_request for layout in layouts)
    tokens = int(max(0.0, budget - fixed) // sum(layout.bytes_per_token for layout in layouts))
    if tokens < cache.page_size:
        raise ValueError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free); "
                         "raise mem_fraction_static or set max_total_tokens")
    return tokens
