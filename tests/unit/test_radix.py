import random

import pytest
import torch

from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.radix import RadixCache


def make(size: int = 256, page_size: int = 1, disabled: bool = False):
    alloc = TokenToKVPoolAllocator(size, page_size, "cpu")
    return alloc, RadixCache(alloc, page_size, disabled=disabled)


def tree_pages(cache: RadixCache) -> list[int]:
    pages, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        pages += (node.value // cache.page_size).unique().tolist()
        stack.extend(node.children.values())
    return pages


def check_sizes(cache: RadixCache) -> None:
    locked = total = 0
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        assert len(node.key) == len(node.value) and len(node.key) % cache.page_size == 0 and node.key
        total += len(node.key)
        locked += len(node.key) if node.lock_ref > 0 else 0
        for child in node.children.values():
            assert child.lock_ref <= node.lock_ref, "a lock must cover all ancestors"
        stack.extend(node.children.values())
    assert cache.total_size() == total and cache.protected_size() == locked
    assert cache.evictable_size() == total - locked


def test_match_insert_split_page_size_1():
    alloc, cache = make()
    slots = alloc.alloc_for(0, 4, 0)
    assert cache.insert([1, 2, 3, 4], slots) == 0
    got, node = cache.match_prefix([1, 2, 3, 9])
    assert got.tolist() == slots[:3].tolist() and node.key == [1, 2, 3]  # split inside the node
    assert len(cache.root.children) == 1 and cache.total_size() == 4
    got, _ = cache.match_prefix([1, 2, 3, 4, 5])
    assert got.tolist() == slots.tolist()
    assert cache.match_prefix([7])[0].numel() == 0
    other = alloc.alloc_for(0, 3, 0)
    assert cache.insert([1, 2, 5], other) == 2  # [1, 2] already there
    assert cache.match_prefix([1, 2, 5])[0].tolist() == slots[:2].tolist() + other[2:].tolist()
    assert cache.total_size() == 5
    check_sizes(cache)


def test_page_alignment_page_size_4():
    alloc, cache = make(64, 4)
    key = list(range(100, 110))  # 10 tokens: only 8 are cached
    slots = alloc.alloc_for(0, 10, 0)
    assert cache.insert(key, slots) == 0
    assert cache.total_size() == 8
    assert cache.match_prefix(key[:7])[0].tolist() == slots[:4].tolist()
    assert cache.match_prefix(key[:3])[0].numel() == 0
    diverge = key[:5] + [0, 0, 0]  # differs inside the second page
    got, node = cache.match_prefix(diverge)
    assert got.tolist() == slots[:4].tolist() and len(node.key) == 4
    assert cache.insert(diverge, alloc.alloc_for(0, 8, 0)) == 4
    check_sizes(cache)
    assert all(len(n.key) % 4 == 0 for n in cache.root.children.values())


def test_lock_prevents_eviction():
    alloc, cache = make()
    a, b = alloc.alloc_for(0, 4, 0), alloc.alloc_for(0, 4, 0)
    cache.insert([1, 2, 3, 4], a)
    cache.insert([5, 6, 7, 8], b)
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 4
    assert cache.evict(100) == 4
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == a.tolist()
    assert cache.evict(100) == 0
    cache.dec_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert cache.evict(100) == 4
    assert alloc.available_size() == alloc.size
    alloc.check()


def test_eviction_is_lru_and_parents_become_leaves():
    alloc, cache = make()
    for key in ([1, 2, 3], [1, 2, 4], [5, 6], [7, 8]):
        slots = alloc.alloc_for(0, len(key), 0)
        alloc.free(slots[: cache.insert(key, slots)])  # the caller owns its duplicates
    cache.match_prefix([5, 6])
    cache.match_prefix([1, 2, 3])
    # Least recent first: [1,2,4]'s leaf [4] is oldest, then [7,8], then [5,6], then [3], then [1,2].
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2, 4])[0].numel() == 2
    assert cache.evict(1) == 2  # [7, 8]
    assert cache.match_prefix([7, 8])[0].numel() == 0
    assert cache.match_prefix([5, 6])[0].numel() == 2
    assert cache.evict(1) == 1  # [3] (touched before the [5, 6] match above)
    assert cache.evict(3) == 4  # [1, 2] became a leaf, then [5, 6]
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_finished_and_unfinished_accounting(page_size):
    alloc, cache = make(128, page_size)
    tokens = list(range(1, 23))  # 22 tokens
    # Request 1: chunked prefill of 10 then 12 tokens, then finish.
    cached, node = cache.match_prefix(tokens)
    cache.inc_lock_ref(node)
    row = alloc.alloc_for(0, 10, 0)
    new_slots, node, cached_len = cache.cache_unfinished(tokens, row, 0, node)
    aligned = 10 - 10 % page_size
    assert cached_len == aligned and new_slots.tolist() == row[:aligned].tolist()
    assert cache.protected_size() == aligned and cache.evictable_size() == 0
    row = torch.cat([row, alloc.alloc_for(10, 12, int(row[-1]))])
    owned = alloc.used_size() - cache.total_size()
    assert owned == -(-22 // page_size) * page_size - aligned
    cache.cache_finished(tokens, row, cached_len, node)
    assert cache.protected_size() == 0 and cache.total_size() == 22 - 22 % page_size
    assert alloc.used_size() == cache.total_size()
    # Request 2 shares 12 tokens; its private copies of the shared part are duplicates to free.
    other = tokens[:12] + [99] * 6
    dup = alloc.alloc_for(0, 18, 0)
    cache.cache_finished(other, dup, 0, cache.root)
    assert alloc.used_size() == cache.total_size() == (22 - 22 % page_size) + (18 - 18 % page_size) - 12
    cache.evict(10**9)
    assert alloc.available_size() == alloc.size
    alloc.check()


def test_disabled_mode():
    alloc, cache = make(64, 4, disabled=True)
    slots = alloc.alloc_for(0, 10, 0)
    assert cache.insert(list(range(10)), slots) == 0
    got, node = cache.match_prefix(list(range(10)))
    assert got.numel() == 0 and node is cache.root
    assert cache.cache_unfinished(list(range(10)), slots, 0, cache.root)[1:] == (cache.root, 0)
    assert alloc.used_size() == 12 and cache.total_size() == 0
    cache.cache_finished(list(range(10)), slots, 0, cache.root)
    assert alloc.available_size() == alloc.size and cache.evict(100) == 0
    alloc.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_randomized_requests(page_size):
    """Many requests sharing prefixes under a tight KV budget; invariants checked after every step."""
    rng = random.Random(page_size)
    alloc, cache = make(48 * page_size + 40, page_size)
    # kv[slot] is the prefix whose last token the slot's KV belongs to: a shared slot is correct
    # only if every reader has that same prefix.
    kv: dict[int, tuple[int, ...]] = {}
    bases = [[rng.randrange(5) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    live: list[dict] = []

    def owned_pages(req) -> list[int]:
        return (req["row"][req["cached_len"]:] // page_size).unique().tolist()

    def check() -> None:
        alloc.check()
        check_sizes(cache)
        pages = tree_pages(cache) + [p for r in live for p in owned_pages(r)]
        assert len(pages) == len(set(pages)), "a page is owned twice"
        assert alloc.used_size() == len(pages) * page_size == cache.total_size() + sum(
            len(owned_pages(r)) * page_size for r in live)

    def verify_match(key: list[int]) -> tuple[torch.Tensor, object]:
        slots, node = cache.match_prefix(key)
        assert len(slots) % page_size == 0
        for i, s in enumerate(slots.tolist()):
            assert kv[s] == tuple(key[: i + 1])
        return slots, node

    def start() -> None:
        tokens = rng.choice(bases)[: rng.randrange(1, 20)] + [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
        if not tokens:
            return
        slots, node = verify_match(tokens)
        cache.inc_lock_ref(node)
        live.append({"tokens": tokens, "row": slots, "cached_len": len(slots), "node": node})

    def extend(req) -> None:
        row, tokens = req["row"], req["tokens"]
        n = min(len(tokens) - len(row), rng.randrange(1, 9))
        if n == 0:
            return
        need = alloc.tokens_needed(len(row), n)
        if need > alloc.available_size():
            cache.evict(need - alloc.available_size())
            check()
        if need > alloc.available_size():
            return finish(req)  # retract: the request gives its KV back to the tree
        new = alloc.alloc_for(len(row), n, int(row[-1]) if len(row) else 0)
        for i, s in enumerate(new.tolist()):
            kv[s] = tuple(tokens[: len(row) + i + 1])
        req["row"] = torch.cat([row, new])

    def chunk_done(req) -> None:
        slots, node, cached_len = cache.cache_unfinished(req["tokens"], req["row"], req["cached_len"], req["node"])
        assert cached_len == len(slots) == len(req["row"]) - len(req["row"]) % page_size
        req["row"] = torch.cat([slots, req["row"][cached_len:]])
        req["node"], req["cached_len"] = node, cached_len
        verify_match(req["tokens"][: len(req["row"])])

    def finish(req) -> None:
        live[:] = [r for r in live if r is not req]
        cache.cache_finished(req["tokens"], req["row"], req["cached_len"], req["node"])

    for _ in range(1500):
        op = rng.random()
        if op < 0.25 or not live:
            if len(live) < 6:
                start()
        elif op < 0.65:
            extend(rng.choice(live))
        elif op < 0.8:
            chunk_done(rng.choice(live))
        elif op < 0.97:
            finish(rng.choice(live))
        else:
            cache.evict(rng.randrange(1, 20))
        check()
    for req in list(live):
        finish(req)
        check()
    assert cache.protected_size() == 0
    cache.evict(10**9)
    check()
    assert alloc.available_size() == alloc.size and cache.total_size() == 0
