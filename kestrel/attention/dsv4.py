"""DeepSeek-V4's attention backend (torch implementation): its KV state in the engine's KV memory and
the one softmax over sliding window ∪ compressed entries with the attention sink.

The model owns the math (projections, the compressor's pooling, the indexer's scores); this backend
owns where state lives and the attention itself, so a faster kernel replaces only this file. Buffers,
by name, in `pools.layer(layer_id)` (declared by `kestrel/models/deepseek_v4/kv_layout.py`):
- the window's raw K=V: `swa_kv` [rows, ring, D], REQUEST, position p at p mod ring (main layers); or
  `win_kv` [slots, D], TOKEN, at the position's slot (the MTP layer in a NEXTN draft's pools, whose
  lanes read and write through their own `req_to_token` rows);
- compressor state (REQUEST): raw rows of the current partial block (and, with overlap, the last full
  one) at p mod ring, e.g. `comp_kv` / `comp_score`, `idx_kv` / `idx_score`;
- compressed entries (BLOCK): block i of a request at `req_to_token[row, i * ratio] // ratio`.

A step is an extend of `extend` tokens after `prefix` already processed ones (decode = extend of 1):
reads of earlier state happen before this step's writes, so one path serves prefill chunks and decode.
A TARGET_VERIFY is such an extend too, so its tree must be a chain (speculative_eagle_topk=1): the
per-request state is kept by position, one entry per position. Its rejected tokens' writes land in
ring rows no later step reads (the layout makes the rings that much longer) and in compressed blocks
that the step completing them again rewrites.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kestrel.attention.hybrid import HybridBackend

if TYPE_CHECKING:
    from kestrel.cache.kv_memory import KVPools
    from kestrel.cache.req_to_token import ReqToTokenPool
    from kestrel.core.forward_batch import ForwardBatch

# Queries per attention tile: bounds the [tile, heads, keys] logits, since a tile needs only the window
# before it plus the compressed entries, whatever the chunk length.
_QUERY_TILE = 256


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

    @property
    def tokens(self) -> slice:
        return slice(self.start, self.start + self.extend)


class DSV4Backend:
    def __init__(self, pools: "KVPools", req_to_token: "ReqToTokenPool", name: str = "dsv4") -> None:
        self.name = name
        self.pools = pools
        self.req_to_token = req_to_token
        self.spans: list[V4Span] = []
        self._block_slots: dict[int, list[torch.Tensor]] = {}

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        if batch.prefix_lens_cpu is None or batch.extend_lens_cpu is None:
            raise ValueError("the dsv4 backend needs the batch's host lengths (it does not run in CUDA graphs)")
        rows = batch.req_pool_indices.tolist()
        starts = [0]
        for e in batch.extend_lens_cpu[:-1]:
            starts.append(starts[-1] + e)
        self.spans = [V4Span(r, p, e, s) for r, p, e, s in zip(rows, batch.prefix_lens_cpu, batch.extend_lens_cpu,
                                                                starts)]
        self._block_slots = {}
        self._out_slots = batch.out_cache_loc
        if batch.tree_mask is not None:
            chain = torch.cat([torch.ones(e, e, dtype=torch.bool, device=batch.tree_mask.device).tril().flatten()
                               for e in batch.extend_lens_cpu])
            if not torch.equal(batch.tree_mask, chain):
                raise ValueError("the dsv4 backend verifies chains only: set speculative_eagle_topk=1")

    # ---- sliding window ------------------------------------------------------------------------------
    def window_keys(self, layer_id: int, kv: torch.Tensor, window_size: int) -> list[tuple[torch.Tensor, int]]:
        """Per request: (keys of positions [first, seq), first), i.e. the `window_size - 1` positions
        before this step's first query and the step's own keys kv [T, D]; then the step's keys are stored."""
        layer = self.pools.layer(layer_id)
        per_slot = getattr(layer, "win_kv", None)
        ring = None if per_slot is not None else layer.swa_kv
        out = []
        for s in self.spans:
            first = max(0, s.prefix - window_size + 1)
            if per_slot is not None:
                old = per_slot[self.req_to_token.table[s.row, first:s.prefix]]
            else:
                old = ring[s.row, torch.arange(first, s.prefix, device=kv.device) % ring.shape[1]]
            out.append((torch.cat([old.to(kv.dtype), kv[s.tokens]]), first))
        if per_slot is not None:
            per_slot[self._out_slots] = kv.to(per_slot.dtype)
            return out
        size = ring.shape[1]
        for s in self.spans:
            keep = torch.arange(max(s.prefix, s.seq - size), s.seq, device=kv.device)
            ring[s.row, keep % size] = kv[s.start + keep - s.prefix].to(ring.dtype)
        return out

    # ---- compressor state ----------------------------------------------------------------------------
    def compressor_rows(self, layer_id: int, names: tuple[str, str], kv: torch.Tensor, score: torch.Tensor,
                        ratio: int, overlap: bool) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Per request: (kv rows, score rows, first) for positions [first, seq), first being the start of
        the block holding `prefix` (of the one before it, with overlap): every row the blocks that
        complete in this step pool over. The state ring then keeps the newest rows."""
        rings = [getattr(self.pools.layer(layer_id), n) for n in names]
        size = rings[0].shape[1]
        out = []
        for s in self.spans:
            first = max(0, (s.prefix // ratio - int(overlap)) * ratio)
            old = torch.arange(first, s.prefix, device=kv.device) % size
            out.append(tuple(torch.cat([ring[s.row, old].to(new.dtype), new[s.tokens]])
                             for ring, new in zip(rings, (kv, score))) + (first,))
        for s in self.spans:
            keep = torch.arange(max(s.prefix, s.seq - size), s.seq, device=kv.device)
            for ring, new in zip(rings, (kv, score)):
                ring[s.row, keep % size] = new[s.start + keep - s.prefix].to(ring.dtype)
        return out

    # ---- compressed entries --------------------------------------------------------------------------
    def _blocks(self, ratio: int) -> list[torch.Tensor]:
        """Per request, the BLOCK index of each of its complete blocks (after this step)."""
        if ratio not in self._block_slots:
            table = self.req_to_token.table
            self._block_slots[ratio] = [
                table[s.row, torch.arange(s.seq // ratio, device=table.device) * ratio] // ratio for s in self.spans]
        return self._block_slots[ratio]

    def write_blocks(self, layer_id: int, name: str, ratio: int, entries: list[tuple[int, torch.Tensor]]) -> None:
        """Per request (first block index, entries [n, c]): the blocks that completed in this step."""
        buf = getattr(self.pools.layer(layer_id), name)
        for index, (first, new) in zip(self._blocks(ratio), entries):
            if new.shape[0]:
                buf[index[first:first + new.shape[0]]] = new.to(buf.dtype)

    def read_blocks(self, layer_id: int, name: str, ratio: int) -> list[torch.Tensor]:
        """Per request, all its complete blocks' entries [seq // ratio, c]."""
        buf = getattr(self.pools.layer(layer_id), name)
        return [buf[index] for index in self._blocks(ratio)]

    # ---- attention -----------------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, window: list[tuple[torch.Tensor, int]], window_size: int,
               compressed: list[torch.Tensor] | None, visible: list[torch.Tensor] | None, sink: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]: per query, one softmax over its window keys (positions within
        `window_size`, itself included) and the compressed entries `visible[i]` [extend, n] allows; the
        sink a_h is an extra logit with a zero value, so it only enlarges the denominator."""
        out = torch.empty_like(q)
        sink = sink.float()[None, :]
        for i, s in enumerate(self.spans):
            keys_all, first = window[i]
            for a in range(0, s.extend, _QUERY_TILE):
                b = min(s.extend, a + _QUERY_TILE)
                t_pos = torch.arange(s.prefix + a, s.prefix + b, device=q.device)[:, None]
                lo = max(first, s.prefix + a - window_size + 1)
                keys = keys_all[lo - first:s.prefix + b - first]
                k_pos = torch.arange(lo, s.prefix + b, device=q.device)[None, :]
                mask = (k_pos <= t_pos) & (t_pos - k_pos < window_size)
                if compressed is not None:
                    keys = torch.cat([keys, compressed[i].to(keys.dtype)])
                    mask = torch.cat([mask, visible[i][a:b]], dim=1)
                keys = keys.float()
                logits = torch.einsum("thd,kd->thk", q[s.start + a:s.start + b].float(), keys) * scale
                logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
                top = torch.maximum(logits.amax(-1), sink)
                weights = torch.exp(logits - top[..., None])
                denom = weights.sum(-1) + torch.exp(sink - top)
                out[s.start + a:s.start + b] = (torch.einsum("thk,kd->thd", weights, keys)
                                                / denom[..., None]).to(q.dtype)
        return out


def dsv4_backend(batch: "ForwardBatch") -> DSV4Backend:
    """The batch's V4 backend (the half serving its forward mode, when prefill and decode differ)."""
    backend = batch.attn_backend
    if isinstance(backend, HybridBackend):
        backend = backend.backend_for(batch.forward_mode)
    if not isinstance(backend, DSV4Backend):
        raise TypeError(f"DeepSeek-V4 attention needs the 'dsv4' attention backend, got {backend.name!r}")
    return backend
