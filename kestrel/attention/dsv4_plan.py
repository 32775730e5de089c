"""The dsv4 backend's per-step index plan: every gather and scatter index a V4 layer needs, built once per
step from the host lengths (the same for every layer of a ratio), so that no layer loops over requests.

Tokens are the flat batch (request order). A per-request state read ("old rows") is a padded block of the
`L` positions just before the request's prefix; a layer concatenates those blocks of all requests with
the step's own rows into one source, `[old rows of request 0..B-1 ; new rows]`, and indexes it by
position through `source_index`: every read of a step (window keys, a compressor's candidate rows) is
then one gather, whatever the mix of decodes, verify chains and prefill chunks.

Two ways to build a plan, one set of parts: from the host lengths (`StepPlan(spans, ...)`: any step,
its parts sized exactly), or for a decode step from the device lengths alone (`StepPlan.decode`: the
"static sizes" a CUDA graph replays). A decode adds one token per request, so its sizes follow from the
batch size and the table width: per ratio one completed-block entry per request (a request that
completes none writes it to BLOCK slot 0, the reserved page's, which no request reads), block tables as
wide as the longest sequence the step may hold (masked past each request's blocks), and tiles from the
batch size. No part then reads a device value on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch


@dataclass(frozen=True)
class V4Span:
    """One request's part of the flat batch: tokens [start, start + extend) at positions [prefix, seq)."""

    row: int  # its req_to_token row, which is also its REQUEST-state row
    prefix: int
    extend: int
    start: int

    @property
    def seq(self) -> int:
        return self.prefix + self.extend


@dataclass(frozen=True)
class NewBlocks:
    """The compressed blocks a step completes, flat over requests (N of them): for each, its candidate
    rows as indices into the step's row source (own [N, m]; with overlap the previous block's [N, m] and
    whether it exists), its rope position (block start) and its BLOCK slot."""

    own: torch.Tensor
    prev: torch.Tensor | None
    has_prev: torch.Tensor | None
    positions: torch.Tensor
    slots: torch.Tensor

    @property
    def count(self) -> int:
        return self.positions.shape[0]


class StepPlan:
    """`block_ratios`: the layout's BLOCK ratios, whose completed blocks are listed up front, so that the
    step's host lengths reach the device in one copy. `padding_row`: a REQUEST row no request holds,
    where ring writes that no later step reads go (scatters then need no host-sized index)."""

    def __init__(self, spans: list[V4Span], table: torch.Tensor, block_ratios: tuple[int, ...],
                 padding_row: int) -> None:
        self.spans = spans
        self.table = table
        self.padding_row = padding_row
        dev = table.device
        self.device = dev
        self.num_requests = len(spans)
        self.extends = [s.extend for s in spans]
        self.num_tokens = sum(self.extends)
        host = [v for s in spans for v in (s.row, s.prefix, s.extend, s.start)]
        counts = [4 * len(spans)]
        for ratio in block_ratios:
            pairs = [v for b, s in enumerate(spans) for i in range(s.prefix // ratio, s.seq // ratio) for v in (b, i)]
            host += pairs
            counts.append(len(pairs))
        host = torch.tensor(host, dtype=torch.int64)
        if dev.type == "cuda":  # pinned: the copy does not wait for the work already queued
            host = host.pin_memory()
        parts = host.to(dev, non_blocking=True).split(counts)
        rows, prefix, extend, start = parts[0].view(-1, 4).unbind(1)
        self.rows, self.prefix, self.start = rows, prefix, start
        self.seq = prefix + extend
        # Per ratio: (request, block index, whether it is a real block: None = all are).
        self._pairs = {ratio: (*p.view(-1, 2).unbind(1), None) for ratio, p in zip(block_ratios, parts[1:])}
        self._block_width = {ratio: max((s.seq // ratio for s in spans), default=0) for ratio in block_ratios}
        self.tok_req = torch.repeat_interleave(torch.arange(len(spans), device=dev), extend,
                                               output_size=self.num_tokens)
        self.tok_pos = prefix[self.tok_req] + torch.arange(self.num_tokens, device=dev) - start[self.tok_req]
        self._cache: dict[tuple, object] = {}

    @classmethod
    def decode(cls, rows: torch.Tensor, prefix: torch.Tensor, table: torch.Tensor, block_ratios: tuple[int, ...],
               padding_row: int, max_seq_len: int) -> "StepPlan":
        """The plan of a decode step (one new token per request) from its device rows and prefix lengths
        [B], with static sizes (module docstring): B completed-block entries per ratio, block tables of
        `max_seq_len // ratio` columns (no request may be longer after the step). No host read: a CUDA
        graph captures it and every replay rebuilds it from the refreshed inputs."""
        plan = cls.__new__(cls)
        plan.spans = None
        plan.table, plan.padding_row, plan.device = table, padding_row, table.device
        B = rows.shape[0]
        plan.num_requests = plan.num_tokens = B
        plan.extends = [1] * B
        plan.rows, plan.prefix = rows, prefix
        plan.start = plan.tok_req = torch.arange(B, device=table.device)
        plan.seq = prefix + 1
        plan.tok_pos = prefix
        # The token at `prefix` completes block prefix // ratio when it is that block's last.
        plan._pairs = {ratio: (plan.tok_req, prefix // ratio, (prefix + 1) % ratio == 0) for ratio in block_ratios}
        plan._block_width = {ratio: max_seq_len // ratio for ratio in block_ratios}
        plan._cache = {}
        return plan

    def _cached(self, key: tuple, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    # ---- row sources ---------------------------------------------------------------------------------
    def old_rows(self, length: int, ring: int | None) -> torch.Tensor:
        """[B, length]: where the positions prefix - length .. prefix - 1 of each request are stored: at
        pos mod `ring` of its REQUEST row, or (ring None) at its TOKEN slot. Positions below 0 read
        position 0's place (never used)."""
        def build():
            pos = (self.prefix[:, None] - length + torch.arange(length, device=self.device)[None, :]).clamp(min=0)
            return self.table[self.rows[:, None], pos] if ring is None else pos % ring
        return self._cached(("old", length, ring), build)

    def source_index(self, req: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """Index into [old rows (B x length) ; new rows (T)] of request `req`'s position `pos` (same
        shapes), which must lie in [prefix - length, seq) of that request."""
        prefix = self.prefix[req]
        return torch.where(pos >= prefix, self.num_requests * length + self.start[req] + pos - prefix,
                           req * length + pos - prefix + length)

    def window(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, its `size` window positions as (source index [T, size] over `size - 1` old rows,
        valid [T, size]): positions pos - size + 1 .. pos, those below 0 invalid."""
        def build():
            pos = self.tok_pos[:, None] - size + 1 + torch.arange(size, device=self.device)[None, :]
            valid = pos >= 0
            index = self.source_index(self.tok_req[:, None].expand_as(pos), pos.clamp(min=0), size - 1)
            return index.masked_fill(~valid, 0), valid
        return self._cached(("window", size), build)

    def window_in_ring(self, size: int, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a step of one token per request whose window ring already holds it: per token, its `size`
        window positions as (index [T, size] into the ring flattened over (row, ring slot), valid [T, size])."""
        def build():
            pos = self.tok_pos[:, None] - size + 1 + torch.arange(size, device=self.device)[None, :]
            valid = pos >= 0
            return self.rows[self.tok_req][:, None] * ring + pos.clamp(min=0) % ring, valid
        return self._cached(("window_in_ring", size, ring), build)

    def ring_writes(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, ring slots) [T]: each request's newest min(extend, size) tokens at position mod size
        of its row; its older tokens of the step (overwritten within the step) at the padding row."""
        def build():
            keep = self.tok_pos >= self.seq[self.tok_req] - size
            rows = torch.where(keep, self.rows[self.tok_req], self.padding_row)
            return rows, self.tok_pos % size
        return self._cached(("ring", size), build)

    # ---- compressed blocks ---------------------------------------------------------------------------
    def new_blocks(self, ratio: int, overlap: bool) -> NewBlocks:
        """Blocks [prefix // ratio, seq // ratio) of each request; their rows come from a source with
        `ratio * (1 + overlap) - 1` old rows per request (enough for the block holding `prefix` and,
        with overlap, the one before it). A decode plan's entries that complete no block read row 0 of
        the source and are stored at BLOCK slot 0."""
        def build():
            req, index, real = self._pairs[ratio]
            length = ratio * (1 + int(overlap)) - 1
            offsets = torch.arange(ratio, device=self.device)[None, :]
            own_pos = index[:, None] * ratio + offsets
            own = self.source_index(req[:, None].expand_as(own_pos), own_pos, length)
            prev = has_prev = None
            if overlap:
                has_prev = index > 0
                prev_pos = (own_pos - ratio).clamp(min=0)
                prev = self.source_index(req[:, None].expand_as(prev_pos), prev_pos, length)
                prev = prev.masked_fill(~has_prev[:, None], 0)
            slots = self.table[self.rows[req], index * ratio] // ratio
            if real is not None:
                own = own.masked_fill(~real[:, None], 0)
                prev = None if prev is None else prev.masked_fill(~real[:, None], 0)
                slots = slots.masked_fill(~real, 0)
            return NewBlocks(own, prev, has_prev, index * ratio, slots)
        return self._cached(("new", ratio, overlap), build)

    def blocks(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(BLOCK slots [B, N] of each request's complete blocks after this step, padded to the most any
        request has (a decode plan: to its static width); per token the number of blocks it sees, [T]:
        block i is visible from its last token)."""
        def build():
            n = self._block_width[ratio]
            cols = (torch.arange(n, device=self.device) * ratio).clamp(max=self.table.shape[1] - 1)
            slots = self.table[self.rows[:, None], cols[None, :]] // ratio
            return slots, (self.tok_pos + 1) // ratio
        return self._cached(("blocks", ratio), build)

    def key_mask(self, window_valid: torch.Tensor, ratio: int) -> torch.Tensor:
        """[T, W + N]: a query's window positions that exist, then the blocks of its request it sees."""
        def build():
            slots, visible = self.blocks(ratio)
            seen = torch.arange(slots.shape[1], device=self.device)[None, :] < visible[:, None]
            return torch.cat([window_valid, seen], dim=1)
        return self._cached(("mask", window_valid.shape[1], ratio), build)

    # ---- query tiles ---------------------------------------------------------------------------------
    def tiles(self, bytes_per_token: int, budget: int) -> list[tuple[int, int, int, int]]:
        """Token ranges (a, b) holding whole requests r0..r1-1, or a part of one request (r1 = r0 + 1),
        each at most `budget // bytes_per_token` tokens (at least one)."""
        limit = max(1, budget // max(1, bytes_per_token))
        return self._cached(("tiles", limit), lambda: self._pack(limit))

    def one_token_each(self, r0: int, r1: int) -> bool:
        """Whether requests r0..r1-1 each have exactly one token in this step (a tile of decodes, whose
        per-request tensors then line up with its tokens without a gather)."""
        return all(e == 1 for e in self.extends[r0:r1])

    def _pack(self, limit: int) -> list[tuple[int, int, int, int]]:
        tiles: list[tuple[int, int, int, int]] = []
        open_tile: list[int] | None = None  # [a, b, r0, r1] of the tile still taking whole requests
        start = 0
        for r, extend in enumerate(self.extends):
            if open_tile is not None and open_tile[1] - open_tile[0] + extend <= limit:
                open_tile[1] += extend
                open_tile[3] = r + 1
            else:
                if open_tile is not None:
                    tiles.append(tuple(open_tile))
                    open_tile = None
                if extend <= limit:
                    open_tile = [start, start + extend, r, r + 1]
                else:
                    tiles += [(a, min(a + limit, start + extend), r, r + 1)
                              for a in range(start, start + extend, limit)]
            start += extend
        if open_tile is not None:
            tiles.append(tuple(open_tile))
        return tiles
