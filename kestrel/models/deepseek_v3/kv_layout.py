"""DeepSeek-V3's KV: per token and layer one entry of the normed latent (kv_lora_rank) followed by the
rotated rope key (qk_rope_head_dim), whatever the heads or the tensor-parallel rank (the latent is
replicated). No per-request state: radix prefix reuse is exact."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from kestrel.cache.kv_layout import Indexing, KVBuffer, KVGroup, KVLayout
from kestrel.models.deepseek_v3.config import V3Config


def v3_kv_layout(cfg: V3Config, layer_ids: Iterable[int], dtype: torch.dtype) -> KVLayout:
    entry = KVBuffer("latent", (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), dtype)
    return KVLayout((KVGroup("mla", tuple(layer_ids), Indexing.TOKEN, (entry,)),))
