"""KV-cache events in vLLM's wire format, and the block hashes they carry.

A batch is the msgpack array `[ts, events, data_parallel_rank]`; each event an array whose first element
is its type's name and the rest its fields in vLLM's declaration order, None where unset (msgspec's
`array_like` tagged structs, which is what llm-d's kv-cache indexer and the SGLang model gateway decode).

Block hashes follow vLLM's `sha256_cbor` chain: a page's digest is SHA-256 over the canonical CBOR of
`[parent digest (32 bytes), [its page_size token ids], None]`, the first page's parent being the digest of
the seed string (vLLM's NONE_HASH, from PYTHONHASHSEED); the events carry each digest's last 8 bytes as
an unsigned big-endian integer. llm-d's indexer in `sha256_cbor` mode computes the same keys from a
prompt (docs/kv-events.md).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

# The tier of the engine's own KV pool, as vLLM names it (consumers map it to their device tier).
MEDIUM = "GPU"


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None

    def wire(self) -> list:
        # extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window: unset (one full-attention group).
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium, self.lora_name, None, None, None, None]


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM

    def wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium, None]  # group_idx unset


@dataclass
class AllBlocksCleared:
    def wire(self) -> list:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb([ts, [e.wire() for e in events], data_parallel_rank], use_bin_type=True)


# ---- block hashes ---------------------------------------------------------------------------------
def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form, as canonical CBOR requires."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | extra]) + n.to_bytes(width, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def seed_digest(seed: str) -> bytes:
    """The parent digest of a sequence's first page: SHA-256 of the CBOR text string `seed`."""
    raw = seed.encode()
    return hashlib.sha256(_cbor_head(3, len(raw)) + raw).digest()


def page_digest(parent: bytes, token_ids: list[int], lora_id: int | None = None) -> bytes:
    """SHA-256 of canonical CBOR `[parent, token_ids, extra]` (token ids are non-negative integers);
    `extra` is None, or `[lora_id]` for a LoRA adapter's pages (vLLM's extra keys: an adapter's KV is
    its own)."""
    body = b"".join(_cbor_head(0, t) for t in token_ids)
    extra = b"\xf6" if lora_id is None else _cbor_head(4, 1) + _cbor_head(0, lora_id)
    cbor = b"\x83" + _cbor_head(2, len(parent)) + parent + _cbor_head(4, len(token_ids)) + body + extra
    return hashlib.sha256(cbor).digest()


def external_hash(digest: bytes) -> int:
    """The integer a consumer sees: the digest's last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")
