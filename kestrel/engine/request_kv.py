"""A request's KV from admission to release: its `req_to_token` row, its slots, its radix lock.

Invariant while the request holds a row: `req.slots` (host) lists the slots of its positions
`[0, len(req.slots))`; the first `req.kv_len` hold committed KV, the first `req.cached_len` of those
belong to the radix tree (locked through `req.last_node`). Slots past `kv_len` were allocated for the
step being run. Every change to a row is recorded here and reaches the device table with the next batch
(`drain`), so the host never writes device memory out of stream order.
"""
from __future__ import annotations

import torch

from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.radix import NAMESPACE_SHIFT, NEXT_TOKEN_SHIFT, RadixCache
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.request import Request, RequestStatus
from kestrel.engine.pooling import first_unpooled
from kestrel.lora.pool import LoRAPool

def cache_key(req: Request, end: int | None = None, pairs: bool = False) -> list[int]:
    """The radix key of `req.fill_ids[:end]`: a LoRA request's in its adapter's namespace (no KV is shared
    across adapters, or with the base model).

    With `pairs` (a feature draft runs: its KV at position p was computed from token p + 1) position p is
    keyed by token p and token p + 1, so the tree shares a position only where the draft's KV holds too,
    and a request that branches off a cached path recomputes the last shared token's draft KV. The key
    then stops before a last position whose next token is not known yet."""
    ids = req.fill_ids[:None if end is None else end + pairs]
    if pairs:
        ids = [t + (n << NEXT_TOKEN_SHIFT) for t, n in zip(ids, ids[1:])]
    if req.lora is None:
        return ids
    shift = req.lora.uid * NAMESPACE_SHIFT
    return [t + shift for t in ids]


class RequestKV:
    def __init__(self, allocator: TokenToKVPoolAllocator, radix: RadixCache, req_to_token: ReqToTokenPool,
                 pair_keys: bool = False, lora: LoRAPool | None = None) -> None:
        self.pair_keys = pair_keys  # see cache_key
        self.lora = lora
        self.allocator = allocator
        self.radix = radix
        self.req_to_token = req_to_token
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._slots: list[torch.Tensor] = []
        self._new: list[torch.Tensor] = []  # this step's allocations, in batch order
        self._moves: tuple[list[int], list[int]] = ([], [])  # KV to copy (sources, destinations)

    def free_tokens(self) -> int:
        """Tokens that allocation can get: free pages plus unlocked radix prefixes (evictable)."""
        return self.allocator.available_size() + self.radix.evictable_size()

    # ---- admission ------------------------------------------------------------------------------
    def match(self, req: Request) -> torch.Tensor:
        """Lock the longest cached prefix of req (at most len - 1 tokens: the last one must run to give
        the next token's logits; with prompt logprobs, none of the positions still to score, which must
        run to give theirs; with pooling, none it still has to pool); returns its slots."""
        end = len(req.prompt_ids) + len(req.output_ids) - 1
        if req.params.prompt_logprobs is not None and req.prompt_logprob_len < len(req.prompt_ids) - 1:
            end = min(end, req.prompt_logprob_len)
        end = min(end, first_unpooled(req))
        slots, node = self.radix.match_prefix(cache_key(req, end, self.pair_keys))
        self.radix.inc_lock_ref(node)
        req.last_node, req.cached_len, req.kv_len = node, len(slots), len(slots)
        return slots

    def unmatch(self, req: Request) -> None:
        """Undo `match` for a request that was not admitted after all."""
        self.radix.dec_lock_ref(req.last_node)
        req.last_node, req.cached_len, req.kv_len = None, 0, 0

    def lora_fits(self, req: Request) -> bool:
        """Whether the request's adapter has (or can get) a pool slot now; a base-model request always fits."""
        return req.lora is None or self.lora.can_acquire(req.lora)

    def admit(self, req: Request, cached_slots: torch.Tensor) -> None:
        req.req_pool_idx = self.req_to_token.alloc()
        if req.lora is not None:
            req.lora_slot = self.lora.acquire(req.lora)
        req.slots = cached_slots.tolist()
        if req.cached_len:
            self._record(req.req_pool_idx, 0, cached_slots)
        if not req.admitted:
            req.cached_tokens = req.cached_len
            req.admitted = True
        req.status = RequestStatus.RUNNING

    # ---- slots for a step ------------------------------------------------------------------------
    def allocate(self, reqs: list[Request], counts: list[int]) -> torch.Tensor:
        """Slots for positions [kv_len, kv_len + n) of each request (their new tokens this step), evicting
        cached prefixes if needed; host int64, concatenated in request order."""
        need = sum(self.allocator.tokens_needed(r.kv_len, n) for r, n in zip(reqs, counts))
        if need > self.allocator.available_size():
            self.radix.evict(need - self.allocator.available_size())
        slots = self.allocator.alloc_many([r.kv_len for r in reqs], counts, [r.last_slot for r in reqs])
        values = slots.tolist()  # a host tensor: no device sync
        end = 0
        for req, n in zip(reqs, counts):
            req.slots += values[end:end + n]
            req.extend_len = n
            self._rows += [req.req_pool_idx] * n
            self._cols += range(req.kv_len, req.kv_len + n)
            end += n
        self._slots.append(slots)
        self._new.append(slots)
        return slots

    def commit_chunk(self, req: Request) -> None:
        """A prefill chunk ran: its tokens go to the tree so the request (and others) can share them."""
        slots = torch.tensor(req.slots[:req.kv_len], dtype=torch.int64)
        key = cache_key(req, req.kv_len, self.pair_keys)
        tree_slots, node, cached = self.radix.cache_unfinished(key, slots, req.cached_len, req.last_node)
        req.slots[:cached] = tree_slots.tolist()
        self._record(req.req_pool_idx, 0, tree_slots)
        req.last_node, req.cached_len = node, cached

    def keep_new(self, req: Request, prefix: int, nodes: list[int]) -> None:
        """Keep the KV of the new tokens `nodes` (indices among those after `prefix`, increasing, e.g. a
        verify tree's accepted path) as positions prefix, prefix + 1, ...; give the other new slots back.

        With page size 1 the row is re-pointed at the kept slots. With pages, a position's slot is fixed
        by its page, so a kept token out of place has its KV copied there (a move that the next batch
        carries to the device, before its forward).
        """
        assert all(a < b for a, b in zip(nodes, nodes[1:])) and len(req.slots) >= prefix + len(nodes)
        new = req.slots[prefix:]
        if self.allocator.page_size == 1:
            kept = [new[j] for j in nodes]
            moved = [d for d, j in enumerate(nodes) if j != d]
            if moved:
                self._record(req.req_pool_idx, prefix, torch.tensor(kept, dtype=torch.int64))
            dropped = sorted(set(new) - set(kept))
            req.slots = req.slots[:prefix] + kept
            self.allocator.free(torch.tensor(dropped, dtype=torch.int64))
        else:
            for d, j in enumerate(nodes):
                if j != d:  # nodes[d] > d, so no later source is overwritten
                    self._moves[0].append(new[j])
                    self._moves[1].append(new[d])
            self.free_after(req, prefix + len(nodes))
        req.kv_len = prefix + len(nodes)

    def free_after(self, req: Request, keep: int) -> None:
        """Give back the slots of positions >= keep (the pages not shared with position keep - 1)."""
        extra = torch.tensor(req.slots[keep:], dtype=torch.int64)
        req.slots = req.slots[:keep]
        if extra.numel() and keep % self.allocator.page_size:
            extra = extra[extra // self.allocator.page_size != req.slots[-1] // self.allocator.page_size]
        self.allocator.free(extra)

    # ---- end -----------------------------------------------------------------------------------
    def release(self, req: Request, cache: bool = True) -> None:
        """Free the request's row and KV. With `cache`, its committed tokens go to the radix tree
        (finished, or retracted: a resumed request may find them); a failed step's KV is not trusted
        and is freed instead. Slots of an uncommitted step are given back either way."""
        if req.req_pool_idx is None:
            return
        # A request stopped inside a multi-token step has KV for tokens after the stop, which it dropped.
        req.kv_len = min(req.kv_len, len(req.prompt_ids) + len(req.output_ids))
        self.free_after(req, req.kv_len)
        slots = torch.tensor(req.slots, dtype=torch.int64)
        if cache:
            self.radix.cache_finished(cache_key(req, req.kv_len, self.pair_keys), slots, req.cached_len, req.last_node)
        else:
            self.allocator.free(slots[req.cached_len:])
            self.radix.dec_lock_ref(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        if req.lora_slot >= 0:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1
        req.req_pool_idx, req.last_node, req.kv_len, req.cached_len, req.extend_len = None, None, 0, 0, 0
        req.slots = []

    # ---- to the device ---------------------------------------------------------------------------
    def _record(self, row: int, start: int, slots: torch.Tensor) -> None:
        n = slots.numel()
        self._rows += [row] * n
        self._cols += range(start, start + n)
        self._slots.append(slots)

    def drain(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What changed since the last drain, for the next batch: the row writes [3, W] (row, column,
        slot, in order), the KV moves [2, M] (source, destination slots) and this step's new slots."""
        empty = torch.empty(0, dtype=torch.int64)
        slots = torch.cat(self._slots) if self._slots else empty
        writes = torch.stack([torch.tensor(self._rows, dtype=torch.int64),
                              torch.tensor(self._cols, dtype=torch.int64), slots])
        moves = torch.tensor(self._moves, dtype=torch.int64).reshape(2, -1)
        new = torch.cat(self._new) if self._new else empty
        self._rows, self._cols, self._slots, self._new, self._moves = [], [], [], [], ([], [])
        return writes, moves, new
