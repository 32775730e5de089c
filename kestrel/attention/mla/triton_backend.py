"""The Triton backend's MLA form (docs/design/attention-backends.md §7).

DECODE batches: the absorbed split-K kernel (`kestrel/attention/triton/mla_decode.py`), which stores
the new entries itself. Every other mode (extend after a cached prefix, chunks, mixed batches, verify
trees, draft extend): the absorbed form too, through the MHA extend kernel, which sees the latent pool
as one KV head 576 values wide whose keys and values are the same entries ([c | k_r]); the output's
last rope_dim columns (a weighted sum of rope keys) are dropped. That reuses the extend kernel's tree
masks and paging unchanged, at the price of padding the head to the next power of two (1024 for
V3's 576) and of carrying the rope columns through the value side: simple and correct, not tuned.
"""
from __future__ import annotations

import torch

from kestrel.attention.mla.base import LatentAttentionBackend, absorb_query, project_output
from kestrel.attention.mla.torch_native import write_latent
from kestrel.attention.triton.extend import extend_attention
from kestrel.attention.triton.mla_decode import mla_decode_attention, mla_decode_splits
from kestrel.cache.kv_memory import KVPools
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.fp8_gemm_triton import sm_count
from kestrel.layers.mla import MLAAttention


class TritonMLABackend(LatentAttentionBackend):
    """`upcast`: the interpreter computes bf16/fp16 dots wrong, so kernels work in float32 there (and
    use 2 splits at most, testing the merge without the cost of running programs one by one)."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, upcast: bool, name: str = "triton") -> None:
        super().__init__(pools, req_to_token, name)
        self.upcast = upcast
        self._q_starts: torch.Tensor | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # A decode's split count comes from the batch size and the layer's heads (forward_mla): static.
        if batch.forward_mode is not ForwardMode.DECODE:
            self._q_starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                    layer: MLAAttention, batch: ForwardBatch) -> torch.Tensor:
        kv = self.pools.layer(layer.layer_id)
        rank = layer.kv_lora_rank
        q_lat = absorb_query(q_nope, layer)  # [T, heads, rank]
        table = self.req_to_token.table
        if batch.forward_mode is ForwardMode.DECODE:  # the kernel stores the new entries itself
            splits = mla_decode_splits(batch.batch_size, layer.num_heads, sm_count(q_lat.device))
            if self.upcast:
                splits = min(splits, 2)
            out = q_lat.new_empty(q_lat.shape)
            mla_decode_attention(q_lat, q_rope, torch.cat([latent, k_rope], dim=-1), kv.latent, out, table,
                                 batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, layer.scaling,
                                 self.upcast, splits, kv.latent_scale)
            return project_output(out, layer)
        write_latent(kv, latent, k_rope, batch.out_cache_loc)
        q = torch.cat([q_lat, q_rope], dim=-1)  # [T, heads, rank + rope]
        out = torch.empty_like(q)
        entries = kv.latent.unsqueeze(1)  # [slots, 1, rank + rope]: one KV head, keys = values
        tree = batch.tree_mask.view(torch.uint8) if batch.tree_mask is not None else None
        extend_attention(q, entries, entries, out, table, batch.req_pool_indices, batch.prefix_lens,
                         batch.extend_lens, self._q_starts, batch.max_extend, layer.scaling, None, self.upcast,
                         tree, batch.tree_mask_starts, kv.latent_scale, kv.latent_scale, block_m=16, block_n=16,
                         positions=batch.positions)
        return project_output(out[..., :rank], layer)
