"""Radix tree over token ids → KV slots, for sharing prefixes between requests.

Invariants:
- Every node's key (and value) length is a positive multiple of page_size; nodes split only at page
  boundaries, so each node owns whole pages and eviction frees whole pages.
- A node's lock_ref counts the requests holding it or a descendant; locked nodes are never evicted.
- evictable_size() + protected_size() == total_size() == tokens held by the tree, all of which are
  handed-out pages of the allocator.
"""
from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

import torch

from kestrel.cache.allocator import TokenToKVPoolAllocator

if TYPE_CHECKING:
    from kestrel.cache.kv_events_log import KVEventLog


# Keys are token ids; a namespace (a LoRA adapter's uid) lifts its tokens by uid * NAMESPACE_SHIFT, above
# every vocabulary, so the tree never matches one namespace's KV with another's and needs no notion of them.
# Keys of a feature draft's engine also carry the next token, shifted by NEXT_TOKEN_SHIFT (request_kv.cache_key):
# a key's token is key % NAMESPACE_SHIFT % TOKEN_SPACE.
NEXT_TOKEN_SHIFT = 20
TOKEN_SPACE = 1 << NEXT_TOKEN_SHIFT
NAMESPACE_SHIFT = 1 << 40


class Node:
    """One edge of the tree: `key` token ids whose KV lives in `value` slots (same length)."""

    _ids = itertools.count()

    def __init__(self, parent: Node | None, key: list[int], value: torch.Tensor, access: int) -> None:
        self.parent = parent
        self.key = key
        self.value = value
        self.children: dict[int | tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = access
        self.id = next(Node._ids)  # tie-break in the eviction heap

    def __repr__(self) -> str:
        return f"Node(len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


class RadixCache:
    """Prefix cache: longest page-aligned prefix matches, LRU eviction of unlocked leaves."""

    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int, disabled: bool = False,
                 events: KVEventLog | None = None) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"radix page_size {page_size} != allocator page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disabled = disabled
        self.events = events  # told of every node stored, split, evicted and of a flush (KV-cache events)
        self._clock = itertools.count(1)  # logical time: deterministic LRU order
        # Slots live on the host, like the allocator's: matching and freeing never wait for the device.
        self._empty = torch.empty(0, dtype=torch.int64)
        self.root = Node(None, [], self._empty, 0)
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0

    # ---- sizes -------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- lookup / insert ---------------------------------------------------------------------
    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else tuple(key[pos:pos + self.page_size])

    def _common_len(self, a: list[int], b: list[int], b_pos: int) -> int:
        """Page-aligned length of the common prefix of a and b[b_pos:]."""
        n = min(len(a), len(b) - b_pos)
        i = 0
        while i < n and a[i] == b[b_pos + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: Node, n: int) -> Node:
        """Split `child` after its first n tokens; returns the new upper node."""
        upper = Node(child.parent, child.key[:n], child.value[:n], child.last_access)
        # Every lock through child also passes through upper, so their counts are equal.
        upper.lock_ref = child.lock_ref
        upper.children[self._child_key(child.key, n)] = child
        child.parent.children[self._child_key(child.key, 0)] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        if self.events is not None:
            self.events.split(upper, child)
        return upper

    def _walk(self, key: list[int]) -> tuple[Node, int, list[torch.Tensor]]:
        """Follow key from the root, splitting where the match ends inside a node.

        Returns (deepest matched node, matched length, values along the path). Touches access time.
        """
        node, pos, values = self.root, 0, []
        now = next(self._clock)
        node.last_access = now
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + n
            if partial:
                break
        return node, pos, values

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, Node]:
        """Slots of the longest cached page-aligned prefix of key, and the deepest matched node."""
        if self.disabled:
            return self._empty, self.root
        node, _, values = self._walk(key[: self._aligned(len(key))])
        return (torch.cat(values) if values else self._empty), node

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Insert the page-aligned part of key with its slots.

        Returns the length of the prefix that was already present: the caller's slots for it are
        duplicates and stay owned by the caller. Frees nothing.
        """
        if self.disabled:
            return 0
        if len(slots) < len(key):
            raise ValueError(f"insert got {len(key)} tokens but only {len(slots)} slots")
        length = self._aligned(len(key))
        key = key[:length]
        node, present, _ = self._walk(key)
        if present < length:
            # Clone: callers often pass a view of their req_to_token row, which gets overwritten.
            leaf = Node(node, key[present:], slots[present:length].clone(), node.last_access)
            node.children[self._child_key(key, present)] = leaf
            self._evictable += len(leaf.key)
            if self.events is not None:
                self.events.stored(leaf)
        return present

    # ---- locking / eviction ------------------------------------------------------------------
    def inc_lock_ref(self, node: Node) -> None:
        """Lock node and its ancestors against eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked radix node (unbalanced locking)")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Evict least recently used unlocked leaves until num_tokens are freed; returns tokens freed."""
        if self.disabled or num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            if self.events is not None:
                self.events.removed(leaf)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def flush(self) -> None:
        """Drop every cached prefix and free its slots (SGLang's flush_cache). No request may hold a node."""
        if self._protected:
            raise RuntimeError(f"cannot flush the radix cache while requests hold {self._protected} of its tokens")
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            self.allocator.free(node.value)
            stack.extend(node.children.values())
        self.root.children = {}
        self._evictable = 0
        if self.events is not None:
            self.events.cleared()

    def _leaves(self) -> list[Node]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    # ---- request hand-off --------------------------------------------------------------------
    def _insert_and_free_duplicates(self, token_ids: list[int], slots: torch.Tensor, cached_len: int) -> int:
        """Insert the aligned part of token_ids[:len(slots)] (token_ids may be shorter); free the caller's
        duplicate slots.

        Returns the aligned length inserted. slots[:cached_len] are the tree's own slots (held
        locked), so the already-present prefix is at least cached_len long.
        """
        length = self._aligned(min(len(slots), len(token_ids)))
        present = self.insert(token_ids[:length], slots[:length])
        assert present >= cached_len, "locked prefix vanished from the radix tree"
        self.allocator.free(slots[cached_len:present])
        return length

    def cache_finished(self, token_ids: list[int], slots: torch.Tensor, cached_len: int, node: Node) -> None:
        """A request finished or is retracted: hand its KV to the tree.

        slots[i] holds the KV of token_ids[i] for i < len(slots); slots[:cached_len] came from the
        tree through `node`, which the request holds locked. The aligned part goes into the tree,
        the caller's duplicates and the unaligned tail are freed, and `node` is unlocked.
        """
        if self.disabled:
            self.allocator.free(slots[cached_len:])
            return
        length = self._insert_and_free_duplicates(token_ids, slots, cached_len)
        self.allocator.free(slots[length:])
        self.dec_lock_ref(node)

    def cache_unfinished(self, token_ids: list[int], slots: torch.Tensor, cached_len: int,
                         node: Node) -> tuple[torch.Tensor, Node, int]:
        """Chunked-prefill progress: insert what the request has so far and re-lock it.

        Returns (tree slots for the aligned prefix, which the caller writes back into its
        req_to_token row; the new node, locked for the request while the old one is unlocked;
        the new cached_len). The unaligned tail stays owned by the request.
        """
        if self.disabled:
            return self._empty, self.root, 0
        length = self._insert_and_free_duplicates(token_ids, slots, cached_len)
        # Lock the new node before unlocking the old so nothing on the shared path is evictable in between.
        new_slots, new_node = self.match_prefix(token_ids[:length])
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(node)
        return new_slots, new_node, len(new_slots)
