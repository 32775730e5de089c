"""Triton attention backend: paged extend and split-K decode kernels over the shared KV pool."""
from __future__ import annotations

import torch

from kestrel.attention.triton.decode import decode_attention
from kestrel.attention.triton.extend import extend_attention
from kestrel.attention.triton.store import store_kv
from kestrel.cache.kv_pool import KVPool
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer


class TritonBackend:
    """DECODE batches go to the split-K decode kernel; every other mode to the extend kernel."""

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, upcast: bool,
                 name: str = "triton") -> None:
        self.name = name
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.upcast = upcast  # the interpreter computes bf16/fp16 dots wrong: upcast after load there
        self._q_starts: torch.Tensor | None = None
        self._max_extend = 0
        self._num_splits = 1

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode is ForwardMode.DECODE:
            # Split each sequence so that about 128 programs run (the GPU has 132 SMs). Derived from the
            # batch size alone (never from lengths), so a captured graph stays valid for every replay; a
            # replay uses its padded bucket's split count, which may differ from an eager step's, so the
            # two agree to rounding, not bit for bit.
            kv_heads = self.kv_pool.k_buffers[0].shape[1]
            self._num_splits = max(1, min(16, 128 // (batch.batch_size * kv_heads)))
        else:
            self._q_starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
            self._max_extend = max(batch.extend_lens_cpu)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:
        k_buf = self.kv_pool.k_buffers[layer.layer_id]
        v_buf = self.kv_pool.v_buffers[layer.layer_id]
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        table = self.req_to_token.table
        if batch.forward_mode is ForwardMode.DECODE:  # the decode kernel stores the new K/V itself
            decode_attention(q, k, v, k_buf, v_buf, out, table, batch.req_pool_indices, batch.seq_lens,
                             batch.out_cache_loc, layer.scaling, layer.sliding_window, self.upcast,
                             self._num_splits)
        else:
            store_kv(k, v, k_buf, v_buf, batch.out_cache_loc)
            extend_attention(q, k_buf, v_buf, out, table, batch.req_pool_indices, batch.prefix_lens,
                             batch.extend_lens, self._q_starts, self._max_extend, layer.scaling,
                             layer.sliding_window, self.upcast)
        return out.view(-1, layer.num_heads * layer.head_dim)
