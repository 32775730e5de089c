"""DeepSeek-V4's KV bytes per token: what the engine's KV memory really holds for one request, and
the arithmetic of docs/design/deepseek-v4.md §6 for the same model (SGLang's FP8 entry format), its yardstick.
Both entry formats are measured (`--kv-cache-dtype` auto and fp8_e4m3): the engine's own memory for the
one it runs, a KV memory built from the model's layout in the other (CPU, zeros: only its sizes count)."""
from __future__ import annotations

import math

import torch

from kestrel.cache.kv_layout import Indexing, KVLayout
from kestrel.cache.kv_memory import KVMemory
from kestrel.models.deepseek_v4.config import V4Config
from kestrel.quant.kv import kv_cache_dtype

FORMATS = ("auto", "fp8_e4m3")

def kv_bytes_measured(memory: KVMemory, context: int) -> dict:
    """One request at `context` positions in the engine's KV memory, from its tensors' sizes: TOKEN and
    BLOCK buffers per slot (a tensor's bytes / the slot space) x the slots of its pages, plus REQUEST
    buffers per row (bytes / rows). req_to_token (slot indices, any model) is not counted."""
    pools, alloc = memory.pools[0], memory.allocator
    num_slots = (alloc.num_pages + 1) * alloc.page_size
    slots = alloc.tokens_needed(0, context)
    groups = {}
    for group in pools.layout.groups:
        tensors = [getattr(pools.layer(layer), buf.name) for layer in group.layer_ids for buf in group.buffers]
        if group.indexing is Indexing.REQUEST:
            groups[group.name] = sum(t.nbytes / t.shape[0] for t in tensors)
        else:
            groups[group.name] = slots * sum(t.nbytes for t in tensors) / num_slots
    total = sum(groups.values())
    return {"context": context, "slots_held": slots, "bytes_per_request": total, "bytes_per_token": total / context,
            "bytes_by_group": groups}


def spec_entry_bytes(head_dim: int, rope_dim: int, index_head_dim: int) -> tuple[int, int]:
    """The entry format of docs/design/deepseek-v4.md §6 (SGLang's): a K=V entry is (D - r) FP8 nope bytes
    + a ue8m0 scale per 64 of them + 1 pad + r bf16 rope values (448 + 7 + 1 + 128 = 584 B at D 512, r 64);
    an indexer key is c_I FP8 bytes + a 4 B fp32 scale (132 B at c_I 128)."""
    nope = head_dim - rope_dim
    return nope + math.ceil(nope / 64) + 1 + 2 * rope_dim, index_head_dim + 4


def spec_slope(c4_layers: int, c128_layers: int, entry: float, index_key: float) -> float:
    """The long-context slope of docs/design/deepseek-v4.md §6, bytes per token: (entry + index key) / 4 per
    ratio-4 layer, entry / 128 per ratio-128 layer. Full V4-Flash (21 and 20 such layers, 584 B and 132 B):
    3850 B, the ≈ 3.85 KB given there."""
    return c4_layers * (entry + index_key) / 4 + c128_layers * entry / 128


def spec_kv_bytes(cfg: V4Config, context: int) -> dict:
    """docs/design/deepseek-v4.md §6 for this model at `context` positions of one request: the slope, plus
    (L + 1) x window x entry per request (every main layer's ring and the MTP layer's; that page's
    per-request term names the compressor state too but counts only the rings, and so does this)."""
    entry, index_key = spec_entry_bytes(cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim)
    slope = spec_slope(cfg.compress_ratios.count(4), cfg.compress_ratios.count(128), entry, index_key)
    per_request = (cfg.num_hidden_layers + 1) * cfg.sliding_window * entry
    return {"entry_bytes": entry, "index_key_bytes": index_key, "slope": slope, "per_request": per_request,
            "bytes_per_token": slope + per_request / context,
            "flash_slope": spec_slope(21, 20, *spec_entry_bytes(512, 64, 128))}


def slope_with_entry_bytes(cfg: V4Config, layout: KVLayout) -> float:
    """The slope of docs/design/deepseek-v4.md §6 with the layout's own bytes per compressed entry and indexer
    key: what the measured slope must be for that entry format."""
    sizes = {b.name: b.nbytes for g in layout.groups if g.indexing is Indexing.BLOCK for b in g.buffers}
    return spec_slope(cfg.compress_ratios.count(4), cfg.compress_ratios.count(128), sizes.get("ckv", 0),
                      sizes.get("idx_k", 0))


def kv_bytes(engine, context: int) -> dict:
    """The V4 KV bytes per token at `context` against docs/design/deepseek-v4.md §6 for the engine's model: top
    level for the engine's entry format (read off its KV memory), `formats` for both."""
    model, cache = engine.runner.model, engine.config.cache
    cfg = model.config
    spec = spec_kv_bytes(cfg, context)
    dtype = getattr(torch, engine.config.model.dtype)
    formats = {}
    for name in FORMATS:
        if name == cache.kv_cache_dtype:
            memory, source = engine.kv_memory, "the engine's KV memory"
        else:
            page = engine.kv_memory.allocator.page_size
            size = -(-context // page) * page + page
            memory = KVMemory([model.kv_layout(kv_cache_dtype(name, dtype))], size, page, 1, size, "cpu")
            source = "a KV memory built from the model's layout in this format (CPU)"
        measured = kv_bytes_measured(memory, context)
        formats[name] = {**measured, "source": source,
                         "spec_slope_with_our_entry_bytes": slope_with_entry_bytes(cfg, memory.pools[0].layout),
                         "ratio_to_spec": measured["bytes_per_token"] / spec["bytes_per_token"]}
    return {**formats[cache.kv_cache_dtype], "kv_cache_dtype": cache.kv_cache_dtype, "formats": formats,
            "spec": spec, "spec_bytes_per_token": spec["bytes_per_token"]}
