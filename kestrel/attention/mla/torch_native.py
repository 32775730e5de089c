"""Reference MLA backend in plain PyTorch: correct on any device, every forward mode.

A batch of one new token per request (DECODE, and a draft's decode lanes) runs in the absorbed form, in
one call over the batch's latents gathered up to the longest row. Every other batch (EXTEND, MIXED,
verify trees, draft extend) runs one request at a time in the MHA form: the request's cached latents
up-projected to per-head keys and values, then causal (or tree-masked) softmax attention, as the model
is written. Both read every latent back from the pool, the new tokens' included, so an FP8 pool's
rounding is seen the same way by every backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.attention.mla.base import LatentAttentionBackend, absorb_query, project_output
from kestrel.attention.torch_native import causal_mask
from kestrel.cache.kv_memory import LayerKV
from kestrel.core.forward_batch import ForwardBatch
from kestrel.layers.mla import MLAAttention
from kestrel.quant.kv import from_pool, to_pool


class TorchNativeMLABackend(LatentAttentionBackend):
    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                    layer: MLAAttention, batch: ForwardBatch) -> torch.Tensor:
        kv = self.pools.layer(layer.layer_id)
        write_latent(kv, latent, k_rope, batch.out_cache_loc)
        if _one_token_each(batch):
            return self._decode(q_nope, q_rope, kv, layer, batch)
        out = q_nope.new_empty(q_nope.shape[0], layer.num_heads, layer.v_head_dim)
        rank = layer.kv_lora_rank
        start = 0
        for i, (prefix, extend, seq) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu,
                                                       batch.seq_lens_cpu)):
            slots = self.req_to_token.table[batch.req_pool_indices[i], :seq]
            entries = from_pool(kv.latent[slots], q_nope.dtype, kv.latent_scale)  # [seq, rank + rope]
            k_nope = torch.einsum("sr,hnr->hsn", entries[:, :rank], layer.w_uk.to(q_nope.dtype))
            v = torch.einsum("sr,hvr->hsv", entries[:, :rank], layer.w_uv.to(q_nope.dtype))
            k = torch.cat([k_nope, entries[None, :, rank:].expand(layer.num_heads, -1, -1)], dim=-1)
            q = torch.cat([q_nope[start:start + extend], q_rope[start:start + extend]], dim=-1).transpose(0, 1)
            mask = causal_mask(prefix, extend, seq, None, q.device)
            if batch.tree_mask is not None:
                tree = batch.tree_mask[batch.tree_mask_starts[i]:][:extend * extend].view(extend, extend)
                mask = torch.cat([torch.ones(extend, prefix, dtype=torch.bool, device=q.device), tree], dim=1)
            out[start:start + extend] = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=layer.scaling).transpose(0, 1)
            start += extend
        return out.reshape(-1, layer.num_heads * layer.v_head_dim)

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv: LayerKV, layer: MLAAttention,
                batch: ForwardBatch) -> torch.Tensor:
        """Absorbed: every head of a request attends to its latents as one shared key/value head."""
        rank = layer.kv_lora_rank
        longest = max(batch.seq_lens_cpu)
        slots = self.req_to_token.table[batch.req_pool_indices, :longest]  # [B, L]; past seq_len: unused
        entries = from_pool(kv.latent[slots], q_nope.dtype, kv.latent_scale)  # [B, L, rank + rope]
        q = torch.cat([absorb_query(q_nope, layer), q_rope], dim=-1)  # [B, heads, rank + rope]
        seen = torch.arange(longest, device=q.device)[None, :] < batch.seq_lens[:, None]  # [B, L]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), entries.unsqueeze(1), entries[..., :rank].unsqueeze(1),
                                             attn_mask=seen[:, None, None, :], scale=layer.scaling, enable_gqa=True)
        return project_output(out[:, :, 0], layer)


def _one_token_each(batch: ForwardBatch) -> bool:
    """One new token per request and no tree mask: the batched absorbed path serves it."""
    return (batch.tree_mask is None and batch.seq_lens_cpu is not None
            and all(n == 1 for n in batch.extend_lens_cpu))


def write_latent(kv: LayerKV, latent: torch.Tensor, k_rope: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the new tokens' entries (latent [T, rank] | k_rope [T, rope]) at their slots, in the pool's dtype."""
    kv.latent[slots] = to_pool(torch.cat([latent, k_rope], dim=-1), kv.latent.dtype, kv.latent_scale)
