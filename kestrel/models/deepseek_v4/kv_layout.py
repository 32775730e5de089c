"""What DeepSeek-V4 keeps in the engine's KV memory (docs/design/deepseek-v4.md §6), as `KVLayout`s:
the main layers' (the target's) and the MTP layer's (a NEXTN draft's own pools).

Main layers. Per request (REQUEST rows, fixed size): every layer's sliding-window ring, and each
compressor's raw rows of the block being filled (ratio 4 with overlap also the last full block: 2 x 4
rows; ratio 128: 128 rows). Per compressed block (BLOCK, at slot(i * ratio) // ratio): the main
compressed entry of ratio-4 and ratio-128 layers and the indexer key of ratio-4 layers. Buffer names
are the ones the dsv4 backend and the model read (`kestrel/attention/dsv4.py`).

Rings hold positions at p mod their size. A speculative verify of `speculative_tokens` tokens writes
all of them before acceptance, so each ring is `speculative_tokens - 1` rows longer than it needs to
be: the rows a rejected token overwrites then belong to positions no later step reads (SGLang enlarges
its rings the same way).

MTP layer (sliding-window attention only in the released models): one K=V entry per slot (TOKEN), so
a NEXTN draft's lanes write their throw-away KV into scratch slots like every other draft's, and a
verify's rejected tokens or a padded draft extend leave no trace in state a later step reads.

Entry format (`--kv-cache-dtype`): `auto` stores K=V entries and indexer keys in the model dtype;
`fp8_e4m3` stores them packed as docs/design/deepseek-v4.md §6 counts them (`kestrel/quant/kv_entries.py`:
a K=V entry in 584 B, an indexer key in 132 B at Flash's widths): the window rings, the compressed blocks, the
indexer keys and the MTP layer's window alike. The compressor state stays float32 either way.
"""
from __future__ import annotations

import torch

from kestrel.cache.kv_layout import Indexing, KVBuffer, KVGroup, KVLayout
from kestrel.models.deepseek_v4.config import V4Config
from kestrel.quant.fp8 import is_fp8
from kestrel.quant.kv_entries import RopeEntryFP8, ScaledKeyFP8

PREFIX_CACHE_UNSUPPORTED = (
    "DeepSeek-V4 keeps per-request state (the sliding-window ring and the compressors' partial blocks) "
    "that is not saved at a reusable prefix boundary, so a radix hit could not resume it exactly")


def _entry(name: str, rows: tuple[int, ...], cfg: V4Config, dtype: torch.dtype) -> KVBuffer:
    """A buffer of K=V entries: in `dtype` (the model's), or packed FP8 for float8_e4m3fn."""
    if dtype == torch.float8_e4m3fn:
        codec = RopeEntryFP8(cfg.head_dim, cfg.qk_rope_head_dim)
        return KVBuffer(name, (*rows, codec.nbytes), torch.uint8, codec=codec)
    return KVBuffer(name, (*rows, cfg.head_dim), dtype)


def _index_key(cfg: V4Config, dtype: torch.dtype) -> KVBuffer:
    if dtype == torch.float8_e4m3fn:
        codec = ScaledKeyFP8(cfg.index_head_dim)
        return KVBuffer("idx_k", (codec.nbytes,), torch.uint8, codec=codec)
    return KVBuffer("idx_k", (cfg.index_head_dim,), dtype)


def _check_entry_dtype(dtype: torch.dtype) -> None:
    if is_fp8(dtype) and dtype != torch.float8_e4m3fn:
        raise ValueError(f"DeepSeek-V4 stores FP8 KV entries in e4m3 with power-of-two scales "
                         f"(docs/design/deepseek-v4.md §6), not {dtype}: use kv_cache_dtype 'auto' or 'fp8_e4m3'")


def v4_kv_layout(cfg: V4Config, dtype: torch.dtype, speculative_tokens: int = 1) -> KVLayout:
    """The main layers' KV: K=V entries and indexer keys in `dtype` (the model's), or packed FP8 when it is
    float8_e4m3fn; the compressor's raw rows in float32, as they are computed. `speculative_tokens`: the
    most new tokens of a step that a verify may roll back."""
    _check_entry_dtype(dtype)
    ratios = dict(enumerate(cfg.compress_ratios))
    extra = speculative_tokens - 1
    D, c_i, f32 = cfg.head_dim, cfg.index_head_dim, torch.float32
    c4 = tuple(i for i, r in ratios.items() if r == 4)
    c128 = tuple(i for i, r in ratios.items() if r == 128)
    groups = [KVGroup("swa", tuple(ratios), Indexing.REQUEST,
                      (_entry("swa_kv", (cfg.sliding_window + extra,), cfg, dtype),))]
    if c4:
        rows = 8 + extra
        groups += [
            KVGroup("c4_state", c4, Indexing.REQUEST,
                    (KVBuffer("comp_kv", (rows, 2 * D), f32), KVBuffer("comp_score", (rows, 2 * D), f32),
                     KVBuffer("idx_kv", (rows, 2 * c_i), f32), KVBuffer("idx_score", (rows, 2 * c_i), f32))),
            KVGroup("c4_blocks", c4, Indexing.BLOCK, (_entry("ckv", (), cfg, dtype), _index_key(cfg, dtype)),
                    ratio=4),
        ]
    if c128:
        rows = 128 + extra
        groups += [
            KVGroup("c128_state", c128, Indexing.REQUEST,
                    (KVBuffer("comp_kv", (rows, D), f32), KVBuffer("comp_score", (rows, D), f32))),
            KVGroup("c128_blocks", c128, Indexing.BLOCK, (_entry("ckv", (), cfg, dtype),), ratio=128),
        ]
    return KVLayout(tuple(groups), prefix_cache_unsupported=PREFIX_CACHE_UNSUPPORTED)


def mtp_kv_layout(cfg: V4Config, dtype: torch.dtype) -> KVLayout:
    """The MTP layer's KV (layer id num_hidden_layers): one K=V entry per slot, read over the window, in
    the target's entry format (`dtype` as for `v4_kv_layout`)."""
    _check_entry_dtype(dtype)
    if cfg.mtp_compress_ratio:
        raise ValueError(f"the MTP layer has compress ratio {cfg.mtp_compress_ratio}; kestrel drafts with "
                         "sliding-window-only MTP layers (ratio 0, as in the released DeepSeek-V4 models)")
    return KVLayout((KVGroup("mtp_window", (cfg.num_hidden_layers,), Indexing.TOKEN,
                             (_entry("win_kv", (), cfg, dtype),)),))
