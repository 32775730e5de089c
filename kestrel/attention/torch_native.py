"""Reference attention backend in plain PyTorch: correct on any device, one request at a time (a decode
batch in one call)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.attention.window_ring import flat, ring_slots, sub_step_tokens
from kestrel.cache.kv_memory import KVPools, LayerKV, window_ring
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer
from kestrel.quant.kv import from_pool, to_pool


class TorchNativeBackend:
    """Serves every forward mode: a decode is an extend of one token, so one code path covers all."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, name: str = "torch_native") -> None:
        self.name = name
        self.pools = pools
        self.req_to_token = req_to_token

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:
        kv = self.pools.layer(layer.layer_id)
        ring = window_ring(kv)
        if ring is not None:
            return self._ring_forward(q, k, v, kv, ring, layer, batch)
        write_kv(kv, k, v, layer, batch.out_cache_loc)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        if _one_call_decode(batch, layer):
            return self._decode(q, kv, layer, batch)
        out = torch.empty_like(q)
        group = layer.num_heads // layer.num_kv_heads
        start = 0
        for i, (prefix, extend, seq) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu,
                                                       batch.seq_lens_cpu)):
            slots = self.req_to_token.table[batch.req_pool_indices[i], :seq]
            # [heads, tokens, head_dim]; K/V repeated so each query head meets its KV head.
            qi = q[start:start + extend].transpose(0, 1)
            ki = from_pool(kv.k[slots], q.dtype, kv.k_scale).transpose(0, 1).repeat_interleave(group, dim=0)
            vi = from_pool(kv.v[slots], q.dtype, kv.v_scale).transpose(0, 1).repeat_interleave(group, dim=0)
            mask = causal_mask(prefix, extend, seq, layer.sliding_window, q.device)
            if batch.tree_mask is not None:
                tree = batch.tree_mask[batch.tree_mask_starts[i]:][:extend * extend].view(extend, extend)
                seen = torch.ones(extend, prefix, dtype=torch.bool, device=q.device)
                if layer.sliding_window is not None:  # a node sits at prefix + its depth
                    q_pos = batch.positions[start:start + extend, None]
                    seen = q_pos - torch.arange(prefix, device=q.device)[None, :] < layer.sliding_window
                mask = torch.cat([seen, tree], dim=1)
            qi, ki, vi = qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0)
            if layer.sinks is not None:
                ki, vi, mask = with_sinks(ki, vi, mask, layer.sinks, extend)
            out[start:start + extend] = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=layer.scaling)[0].transpose(0, 1)
            start += extend
        return out.view(-1, layer.num_heads * layer.head_dim)

    def _decode(self, q: torch.Tensor, kv: LayerKV, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """A decode batch in one SDPA call: every request's keys gathered up to the longest, the rest masked
        out. Per request, the loop above costs about ten small ops per layer, which at batch 8 on a CPU
        took longer than the model's matmuls."""
        longest = max(batch.seq_lens_cpu)
        slots = self.req_to_token.table[batch.req_pool_indices, :longest]  # [B, L]; past seq_len: unused
        k = from_pool(kv.k[slots], q.dtype, kv.k_scale).transpose(1, 2)  # [B, kv_heads, L, head_dim]
        v = from_pool(kv.v[slots], q.dtype, kv.v_scale).transpose(1, 2)
        seen = torch.arange(longest, device=q.device)[None, :] < batch.seq_lens[:, None]  # [B, L]
        mask = seen[:, None, None, :]
        if layer.sinks is not None:
            k, v, mask = with_sinks(k, v, mask, layer.sinks, 1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask,
                                             scale=layer.scaling, enable_gqa=True)  # [B, heads, 1, head_dim]
        return out.reshape(-1, layer.num_heads * layer.head_dim)


    def _ring_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, ring: int,
                      layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """A window layer whose K/V are per-request rings (kestrel.attention.window_ring): a decode batch
        in one call over each request's last `window` keys; anything else per request, in sub-steps
        that each write their keys, then read the window."""
        window, heads, D = layer.sliding_window, layer.num_heads, layer.head_dim
        k_ring, v_ring = flat(kv.k), flat(kv.v)
        k = to_pool(k.view(-1, layer.num_kv_heads, D), kv.k.dtype, kv.k_scale)
        v = to_pool(v.view(-1, layer.num_kv_heads, D), kv.v.dtype, kv.v_scale)
        q = q.view(-1, heads, D)
        rows = batch.req_pool_indices
        if batch.tree_mask is None and (batch.forward_mode is ForwardMode.DECODE or
                                        all(n == 1 for n in batch.extend_lens_cpu)):
            new = ring_slots(rows, batch.seq_lens - 1, ring)
            k_ring[new], v_ring[new] = k, v
            pos = batch.seq_lens[:, None] - window + torch.arange(window, device=q.device)[None, :]  # [B, W]
            slots = ring_slots(rows[:, None], pos.clamp(min=0), ring)
            keys = from_pool(k_ring[slots], q.dtype, kv.k_scale).transpose(1, 2)  # [B, kv_heads, W, D]
            values = from_pool(v_ring[slots], q.dtype, kv.v_scale).transpose(1, 2)
            mask = (pos >= 0)[:, None, None, :]
            if layer.sinks is not None:
                keys, values, mask = with_sinks(keys, values, mask, layer.sinks, 1)
            out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=layer.scaling,
                                                 enable_gqa=True)
            return out.reshape(-1, heads * D)
        out = torch.empty_like(q)
        group = heads // layer.num_kv_heads
        step = sub_step_tokens(ring, window)
        start = 0
        for i, (prefix, extend) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
            row = rows[i]
            for offset in range(0, extend, step):
                n, first = min(step, extend - offset), prefix + offset
                new = ring_slots(row, torch.arange(first, first + n, device=q.device), ring)
                k_ring[new], v_ring[new] = k[start + offset:start + offset + n], v[start + offset:start + offset + n]
                key_pos = torch.arange(max(0, first - window + 1), first + n, device=q.device)
                slots = ring_slots(row, key_pos, ring)
                q_pos = torch.arange(first, first + n, device=q.device)[:, None]
                mask = (key_pos[None, :] <= q_pos) & (q_pos - key_pos[None, :] < window)
                if batch.tree_mask is not None:  # a verify chain (n == extend; trees are refused over rings)
                    tree = batch.tree_mask[batch.tree_mask_starts[i]:][:n * n].view(n, n)
                    mask = torch.cat([mask[:, :key_pos.numel() - n], tree], dim=1)
                qi = q[start + offset:start + offset + n].transpose(0, 1).unsqueeze(0)
                ki = from_pool(k_ring[slots], q.dtype, kv.k_scale).transpose(0, 1).repeat_interleave(group, 0)[None]
                vi = from_pool(v_ring[slots], q.dtype, kv.v_scale).transpose(0, 1).repeat_interleave(group, 0)[None]
                if layer.sinks is not None:
                    ki, vi, mask = with_sinks(ki, vi, mask, layer.sinks, n)
                out[start + offset:start + offset + n] = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=layer.scaling)[0].transpose(0, 1)
            start += extend
        return out.view(-1, heads * D)


def with_sinks(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor,
               num_queries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key: k/v [B, kv_heads, L, D] get a zero key and value, and the mask
    (boolean, broadcastable to [B, heads, num_queries, L], or None) becomes an additive float mask
    [B, heads, num_queries, L + 1] whose last column is each head's sink. The zero key scores 0, so
    that column's logit is the sink itself, and its zero value adds nothing: softmax over keys and sink,
    the sink's share dropped."""
    batch, _, length, _ = k.shape
    heads = sinks.shape[0]
    zero = k.new_zeros(batch, k.shape[1], 1, k.shape[3])
    bias = torch.zeros(batch, heads, num_queries, length, dtype=k.dtype, device=k.device)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    sink = sinks.to(k.dtype).view(1, heads, 1, 1).expand(batch, heads, num_queries, 1)
    return torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2), torch.cat([bias, sink], dim=-1)


def _one_call_decode(batch: ForwardBatch, layer: AttentionLayer) -> bool:
    """One new token per request, no tree mask, no window cutting a sequence: `_decode` serves it."""
    if batch.tree_mask is not None or batch.seq_lens_cpu is None or len(batch.extend_lens_cpu) < 2:
        return False
    if any(n != 1 for n in batch.extend_lens_cpu):
        return False
    return layer.sliding_window is None or layer.sliding_window >= max(batch.seq_lens_cpu)


def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, slots: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads * head_dim]) at their pool slots, in the pool's dtype."""
    kv.k[slots] = to_pool(k.view(-1, layer.num_kv_heads, layer.head_dim), kv.k.dtype, kv.k_scale)
    kv.v[slots] = to_pool(v.view(-1, layer.num_kv_heads, layer.head_dim), kv.v.dtype, kv.v_scale)


def causal_mask(prefix: int, extend: int, seq: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [extend, seq]: query at position prefix+j sees keys at positions <= prefix+j (within the window)."""
    if extend == 1 and (window is None or window >= seq):
        return None
    q_pos = torch.arange(prefix, prefix + extend, device=device)[:, None]
    k_pos = torch.arange(seq, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask
