"""Triton attention backend: paged extend and split-K decode kernels over the engine's KV pools."""
from __future__ import annotations

import torch

from kestrel.attention.triton.decode import (LengthAwareSplit, SplitPlan, decode_attention, length_aware_plan,
                                             uniform_splits)
from kestrel.attention.triton.extend import extend_attention
from kestrel.attention.triton.store import store_kv
from kestrel.cache.kv_memory import KVPools
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer


SPLIT_MAX_EXTEND = 16  # new tokens per request up to which the extend kernel splits the keys


class TritonBackend:
    """DECODE batches go to the split-K decode kernel; every other mode (verify trees included) to the
    extend kernel. `decode_split`: None splits every request of a decode batch alike (the uniform rule
    below); a LengthAwareSplit cuts each request by its own length (kestrel.attention.triton.decode)."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, upcast: bool, name: str = "triton",
                 decode_split: LengthAwareSplit | None = None) -> None:
        self.name = name
        self.pools = pools
        self.req_to_token = req_to_token
        self.upcast = upcast  # the interpreter computes bf16/fp16 dots wrong: upcast after load there
        self.decode_split = decode_split
        self._q_starts: torch.Tensor | None = None
        self._num_splits = 1
        self._split_plan: SplitPlan | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode is ForwardMode.DECODE:
            # Uniform rule: from the batch size alone (never from host-side lengths), so a captured graph
            # stays valid for every replay; a replay uses its padded bucket's split count, which may differ
            # from an eager step's, so the two agree to rounding, not bit for bit. The length-aware plan
            # reads the lengths on the device only, so a replay recomputes it from the step it serves.
            kv_heads = self.pools.layout.groups[0].buffers[0].shape[0]
            self._num_splits = uniform_splits(batch.batch_size, kv_heads)
            if self.upcast:  # the CPU interpreter runs programs one by one: 2 splits test the path without the cost
                self._num_splits = min(self._num_splits, 2)
            if self.decode_split is not None:  # device ops on the lengths, captured with the graph
                self._split_plan = length_aware_plan(batch.seq_lens, kv_heads, self.decode_split)
        else:
            self._q_starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:
        kv = self.pools.layer(layer.layer_id)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        table = self.req_to_token.table
        if batch.forward_mode is ForwardMode.DECODE:  # the decode kernel stores the new K/V itself
            decode_attention(q, k, v, kv.k, kv.v, out, table, batch.req_pool_indices, batch.seq_lens,
                             batch.out_cache_loc, layer.scaling, layer.sliding_window, self.upcast,
                             self._num_splits, kv.k_scale, kv.v_scale, split_plan=self._split_plan,
                             sinks=layer.sinks)
        else:
            store_kv(k, v, kv.k, kv.v, batch.out_cache_loc, kv.k_scale, kv.v_scale)
            tree = batch.tree_mask.view(torch.uint8) if batch.tree_mask is not None else None
            # A few new tokens per request (verify, draft extend, a decode-sized chunk): split the keys so
            # that about 256 programs run; like decode's split, from the batch's shape alone. The CPU
            # interpreter runs programs one by one: 2 splits there test the path without the cost.
            few = batch.max_extend <= SPLIT_MAX_EXTEND
            most = 2 if self.upcast else 16
            num_splits = max(1, min(most, 256 // (batch.batch_size * layer.num_heads))) if few else 1
            extend_attention(q, kv.k, kv.v, out, table, batch.req_pool_indices, batch.prefix_lens,
                             batch.extend_lens, self._q_starts, batch.max_extend, layer.scaling,
                             layer.sliding_window, self.upcast, tree, batch.tree_mask_starts, kv.k_scale, kv.v_scale,
                             block_m=16 if few else 64, num_splits=num_splits, sinks=layer.sinks)
        return out.view(-1, layer.num_heads * layer.head_dim)
