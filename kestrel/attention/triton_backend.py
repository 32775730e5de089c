"""Triton attention backend: paged extend and split-K decode kernels over the engine's KV pools."""
from __future__ import annotations

import torch

from kestrel.attention.triton.decode import (LengthAwareSplit, SplitPlan, decode_attention, length_aware_plan,
                                             uniform_splits)
from kestrel.attention.triton.extend import extend_attention
from kestrel.attention.triton.store import store_kv
from kestrel.attention.window_ring import flat, ring_slots, sub_step_tokens, sub_steps
from kestrel.cache.kv_memory import KVPools, window_ring
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer


SPLIT_MAX_EXTEND = 16  # new tokens per request up to which the extend kernel splits the keys
# Whether an eager extend whose last requests each have one new token (a MIXED step's decodes, which the
# scheduler puts after its prefill chunks) sends those to the decode kernel: the extend kernel gives each
# (request, head) a 64-row query tile and reads a request's keys once per query head, where the decode
# kernel reads them once per KV head, splits them across programs and wastes no rows. On the H100 (c64
# closed loop, `bash scripts/gpu.sh OUT mixed-decodes`) a MIXED step of <= 512 new tokens beside 64
# decodes took 15.0 ms instead of 20.9 (docs/benchmarks.md). A module constant so that a benchmark can
# compare both in one process.
DECODE_KERNEL_FOR_MIXED_DECODES = True


class TritonBackend:
    """DECODE batches go to the split-K decode kernel; every other mode (verify trees included) to the
    extend kernel. `decode_split`: None splits every request of a decode batch alike (the uniform rule
    below); a LengthAwareSplit cuts each request by its own length (kestrel.attention.triton.decode).
    A window layer whose K/V are rings (kestrel.attention.window_ring) is read through the ring formula;
    an extend longer than its ring allows runs as sub-steps (eagerly: they need the host lengths)."""

    def __init__(self, pools: KVPools, req_to_token: ReqToTokenPool, upcast: bool, name: str = "triton",
                 decode_split: LengthAwareSplit | None = None) -> None:
        self.name = name
        self.pools = pools
        self.req_to_token = req_to_token
        self.upcast = upcast  # the interpreter computes bf16/fp16 dots wrong: upcast after load there
        self.decode_split = decode_split
        self._q_starts: torch.Tensor | None = None
        self._num_splits = 1
        self._split_plan: SplitPlan | None = None
        # Only window rings address an extend's tokens by request row and index (not by slot).
        self._rings = pools.layout.has_rings
        self._token_rows: torch.Tensor | None = None  # an extend's tokens: their request's row
        self._token_index: torch.Tensor | None = None  # and their index in it (prefix + offset)
        self._sub_steps: dict[int, list] = {}  # sub-step size -> the sub-steps' device tensors
        self._decode_tail = 0  # an eager extend's last requests that the decode kernel serves (`_tail_of`)
        self._tail_rows: tuple[torch.Tensor, ...] = ()  # their pool rows, lengths and new slots
        self._kv_heads = pools.layout.groups[0].buffers[0].shape[0]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode is ForwardMode.DECODE:
            # Uniform rule: from the batch size alone (never from host-side lengths), so a captured graph
            # stays valid for every replay; a replay uses its padded bucket's split count, which may differ
            # from an eager step's, so the two agree to rounding, not bit for bit. The length-aware plan
            # reads the lengths on the device only, so a replay recomputes it from the step it serves.
            self._num_splits = self._uniform_splits(batch.batch_size)
            if self.decode_split is not None:  # device ops on the lengths, captured with the graph
                self._split_plan = length_aware_plan(batch.seq_lens, self._kv_heads, self.decode_split)
        else:
            self._q_starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
            self._sub_steps = {}
            self._decode_tail = self._tail_of(batch)
            if self._decode_tail:
                self._num_splits = self._uniform_splits(self._decode_tail)
                # Copies, not views: a view starting at an odd row is not 16-byte aligned, and Triton
                # compiles a kernel per alignment, so views would compile again mid-serving (~0.3 s
                # steps) where copies reuse the variants the decode graphs' capture compiled.
                tail, tokens = self._decode_tail, batch.out_cache_loc.shape[0]
                self._tail_rows = (batch.req_pool_indices[-tail:].clone(), batch.seq_lens[-tail:].clone(),
                                   batch.out_cache_loc[tokens - tail:].clone())
            if not self._rings:
                return
            # Device ops with a static output size: a captured verify or draft extend recomputes them.
            tokens = batch.out_cache_loc.shape[0]
            req = torch.repeat_interleave(torch.arange(batch.batch_size, device=batch.extend_lens.device),
                                          batch.extend_lens, output_size=tokens)
            self._token_rows = batch.req_pool_indices[req]
            self._token_index = batch.prefix_lens[req] + torch.arange(tokens, device=req.device) - self._q_starts[req]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch) -> torch.Tensor:
        kv = self.pools.layer(layer.layer_id)
        ring = window_ring(kv)
        k_buf, v_buf = (kv.k, kv.v) if ring is None else (flat(kv.k), flat(kv.v))
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        table = self.req_to_token.table
        if batch.forward_mode is ForwardMode.DECODE:  # the decode kernel stores the new K/V itself
            new_slots = batch.out_cache_loc if ring is None else \
                ring_slots(batch.req_pool_indices, batch.seq_lens - 1, ring)
            decode_attention(q, k, v, k_buf, v_buf, out, table, batch.req_pool_indices, batch.seq_lens,
                             new_slots, layer.scaling, layer.sliding_window, self.upcast,
                             self._num_splits, kv.k_scale, kv.v_scale, split_plan=self._split_plan,
                             sinks=layer.sinks, ring=ring or 0)
        elif ring is not None and batch.max_extend > sub_step_tokens(ring, layer.sliding_window):
            self._ring_sub_steps(q, k, v, k_buf, v_buf, out, kv, ring, layer, batch)
        elif self._decode_tail:
            self._extend_then_decodes(q, k, v, k_buf, v_buf, out, kv, layer, batch)
        else:
            slots = batch.out_cache_loc if ring is None else ring_slots(self._token_rows, self._token_index, ring)
            store_kv(k, v, k_buf, v_buf, slots, kv.k_scale, kv.v_scale)
            tree = batch.tree_mask.view(torch.uint8) if batch.tree_mask is not None else None
            # A few new tokens per request (verify, draft extend, a decode-sized chunk): split the keys so
            # that about 256 programs run; like decode's split, from the batch's shape alone. The CPU
            # interpreter runs programs one by one: 2 splits there test the path without the cost.
            few = batch.max_extend <= SPLIT_MAX_EXTEND
            most = 2 if self.upcast else 16
            num_splits = max(1, min(most, 256 // (batch.batch_size * layer.num_heads))) if few else 1
            extend_attention(q, k_buf, v_buf, out, table, batch.req_pool_indices, batch.prefix_lens,
                             batch.extend_lens, self._q_starts, batch.max_extend, layer.scaling,
                             layer.sliding_window, self.upcast, tree, batch.tree_mask_starts, kv.k_scale, kv.v_scale,
                             block_m=16 if few else 64, num_splits=num_splits, sinks=layer.sinks, ring=ring or 0,
                             positions=batch.positions)
        return out.view(-1, layer.num_heads * layer.head_dim)

    def _uniform_splits(self, batch_size: int) -> int:
        """The decode kernel's split count for a batch of `batch_size` one-token requests (`uniform_splits`)."""
        splits = uniform_splits(batch_size, self._kv_heads)
        # The CPU interpreter runs programs one by one: 2 splits test the path without the cost.
        return min(splits, 2) if self.upcast else splits

    def _tail_of(self, batch: ForwardBatch) -> int:
        """How many of an eager extend's last requests have one new token each and go to the decode
        kernel (all of them where every request has one); 0 where the extend kernel serves the whole batch
        (a captured forward, whose host lengths change between replays; a tree; window rings)."""
        lens = batch.extend_lens_cpu
        if not DECODE_KERNEL_FOR_MIXED_DECODES or lens is None or batch.tree_mask is not None or self._rings:
            return 0
        tail = next((i for i, n in enumerate(reversed(lens)) if n != 1), len(lens))
        # Whatever the chunk's size, down to every request's one token: a short chunk (<= SPLIT_MAX_EXTEND)
        # would otherwise take the extend kernel's split variant, which a decode-only workload never
        # compiles before it comes (a 0.35 s step on the H100).
        return tail

    def _extend_then_decodes(self, q, k, v, k_buf, v_buf, out, kv, layer: AttentionLayer,
                             batch: ForwardBatch) -> None:
        """A MIXED step: its prefill chunks (if any) through the extend kernel, its decodes (the last
        `_decode_tail` requests, one token each, the last tokens) through the decode kernel, which stores
        their K/V."""
        heads, tail = batch.batch_size - self._decode_tail, self._decode_tail
        split = q.shape[0] - tail
        table = self.req_to_token.table
        if heads:
            store_kv(k[:split], v[:split], k_buf, v_buf, batch.out_cache_loc[:split], kv.k_scale, kv.v_scale)
            extend_attention(q[:split], k_buf, v_buf, out[:split], table, batch.req_pool_indices[:heads],
                             batch.prefix_lens[:heads], batch.extend_lens[:heads], self._q_starts[:heads],
                             batch.max_extend, layer.scaling, layer.sliding_window, self.upcast,
                             k_scale=kv.k_scale, v_scale=kv.v_scale, sinks=layer.sinks)
        rows, lens, slots = self._tail_rows
        decode_attention(q[split:], k[split:], v[split:], k_buf, v_buf, out[split:], table, rows, lens, slots,
                         layer.scaling, layer.sliding_window, self.upcast, self._num_splits, kv.k_scale,
                         kv.v_scale, sinks=layer.sinks)

    def _ring_sub_steps(self, q, k, v, k_buf, v_buf, out, kv, ring: int, layer: AttentionLayer,
                        batch: ForwardBatch) -> None:
        """An extend (no tree: a verify fits its ring) over window rings, sub-step by sub-step: each
        stores its tokens' K/V, then its queries attend (kestrel.attention.window_ring)."""
        size = sub_step_tokens(ring, layer.sliding_window)
        if size not in self._sub_steps:
            dev = batch.extend_lens.device
            starts = [sum(batch.extend_lens_cpu[:i]) for i in range(len(batch.extend_lens_cpu))]
            parts = []
            for prefix, extend, offset in sub_steps(batch.prefix_lens_cpu, batch.extend_lens_cpu, size):
                tokens = torch.tensor([s + offset + j for s, e in zip(starts, extend) for j in range(e)], device=dev)
                parts.append((tokens, torch.tensor(prefix, device=dev), torch.tensor(extend, device=dev),
                              self._q_starts + offset, max(extend)))
            self._sub_steps[size] = parts
        for tokens, prefix, extend, q_starts, longest in self._sub_steps[size]:
            store_kv(k[tokens], v[tokens], k_buf, v_buf, ring_slots(self._token_rows[tokens],
                                                                 self._token_index[tokens], ring),
                     kv.k_scale, kv.v_scale)
            extend_attention(q, k_buf, v_buf, out, self.req_to_token.table, batch.req_pool_indices, prefix,
                             extend, q_starts, longest, layer.scaling, layer.sliding_window, self.upcast,
                             k_scale=kv.k_scale, v_scale=kv.v_scale, sinks=layer.sinks, ring=ring)
