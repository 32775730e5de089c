"""What DeepSeek-V4 keeps in the engine's KV memory (spec §6), as a `KVLayout`.

Per request (REQUEST rows, fixed size): every layer's sliding-window ring, and each compressor's raw
rows of the block being filled (ratio 4 with overlap also the last full block: 2 x 4 rows; ratio 128:
128 rows). Per compressed block (BLOCK, at slot(i * ratio) // ratio): the main compressed entry of
ratio-4 and ratio-128 layers and the indexer key of ratio-4 layers. Buffer names are the ones the
dsv4 backend and the model read (`kestrel/attention/dsv4.py`).
"""
from __future__ import annotations

import torch

from kestrel.cache.kv_layout import Indexing, KVBuffer, KVGroup, KVLayout
from kestrel.models.deepseek_v4.config import V4Config

PREFIX_CACHE_UNSUPPORTED = (
    "DeepSeek-V4 keeps per-request state (the sliding-window ring and the compressors' partial blocks) "
    "that is not saved at a reusable prefix boundary, so a radix hit could not resume it exactly")


def layer_ratios(cfg: V4Config) -> dict[int, int]:
    """Compress ratio of every layer with KV, the MTP layer (id num_hidden_layers) included."""
    ratios = dict(enumerate(cfg.compress_ratios))
    if cfg.num_nextn_predict_layers:
        ratios[cfg.num_hidden_layers] = cfg.mtp_compress_ratio
    return ratios


def v4_kv_layout(cfg: V4Config, dtype: torch.dtype) -> KVLayout:
    """K=V entries in the model dtype; the compressor's raw rows in float32, as they are computed."""
    ratios = layer_ratios(cfg)
    D, c_i, f32 = cfg.head_dim, cfg.index_head_dim, torch.float32
    c4 = tuple(i for i, r in ratios.items() if r == 4)
    c128 = tuple(i for i, r in ratios.items() if r == 128)
    groups = [KVGroup("swa", tuple(ratios), Indexing.REQUEST, (KVBuffer("swa_kv", (cfg.sliding_window, D), dtype),))]
    if c4:
        groups += [
            KVGroup("c4_state", c4, Indexing.REQUEST,
                    (KVBuffer("comp_kv", (8, 2 * D), f32), KVBuffer("comp_score", (8, 2 * D), f32),
                     KVBuffer("idx_kv", (8, 2 * c_i), f32), KVBuffer("idx_score", (8, 2 * c_i), f32))),
            KVGroup("c4_blocks", c4, Indexing.BLOCK, (KVBuffer("ckv", (D,), dtype), KVBuffer("idx_k", (c_i,), dtype)),
                    ratio=4),
        ]
    if c128:
        groups += [
            KVGroup("c128_state", c128, Indexing.REQUEST,
                    (KVBuffer("comp_kv", (128, D), f32), KVBuffer("comp_score", (128, D), f32))),
            KVGroup("c128_blocks", c128, Indexing.BLOCK, (KVBuffer("ckv", (D,), dtype),), ratio=128),
        ]
    return KVLayout(tuple(groups), prefix_cache_unsupported=PREFIX_CACHE_UNSUPPORTED)
