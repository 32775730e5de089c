"""What a model stores per token (and per request) in the KV memory: its layer groups and their buffers.

A model class declares its `KVLayout`; the engine builds the KV memory from it (`kv_memory.py`).
Each group is indexed one of three ways:
- TOKEN: one entry per KV slot (full K/V of a Llama layer);
- BLOCK: one entry per `ratio` consecutive positions of a request, at `slot // ratio` of the block's
  first position. Page sizes are multiples of every ratio, so a block never straddles two pages and its
  positions have consecutive slots (a compressed KV block, an indexer key);
- REQUEST: per `req_to_token` row, for state that does not grow with the sequence (a sliding-window
  ring, a compressor's partial block).

A REQUEST group whose buffers are `k` and `v` of shape (ring, kv_heads, head_dim) is a sliding-window
ring (`KVLayout.windowed_attention`): the per-head-KV backends (torch_native, Triton) keep the key at
a request's position p in row p mod ring, and read it as long as it is inside the window.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kestrel.quant.kv_entries import KVEntryCodec


LATENT_GROUP = "latent"  # the group of a `KVLayout.latent_attention`


WINDOW_RING_NO_PREFIX_CACHE = (
    "the sliding-window layers keep a per-request ring of their last keys, not every token's KV, so a "
    "cached prefix would lack the window's keys at its end (docs/design/window-rings.md §4)")


def window_ring_length(window: int, step_tokens: int = 1) -> int:
    """Entries of a window ring. A step writes its new tokens' keys before its queries read, so a ring
    of `window + s - 1` entries serves `s` new tokens per request at once; longer extends (prefill
    chunks) run in sub-steps of s tokens. s is at least the window (a sub-step per window of a prompt)
    and at least `step_tokens` (a speculative verify writes all its tokens before acceptance: a rejected
    token's key then overwrites only a position no later query reads)."""
    return window + max(window, step_tokens) - 1


class Indexing(enum.Enum):
    TOKEN = "token"
    BLOCK = "block"
    REQUEST = "request"


@dataclass(frozen=True)
class KVBuffer:
    """One tensor per layer of a group: `shape` is one entry's (TOKEN, BLOCK) or one request's (REQUEST).
    An FP8 buffer stores value / `scale` (kestrel.quant.kv). A buffer with a `codec` holds packed
    entries: uint8 rows of `codec.nbytes` (the shape's last dim) standing for `codec.width` values, which
    its readers decode and its writers encode (kestrel.quant.kv_entries)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    scale: float = 1.0
    codec: "KVEntryCodec | None" = None

    def __post_init__(self) -> None:
        if self.codec is not None and (self.dtype != torch.uint8 or self.shape[-1] != self.codec.nbytes):
            raise ValueError(f"KV buffer {self.name!r}: packed entries are uint8 rows of {self.codec.nbytes} "
                             f"bytes, got {self.dtype} with shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class KVGroup:
    name: str
    layer_ids: tuple[int, ...]
    indexing: Indexing
    buffers: tuple[KVBuffer, ...]
    ratio: int = 1  # BLOCK: positions per entry

    def __post_init__(self) -> None:
        if self.ratio < 1 or (self.indexing is not Indexing.BLOCK and self.ratio != 1):
            raise ValueError(f"KV group {self.name!r}: ratio {self.ratio} is only for BLOCK groups (>= 1)")

    @property
    def bytes_per_token(self) -> float:
        """Bytes this group adds per token of a sequence (all its layers); 0 for per-request state."""
        if self.indexing is Indexing.REQUEST:
            return 0.0
        return len(self.layer_ids) * sum(b.nbytes for b in self.buffers) / self.ratio

    @property
    def bytes_per_request(self) -> int:
        return len(self.layer_ids) * sum(b.nbytes for b in self.buffers) if self.indexing is Indexing.REQUEST else 0


@dataclass(frozen=True)
class KVLayout:
    """Every layer's KV storage. `prefix_cache_unsupported` says why radix prefix reuse cannot be exact
    for this model (per-request state at a reused boundary would be missing); None when it can."""

    groups: tuple[KVGroup, ...]
    prefix_cache_unsupported: str | None = None
    # For a layout with window rings: the same model's layout with full K/V per token everywhere (window
    # layers masked, not dropped), which keeps radix prefix reuse (--disable-window-rings).
    without_rings: "KVLayout | None" = None

    def __post_init__(self) -> None:
        seen: set[tuple[int, str]] = set()
        for group in self.groups:
            for layer in group.layer_ids:
                for buf in group.buffers:
                    if (layer, buf.name) in seen:
                        raise ValueError(f"layer {layer} has two KV buffers named {buf.name!r}")
                    seen.add((layer, buf.name))

    @classmethod
    def full_attention(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> "KVLayout":
        """K and V per KV head for every token of every layer (the Llama family); `dtype` is the pool's
        (the model's, or an FP8 type for `--kv-cache-dtype fp8_*`)."""
        entry = (num_kv_heads, head_dim)
        return cls((KVGroup("full", tuple(range(num_layers)), Indexing.TOKEN,
                            (KVBuffer("k", entry, dtype), KVBuffer("v", entry, dtype))),))

    @classmethod
    def latent_attention(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> "KVLayout":
        """Multi-head Latent Attention (DeepSeek-V3): one entry per token of every layer, shared by all
        heads, holding the compressed latent (`kv_lora_rank` values, after the KV norm) followed by the
        rotated rope key (`rope_dim` values): `layer.latent` [slots, kv_lora_rank + rope_dim]. A
        tensor-parallel rank keeps every entry whole (its heads all read the same latent). `dtype` is the
        pool's, as for `full_attention`."""
        entry = (kv_lora_rank + rope_dim,)
        return cls((KVGroup(LATENT_GROUP, tuple(range(num_layers)), Indexing.TOKEN,
                            (KVBuffer("latent", entry, dtype),)),))

    @classmethod
    def windowed_attention(cls, windows: tuple[int | None, ...], num_kv_heads: int, head_dim: int,
                           dtype: torch.dtype, step_tokens: int = 1) -> "KVLayout":
        """Per-head K and V where layer i attends over `windows[i]` positions (None: all of them): full
        layers per token (TOKEN), each window size's layers as per-request rings (REQUEST) of
        `window_ring_length(window, step_tokens)` entries, so a window layer costs no bytes per token.
        A ring keeps no KV of a reusable prefix boundary, so radix reuse is off with rings."""
        entry = (num_kv_heads, head_dim)
        full = tuple(i for i, w in enumerate(windows) if w is None)
        groups = [KVGroup("full", full, Indexing.TOKEN, (KVBuffer("k", entry, dtype), KVBuffer("v", entry, dtype)))] \
            if full else []
        for window in sorted({w for w in windows if w is not None}):
            ring = (window_ring_length(window, step_tokens), *entry)
            groups.append(KVGroup(f"window{window}", tuple(i for i, w in enumerate(windows) if w == window),
                                  Indexing.REQUEST, (KVBuffer("k", ring, dtype), KVBuffer("v", ring, dtype))))
        if all(w is None for w in windows):
            return cls(tuple(groups))
        return cls(tuple(groups), prefix_cache_unsupported=WINDOW_RING_NO_PREFIX_CACHE,
                   without_rings=cls.full_attention(len(windows), num_kv_heads, head_dim, dtype))

    @property
    def has_rings(self) -> bool:
        """Whether some layers keep a per-request ring of their window (`windowed_attention`)."""
        return self.without_rings is not None

    @property
    def latent(self) -> bool:
        """Whether this layout holds MLA latents (`latent_attention`): only an MLA backend reads it."""
        return any(g.name == LATENT_GROUP for g in self.groups)

    def per_request_groups(self) -> list[str]:
        """The REQUEST groups in words, for the start-up log: name, layers and entries per request."""
        return [f"{g.name}: {len(g.layer_ids)} layers x {g.buffers[0].shape[0]} entries per request"
                for g in self.groups if g.indexing is Indexing.REQUEST]

    @property
    def page_multiple(self) -> int:
        """Page sizes must be multiples of this (the BLOCK ratios)."""
        return math.lcm(1, *(g.ratio for g in self.groups if g.indexing is Indexing.BLOCK))

    @property
    def bytes_per_token(self) -> float:
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def bytes_per_request(self) -> int:
        return sum(g.bytes_per_request for g in self.groups)
