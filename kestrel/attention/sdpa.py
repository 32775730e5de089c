"""SDPA attention backend: prefill through torch's fused attention kernels (cuDNN, flash) on whole prompts.

For a prefill batch of few, long requests, one `scaled_dot_product_attention` call per request on
contiguous q/k/v runs torch's best kernel (on an H200, cuDNN is about twice the flash kernel and well
ahead of our paged Triton kernel). Every other batch goes to `fallback` (Triton where it runs, else
torch_native), so the backend serves every forward mode correctly and pays only where it helps.

Per batch (`takes_fast_path`): the fast path needs host lengths and no tree mask (a speculative
verify's mask is not causal); on CUDA it also needs at most `FAST_MAX_REQUESTS` requests with at least
`FAST_MIN_EXTEND` new tokens each, because each request costs its own launches (a batch of many short
prompts, or a MIXED batch with decodes, is one launch of the Triton kernel). On CPU the fallback is
the same per-request SDPA loop, so every eligible batch takes the fast path. Per layer: a sliding
window shorter than a sequence goes to the fallback too (the fused kernels here take only causal masks),
and so do a layer with attention sinks (gpt-oss: the fused kernels have no sink logit) and one whose K/V
are a window ring (kestrel.attention.window_ring).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kestrel.attention.torch_native import write_kv
from kestrel.cache.kv_memory import KVPools, window_ring
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer
from kestrel.quant.kv import from_pool

# From kestrel/bench/kernels/prefill_attention.py on the H200 (docs/benchmarks.md): this path costs ~0.13 ms per
# request and layer beyond the cuDNN call (storing K/V, layouts), so the Triton kernel's single launch
# wins at 1k new tokens (0.23 against 0.35 ms) and this path from about 1.5k on (4k: 0.47 against 0.88 ms).
FAST_MAX_REQUESTS = 8
FAST_MIN_EXTEND = 1536

# cuDNN first: on an H200 (torch 2.11) it runs causal GQA prefill at ~620 TFLOP/s, flash at ~320.
# A kernel that cannot take the call (e.g. a lower-right causal mask) passes it down the list.
CUDA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]


def takes_fast_path(batch: ForwardBatch, on_cuda: bool) -> bool:
    """Whether this batch runs through per-request SDPA (True) or the fallback backend (False)."""
    if batch.forward_mode is ForwardMode.DECODE:
        return False
    if batch.tree_mask is not None or batch.extend_lens_cpu is None:
        return False
    if not on_cuda:
        return True
    return len(batch.extend_lens_cpu) <= FAST_MAX_REQUESTS and min(batch.extend_lens_cpu) >= FAST_MIN_EXTEND


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """One request: q [extend, heads, D], k/v [prefix + extend, kv_heads, D] → [extend, heads, D]; query j
    sits at position prefix + j and sees keys 0..prefix + j (the causal mask aligned lower-right)."""
    extend, seq = q.shape[0], k.shape[0]
    mask, is_causal = None, False
    if prefix == 0:
        is_causal = extend > 1  # upper-left and lower-right agree on a square
    elif extend > 1:
        mask = causal_lower_right(extend, seq)  # dispatched to flash / efficient; materialized on CPU
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=is_causal,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


class SdpaBackend:
    """Serves every forward mode: EXTEND-like batches that pay go to per-request SDPA, the rest (and
    sliding-window layers) to `fallback`, which keeps its own stamp."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, fallback, on_cuda: bool,
                 name: str = "sdpa") -> None:
        self.name = name
        self.pools = pools
        self.req_to_token = req_to_token
        self.fallback = fallback
        self.on_cuda = on_cuda
        self._fast = False

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._fast = takes_fast_path(batch, self.on_cuda)
        self.fallback.init_forward_metadata(batch)  # sliding-window layers may need it even on the fast path

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:
        window = layer.sliding_window
        kv = self.pools.layer(layer.layer_id)
        # torch's fused kernels take no sink logit: a layer with attention sinks goes to the fallback, and
        # so does one whose K/V are a window ring (its fallback reads them).
        if not self._fast or layer.sinks is not None or window_ring(kv) is not None or \
                (window is not None and max(batch.seq_lens_cpu) > window):
            return self.fallback.forward(q, k, v, layer, batch)
        write_kv(kv, k, v, layer, batch.out_cache_loc)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        k = k.view(-1, layer.num_kv_heads, layer.head_dim)
        v = v.view(-1, layer.num_kv_heads, layer.head_dim)
        # The K/V in hand equal what the pool holds unless the pool rounds them (FP8): then read the pool,
        # so this backend sees the same values as every other one.
        exact_pool = kv.k.dtype == q.dtype
        out = torch.empty_like(q)
        start = 0
        with sdpa_kernel(CUDA_PRIORITY, set_priority=True) if self.on_cuda else nullcontext():
            for i, (prefix, extend, seq) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu,
                                                           batch.seq_lens_cpu)):
                end = start + extend
                if prefix == 0 and exact_pool:
                    ki, vi = k[start:end], v[start:end]
                else:  # a cached prefix (or an FP8 pool): gather the request's K/V from its slots
                    slots = self.req_to_token.table[batch.req_pool_indices[i], :seq]
                    ki, vi = from_pool(kv.k[slots], q.dtype, kv.k_scale), from_pool(kv.v[slots], q.dtype, kv.v_scale)
                out[start:end] = causal_attention(q[start:end], ki, vi, prefix, layer.scaling)
                start = end
        return out.view(-1, layer.num_heads * layer.head_dim)
