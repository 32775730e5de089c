"""The Triton backend's MLA form (docs/design/attention-backends.md §7).

DECODE batches: the absorbed split-K kernel (`kestrel/attention/triton/mla_decode.py`), which stores
the new entries itself. Every other mode (extend after a cached prefix, chunks, mixed batches, verify
trees, draft extend) runs the MHA extend kernel, in one of two forms:
- the MHA form, where the batch's whole context fits MHA_EXTEND_MAX (context tokens x heads): the
  context's latents are read back from the pool once per layer and up-projected to per-head keys
  (nope | the shared rope key, 192 wide for V3) and values (128, zero-padded to the key width), in a
  scratch buffer that a per-batch table addresses; the kernel then pads the head to 256. A prefill's
  pairs cost a quarter of the absorbed form's, and the up-projection is one GEMM over the context;
- the absorbed form otherwise (a short chunk after a long cached prefix, where up-projecting the prefix
  would cost more memory than it saves, and a verify captured in a CUDA graph, which has no host
  lengths): the latent pool seen as one KV head 576 values wide whose keys and values are the same
  entries ([c | k_r]), the output's last rope_dim columns (a weighted sum of rope keys) dropped; the head
  is padded to 1024, with the rope columns carried through the value side.
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
from kestrel.quant.kv import from_pool

# The largest (context tokens x this rank's heads) an extend batch up-projects (the MHA form): its keys and
# values take ~1 KB per (token, head) in bf16 for V3's widths, so 2**21 is ~2 GiB of scratch at the most,
# freed layer by layer (16k tokens of context at V3's 128 heads; 128k at 16 heads a rank under TP 8).
MHA_EXTEND_MAX = 2 ** 21


class TritonMLABackend(LatentAttentionBackend):
    """`upcast`: the interpreter computes bf16/fp16 dots wrong, so kernels work in float32 there (and
    use 2 splits at most, testing the merge without the cost of running programs one by one)."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, upcast: bool, name: str = "triton") -> None:
        super().__init__(pools, req_to_token, name)
        self.upcast = upcast
        self._q_starts: torch.Tensor | None = None
        self._context: tuple[torch.Tensor, torch.Tensor] | None = None  # context_rows of an extend batch

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # A decode's split count comes from the batch size and the layer's heads (forward_mla): static.
        if batch.forward_mode is not ForwardMode.DECODE:
            self._q_starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
            # A batch captured into a CUDA graph (a verify of a few tokens) has no host lengths: the
            # absorbed form serves it, with static shapes.
            self._context = (context_rows(self.req_to_token.table, batch) if batch.seq_lens_cpu is not None
                             else None)

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                    layer: MLAAttention, batch: ForwardBatch) -> torch.Tensor:
        kv = self.pools.layer(layer.layer_id)
        rank = layer.kv_lora_rank
        table = self.req_to_token.table
        if batch.forward_mode is ForwardMode.DECODE:  # the kernel stores the new entries itself
            q_lat = absorb_query(q_nope, layer)  # [T, heads, rank]
            splits = mla_decode_splits(batch.batch_size, layer.num_heads, sm_count(q_lat.device))
            if self.upcast:
                splits = min(splits, 2)
            out = q_lat.new_empty(q_lat.shape)
            mla_decode_attention(q_lat, q_rope, torch.cat([latent, k_rope], dim=-1), kv.latent, out, table,
                                 batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, layer.scaling,
                                 self.upcast, splits, kv.latent_scale)
            return project_output(out, layer)
        write_latent(kv, latent, k_rope, batch.out_cache_loc)
        if self._context is not None and self._context[0].numel() * layer.num_heads <= MHA_EXTEND_MAX:
            slots, rows = self._context
            return self._extend_mha(q_nope, q_rope, from_pool(kv.latent[slots], q_nope.dtype, kv.latent_scale),
                                    rows, layer, batch)
        q = torch.cat([absorb_query(q_nope, layer), q_rope], dim=-1)  # [T, heads, rank + rope]
        out = torch.empty_like(q)
        entries = kv.latent.unsqueeze(1)  # [slots, 1, rank + rope]: one KV head, keys = values
        tree = batch.tree_mask.view(torch.uint8) if batch.tree_mask is not None else None
        extend_attention(q, entries, entries, out, table, batch.req_pool_indices, batch.prefix_lens,
                         batch.extend_lens, self._q_starts, batch.max_extend, layer.scaling, None, self.upcast,
                         tree, batch.tree_mask_starts, kv.latent_scale, kv.latent_scale, block_m=16, block_n=16,
                         positions=batch.positions)
        return project_output(out[..., :rank], layer)

    def _extend_mha(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor, rows: torch.Tensor,
                    layer: MLAAttention, batch: ForwardBatch) -> torch.Tensor:
        """The MHA form over the context's `entries` [N, rank + rope] (request after request, `rows` [B, L]
        their indices): per-head keys [N, heads, nope + rope] and values [N, heads, v] (padded to the key
        width: the kernel takes one head size) -> [T, heads * v]."""
        rank, heads, nope, v_dim = layer.kv_lora_rank, layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim
        width = nope + layer.qk_rope_head_dim
        up = (entries[:, :rank] @ layer.kv_b_proj.to(entries.dtype).t()).view(-1, heads, nope + v_dim)
        k = torch.cat([up[..., :nope], entries[:, None, rank:].expand(-1, heads, -1)], dim=-1)
        v = up.new_zeros(up.shape[0], heads, width)
        v[..., :v_dim] = up[..., nope:]
        q = torch.cat([q_nope, q_rope], dim=-1)  # [T, heads, nope + rope]
        out = torch.empty_like(q)
        tree = batch.tree_mask.view(torch.uint8) if batch.tree_mask is not None else None
        requests = torch.arange(rows.shape[0], device=rows.device)
        extend_attention(q, k, v, out, rows, requests, batch.prefix_lens, batch.extend_lens, self._q_starts,
                         batch.max_extend, layer.scaling, None, self.upcast, tree, batch.tree_mask_starts,
                         block_m=32, block_n=32, positions=batch.positions)
        return out[..., :v_dim].reshape(out.shape[0], heads * v_dim)


def context_rows(table: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool slots of every request's whole context (prefix and new tokens), request after request,
    [N]; and a table [B, longest] that addresses them: row i, position p -> the index of request i's
    position p in that list (past a request's length: 0, never read)."""
    lens = batch.seq_lens_cpu
    longest = max(lens)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], device=table.device, dtype=torch.int64)
    positions = torch.arange(longest, device=table.device)
    seen = positions[None, :] < torch.tensor(lens, device=table.device)[:, None]
    rows = torch.where(seen, starts[:, None] + positions[None, :], 0).to(table.dtype)
    slots = table[batch.req_pool_indices][:, :longest][seen]
    return slots, rows

