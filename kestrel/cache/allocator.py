"""Page allocator over KV slots.

A slot is one token's row in the KV pool; a page is `page_size` consecutive slots. All bookkeeping
and the slot tensors handed out live on the host (CPU tensors), so allocating never syncs the device;
the scheduler moves a whole batch's slots to the device in one copy.
"""
from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """Page allocator over KV slots.

    Page 0 (slots 0..page_size-1) is reserved as a padding target and never handed out; usable pages
    are 1..num_pages, so the KV pool has (num_pages + 1) * page_size slots.

    Invariants: every usable page is either free (in the free list exactly once) or handed out;
    available_size() + used_size() == size. A request's positions [k*ps, (k+1)*ps) always share one
    page, so the slot of position p is page * ps + p % ps.
    """

    def __init__(self, size: int, page_size: int, device: str | torch.device) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size:
            raise ValueError(f"KV pool size {size} is smaller than one page ({page_size} tokens); "
                             "give the pool more memory or use a smaller page size")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        # FIFO free list: pages are taken from the front of `_free`; freed pages are parked in
        # `_released` and appended lazily, so a free() is O(pages freed), not O(free list).
        self._free = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._num_free = self.num_pages
        self._num_used = 0
        # Cheap double-free detection: one flag per page (page 0 is never free to hand out).
        self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._is_free[0] = False
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def available_size(self) -> int:
        """Free tokens (free pages * page_size)."""
        return self._num_free * self.page_size

    def used_size(self) -> int:
        """Tokens in pages handed out."""
        return self._num_used * self.page_size

    def tokens_needed(self, seq_start: int, n: int) -> int:
        """Tokens' worth of new pages needed to place positions [seq_start, seq_start + n) of one request.

        If seq_start is not page-aligned, the first tokens go into the page holding seq_start - 1.
        """
        ps = self.page_size
        in_last_page = (-seq_start) % ps  # room left in the partially filled page
        rest = max(0, n - in_last_page)
        return -(-rest // ps) * ps

    def alloc_many(self, seq_starts: list[int], counts: list[int], last_locs: list[int]) -> torch.Tensor:
        """`alloc_for` for several requests at once: their slots concatenated (int64, on the host).

        With page_size 1 this is one take from the free list, whatever the number of requests.
        """
        if self.page_size == 1:
            total = sum(counts)
            if total > self._num_free:
                raise RuntimeError(f"KV pool out of memory: need {total} tokens, {self.available_size()} free")
            return self._take(total) if total else torch.empty(0, dtype=torch.int64)
        if sum(self.tokens_needed(s, n) for s, n in zip(seq_starts, counts)) > self.available_size():
            raise RuntimeError("KV pool out of memory for this batch; evict or retract first")
        parts = [self.alloc_for(s, n, loc) for s, n, loc in zip(seq_starts, counts, last_locs)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def alloc_for(self, seq_start: int, n: int, last_loc: int) -> torch.Tensor:
        """Slots (int64, on the host) for positions [seq_start, seq_start + n) of one request.

        Slots stay on the host so the scheduler can send a whole batch's slots to the device at once.

        `last_loc` is the slot of position seq_start - 1; it is ignored when seq_start is page-aligned.
        All or nothing: raises RuntimeError, with the state unchanged, if there are not enough pages.
        """
        if n < 0 or seq_start < 0:
            raise ValueError(f"alloc_for needs seq_start >= 0 and n >= 0, got {seq_start}, {n}")
        ps = self.page_size
        num_new_pages = self.tokens_needed(seq_start, n) // ps
        if num_new_pages > self._num_free:
            raise RuntimeError(f"KV pool out of memory: need {num_new_pages * ps} tokens, "
                               f"{self.available_size()} free; evict or retract first")
        in_last_page = min(n, (-seq_start) % ps)
        parts = []
        if in_last_page:
            parts.append(torch.arange(last_loc + 1, last_loc + 1 + in_last_page, dtype=torch.int64))
        if num_new_pages:
            pages = self._take(num_new_pages)
            # Positions after the partial page are aligned, so new pages fill from offset 0.
            slots = pages if ps == 1 else (pages[:, None] * ps + self._offsets).flatten()
            parts.append(slots[: n - in_last_page])
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _take(self, k: int) -> torch.Tensor:
        if self._free.numel() < k:
            self._free = torch.cat([self._free, *self._released])
            self._released.clear()
        pages, self._free = self._free[:k], self._free[k:]
        self._is_free[pages] = False
        self._num_free -= k
        self._num_used += k
        return pages

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages containing `slots`; the caller must own those pages wholly."""
        if slots.numel() == 0:
            return
        if slots.device.type != "cpu":
            raise ValueError("free() takes host slot tensors (reading device slots would sync the device)")
        pages = torch.unique(slots.to(torch.int64) // self.page_size)
        if pages[0] <= 0 or pages[-1] > self.num_pages:  # unique() sorts
            raise RuntimeError(f"free() got slots outside usable pages 1..{self.num_pages} "
                               f"(page 0 is the reserved padding page)")
        if self._is_free[pages].any():
            raise RuntimeError("double free: some of these KV pages are already free")
        self._is_free[pages] = True
        self._released.append(pages)
        self._num_free += pages.numel()
        self._num_used -= pages.numel()

    def check(self) -> None:
        """Assert the accounting invariants (used in tests after every operation)."""
        assert self.available_size() + self.used_size() == self.size, "free + used != size"
        free = torch.cat([self._free, *self._released])
        assert free.numel() == self._num_free, "free count does not match the free list"
        assert torch.unique(free).numel() == free.numel(), "free list has duplicates"
        assert int(self._is_free.sum()) == self._num_free, "free flags disagree with the free list"
        assert bool(self._is_free[free].all()), "a page in the free list is flagged as used"
