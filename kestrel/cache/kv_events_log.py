"""From the radix cache's changes to KV-cache events.

`KVEventLog` is the observer a `RadixCache` is given: it only records what the tree did (a node's pages
stored, a node split, a leaf evicted, the tree flushed) and hands a step's records to the publisher at
the step's end. `BlockChains` runs on the publisher's thread: it hashes the pages and turns the records
into events, so the engine's step pays for a list append per change and nothing more.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from kestrel.cache.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, external_hash,
                                     page_digest, seed_digest)
from kestrel.cache.radix import NAMESPACE_SHIFT, TOKEN_SPACE

if TYPE_CHECKING:
    from kestrel.cache.radix import Node

# Record kinds, in the order the tree made them (the chains depend on it).
STORED, SPLIT, REMOVED, CLEARED = range(4)


class Publisher(Protocol):
    def submit(self, ts: float, records: list[tuple]) -> None: ...

    def close(self) -> None: ...


class KVEventLog:
    """The radix cache's changes of the current step. A node is named by its `id`; the root by None."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self._records: list[tuple] = []

    def stored(self, node: "Node") -> None:
        """A new node: its whole pages (its key never changes in place, so the list is kept as it is)."""
        parent = node.parent
        self._records.append((STORED, node.id, parent.id if parent.parent is not None else None, node.key))

    def split(self, upper: "Node", lower: "Node") -> None:
        """`lower`'s first pages became the new node `upper`."""
        self._records.append((SPLIT, upper.id, lower.id, len(upper.key)))

    def removed(self, node: "Node") -> None:
        self._records.append((REMOVED, node.id))

    def cleared(self) -> None:
        self._records.append((CLEARED,))

    def end_step(self) -> None:
        """Hand the step's changes to the publisher as one batch (nothing when there were none)."""
        if self._records:
            self.publisher.submit(time.time(), self._records)
            self._records = []

    def close(self) -> None:
        self.end_step()
        self.publisher.close()


class BlockChains:
    """The page digests of every node the tree holds, kept in step with its records (publisher thread)."""

    def __init__(self, page_size: int, seed: str) -> None:
        self.page_size = page_size
        self.root = seed_digest(seed)
        self.pages: dict[int, list[bytes]] = {}  # node id -> its pages' digests, in order

    def events(self, records: list[tuple]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        ps = self.page_size
        for record in records:
            kind = record[0]
            if kind == STORED:
                _, node, parent, key = record
                prev = self.pages[parent][-1] if parent is not None else self.root
                parent_hash = external_hash(prev) if parent is not None else None
                # A LoRA adapter's pages: its tokens in the adapter's namespace (radix.NAMESPACE_SHIFT); a
                # feature draft's keys also carry the next token (radix.TOKEN_SPACE): events name tokens only.
                lora_id = key[0] // NAMESPACE_SHIFT or None if key else None
                tokens = [t % NAMESPACE_SHIFT % TOKEN_SPACE for t in key]
                digests = []
                for i in range(0, len(key), ps):
                    prev = page_digest(prev, tokens[i:i + ps], lora_id)
                    digests.append(prev)
                self.pages[node] = digests
                out.append(BlockStored([external_hash(d) for d in digests], parent_hash, tokens, ps, lora_id=lora_id))
            elif kind == SPLIT:
                _, upper, lower, length = record
                digests = self.pages[lower]
                self.pages[upper], self.pages[lower] = digests[:length // ps], digests[length // ps:]
            elif kind == REMOVED:
                out.append(BlockRemoved([external_hash(d) for d in self.pages.pop(record[1])]))
            else:
                self.pages.clear()
                out.append(AllBlocksCleared())
        return out
