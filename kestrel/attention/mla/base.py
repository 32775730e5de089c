"""What every MLA backend shares: the latent pool it reads, how the model reaches it, the absorbed
query and output (docs/design/attention-backends.md §7).

An MLA backend serves layers of `kestrel.layers.mla.MLAAttention` over a `KVLayout.latent_attention`
pool: `init_forward_metadata(batch)` as every backend, and `forward_mla(q_nope, q_rope, latent, k_rope,
layer, batch)` in place of `forward(q, k, v, ...)`, whose per-head K/V an MLA model never forms.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kestrel.attention.hybrid import HybridBackend
from kestrel.cache.kv_memory import KVPools
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from kestrel.layers.mla import MLAAttention


class LatentAttentionBackend:
    """The base of the MLA backends (stamped with their registry names, as every backend)."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, name: str) -> None:
        if not pools.layout.latent:
            raise ValueError(f"the MLA form of {name!r} needs a latent KV layout (KVLayout.latent_attention)")
        self.name = name
        self.pools = pools
        self.req_to_token = req_to_token

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, batch: ForwardBatch) -> torch.Tensor:
        raise TypeError(f"the MLA form of {self.name!r} serves MLAAttention layers only (forward_mla); "
                        "this model has per-head K/V")

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                    layer: "MLAAttention", batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError


def mla_backend(batch: ForwardBatch) -> LatentAttentionBackend:
    """The batch's MLA backend (the half serving its forward mode, when prefill and decode differ)."""
    backend = batch.attn_backend
    if isinstance(backend, HybridBackend):
        backend = backend.backend_for(batch.forward_mode)
    if not isinstance(backend, LatentAttentionBackend):
        raise TypeError(f"Multi-head Latent Attention needs an MLA backend, got {backend.name!r} "
                        "(built over a latent KV layout: torch_native or triton)")
    return backend


def absorb_query(q_nope: torch.Tensor, layer: "MLAAttention") -> torch.Tensor:
    """q_nope [T, heads, nope] -> the query in latent space [T, heads, kv_lora_rank] (q_nope @ W_UK per head)."""
    return torch.einsum("thn,hnr->thr", q_nope, layer.w_uk.to(q_nope.dtype))


def project_output(out_latent: torch.Tensor, layer: "MLAAttention") -> torch.Tensor:
    """Attention output in latent space [T, heads, kv_lora_rank] -> [T, heads * v_head_dim] (W_UV per head)."""
    out = torch.einsum("thr,hvr->thv", out_latent, layer.w_uv.to(out_latent.dtype))
    return out.reshape(out.shape[0], -1)
