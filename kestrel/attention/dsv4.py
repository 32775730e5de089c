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
K=V entries and indexer keys are in the model dtype, or packed (`--kv-cache-dtype fp8_e4m3`: a buffer's
`<name>_codec`, kestrel/quant/kv_entries.py): encoded on store, and decoded to the compute dtype right
after each gather, so only the rows a step reads are decoded. A step's own window keys are read back
as stored too, so what a query sees does not depend on how its sequence was cut into steps.

A step is an extend of `extend` tokens after `prefix` already processed ones (decode = extend of 1):
reads of earlier state happen before this step's writes, so one path serves prefill chunks and decode.
No layer loops over requests: `dsv4_plan.StepPlan` builds every gather/scatter index once per step (from
the host lengths; a decode step of a CUDA graph, whose batch has none, from the device lengths with
static sizes: `StepPlan.decode`, for sequences up to `graph_max_seq_len`), and
the attention runs one softmax per query over its window and its selected (ratio 4) or all visible
(ratio 128) compressed entries, with the sink: on CUDA in one Triton kernel
(`kestrel/attention/triton/dsv4_sparse.py`, which reads the key rows and decodes packed entries in
registers); elsewhere, and as the kernel's reference, in torch, gathering each query's keys for all
queries and heads in query tiles that bound its memory.
A TARGET_VERIFY is such an extend too, so its tree must be a chain (speculative_eagle_topk=1): the
per-request state is kept by position, one entry per position. Its rejected tokens' writes land in
ring rows no later step reads (the layout makes the rings that much longer) and in compressed blocks
that the step completing them again rewrites.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kestrel.attention.dsv4_plan import NewBlocks, StepPlan, V4Span
from kestrel.attention.hybrid import HybridBackend
from kestrel.cache.kv_layout import Indexing
from kestrel.core.forward_mode import ForwardMode

if TYPE_CHECKING:
    from kestrel.cache.kv_memory import KVPools
    from kestrel.cache.req_to_token import ReqToTokenPool
    from kestrel.core.forward_batch import ForwardBatch

__all__ = ["DSV4Backend", "V4Span", "WindowKeys", "dsv4_backend"]

# Bytes a query tile's gathered keys and fp32 logits may take: bounds a prefill chunk's working set
# (a 32k-context ratio-4 query gathers 640 keys of 1 KiB) without splitting a decode batch.
TILE_BYTES = 512 * 2**20

# The longest sequence a captured decode step serves: its static plan scans this many positions' blocks
# (the indexer's keys and scores, the ratio-128 entries) for every request of its bucket, whatever the
# live lengths, so it bounds the graphs' memory and time; longer decodes run eagerly (module docstring).
GRAPH_MAX_CONTEXT = 65536


_FP32_OUT: dict[str, bool] = {}


def _fp32_out(device: torch.device) -> bool:
    """Whether this device's matmuls take out_dtype=float32 for half inputs (CUDA builds of recent torch)."""
    if device.type not in _FP32_OUT:
        try:  # the layouts `attend` passes: a transposed second operand, 2-D and batched
            x = torch.ones(2, 3, 4, dtype=torch.bfloat16, device=device)
            outs = (torch.bmm(x, x.transpose(1, 2), out_dtype=torch.float32),
                    torch.mm(x[0], x[0].T, out_dtype=torch.float32))
            _FP32_OUT[device.type] = all(o.dtype == torch.float32 and bool((o == 4).all()) for o in outs)
        except (RuntimeError, NotImplementedError, TypeError):
            _FP32_OUT[device.type] = False
    return _FP32_OUT[device.type]


def logits_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (2-D or batched 3-D) in a's dtype with the result in float32: unrounded where the device
    supports it (as a flash kernel keeps its logits), else rounded to a's dtype first."""
    if a.dtype == torch.float32:
        return a @ b
    if _fp32_out(a.device):
        return (torch.mm if a.dim() == 2 else torch.bmm)(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _stored(values: torch.Tensor, buf: torch.Tensor, codec) -> torch.Tensor:
    """What buffer `buf` (with its codec, or None) stores for `values`."""
    return values.to(buf.dtype) if codec is None else codec.encode(values)


def _values(rows: torch.Tensor, codec, dtype: torch.dtype) -> torch.Tensor:
    """The values gathered stored rows stand for, in `dtype`."""
    return rows.to(dtype) if codec is None else codec.decode(rows, dtype)


# A decode step reads its window keys straight from the ring (`window_keys`); False gathers the earlier rows
# into a copy first, as any other step does (a benchmark sets it to compare in one process).
DECODE_WINDOW_IN_RING = True


@dataclass(frozen=True)
class WindowKeys:
    """Every query's window keys as a gather: `source[index]` [T, W, D], `valid` [T, W]."""

    source: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor


class DSV4Backend:
    def __init__(self, pools: "KVPools", req_to_token: "ReqToTokenPool", name: str = "dsv4",
                 sparse_kernel: bool | None = None) -> None:
        """`sparse_kernel`: whether `attend` runs the Triton kernel (None: on CUDA when Triton is
        installed; True on CPU needs TRITON_INTERPRET=1, the tests' interpreter). `kernel_options`:
        keyword arguments for it (tile sizes, splits: `sparse_attention`'s), set by tests and benchmarks."""
        self.name = name
        self.sparse_kernel = sparse_kernel
        self.kernel_options: dict[str, int] = {}
        self.pools = pools
        self.req_to_token = req_to_token
        self.plan: StepPlan | None = None
        self._block_ratios: tuple[int, ...] | None = None  # the layout's, read on the first step

    @property
    def graph_max_seq_len(self) -> int:
        """Positions a captured decode step's block tables cover (`CudaGraphRunner.can_run` reads it)."""
        return min(self.req_to_token.table.shape[1], GRAPH_MAX_CONTEXT)

    @property
    def spans(self) -> list[V4Span]:
        return self.plan.spans

    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        if self._block_ratios is None:
            self._block_ratios = tuple(sorted({g.ratio for g in self.pools.layout.groups
                                               if g.indexing is Indexing.BLOCK}))
        self._out_slots = batch.out_cache_loc
        if batch.prefix_lens_cpu is None or batch.extend_lens_cpu is None:
            # A CUDA-graph batch: its lengths are on the device only, so the plan takes the decode
            # step's static sizes and is built from them by ops the graph captures.
            if batch.forward_mode is not ForwardMode.DECODE or batch.max_extend != 1:
                raise ValueError(f"the dsv4 backend runs {batch.forward_mode.value} batches only with their host "
                                 "lengths (CUDA graphs capture its decode steps alone)")
            self.plan = StepPlan.decode(batch.req_pool_indices, batch.prefix_lens, self.req_to_token.table,
                                        self._block_ratios, self.req_to_token.padding_row, self.graph_max_seq_len)
            return
        rows = batch.req_pool_indices.tolist()
        starts = [0]
        for e in batch.extend_lens_cpu[:-1]:
            starts.append(starts[-1] + e)
        spans = [V4Span(r, p, e, s) for r, p, e, s in zip(rows, batch.prefix_lens_cpu, batch.extend_lens_cpu, starts)]
        self.plan = StepPlan(spans, self.req_to_token.table, self._block_ratios, self.req_to_token.padding_row)
        if batch.tree_mask is not None:
            chain = torch.cat([torch.ones(e, e, dtype=torch.bool, device=batch.tree_mask.device).tril().flatten()
                               for e in batch.extend_lens_cpu])
            if not torch.equal(batch.tree_mask, chain):
                raise ValueError("the dsv4 backend verifies chains only: set speculative_eagle_topk=1")

    # ---- sliding window ------------------------------------------------------------------------------
    def window_keys(self, layer_id: int, kv: torch.Tensor, window_size: int) -> WindowKeys:
        """Each query's window (positions pos - window_size + 1 .. pos, itself included) over the stored
        keys of earlier steps and this step's keys kv [T, D]; then this step's keys are stored."""
        plan = self.plan
        layer = self.pools.layer(layer_id)
        per_slot = getattr(layer, "win_kv", None)
        if (DECODE_WINDOW_IN_RING and per_slot is None and layer.swa_kv_codec is None and layer.swa_kv.dtype == kv.dtype
                and layer.swa_kv.shape[1] >= window_size and plan.num_tokens == plan.num_requests):
            # One token per request: store it first (its ring slot held a position past every window), then
            # read the whole window from the ring in place, with no copy of the earlier rows.
            ring = layer.swa_kv
            ring[plan.ring_writes(ring.shape[1])] = kv
            index, valid = plan.window_in_ring(window_size, ring.shape[1])
            return WindowKeys(ring.flatten(0, 1), index, valid)
        if per_slot is not None:
            codec = layer.win_kv_codec
            old = per_slot[plan.old_rows(window_size - 1, None)]
        else:
            ring, codec = layer.swa_kv, layer.swa_kv_codec
            old = ring[plan.rows[:, None], plan.old_rows(window_size - 1, ring.shape[1])]
        stored = _stored(kv, per_slot if per_slot is not None else ring, codec)
        new = kv if codec is None else codec.decode(stored, kv.dtype)
        index, valid = plan.window(window_size)
        keys = WindowKeys(torch.cat([_values(old.flatten(0, 1), codec, kv.dtype), new]), index, valid)
        if per_slot is not None:
            per_slot[self._out_slots] = stored
        else:
            ring[plan.ring_writes(ring.shape[1])] = stored
        return keys

    # ---- compressor state ----------------------------------------------------------------------------
    def compressor_rows(self, layer_id: int, names: tuple[str, str], kv: torch.Tensor, score: torch.Tensor,
                        ratio: int, overlap: bool) -> tuple[NewBlocks, torch.Tensor, torch.Tensor] | None:
        """The blocks this step completes and the row sources their candidate indices point into (kv,
        score: the stored rows before each request's prefix, then this step's rows); None when no block
        completes. The state rings then keep the newest rows."""
        plan = self.plan
        rings = [getattr(self.pools.layer(layer_id), n) for n in names]
        blocks = plan.new_blocks(ratio, overlap)
        sources = None
        if blocks.count:
            old = plan.old_rows(ratio * (1 + int(overlap)) - 1, rings[0].shape[1])
            sources = [torch.cat([ring[plan.rows[:, None], old].flatten(0, 1).to(new.dtype), new])
                       for ring, new in zip(rings, (kv, score))]
        for ring, new in zip(rings, (kv, score)):
            ring[plan.ring_writes(ring.shape[1])] = new.to(ring.dtype)
        return None if sources is None else (blocks, *sources)

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a step of one new token per request: (REQUEST rows [B], the tokens' positions [B], the
        req_to_token table), what a compressor's one-launch decode path (`triton_ops.compress_decode`)
        reads; None for any other step."""
        plan = self.plan
        if plan.num_tokens != plan.num_requests:
            return None
        return plan.rows, plan.tok_pos, plan.table

    def state_rings(self, layer_id: int, names: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
        """A compressor's state rings (kv rows, score rows) [REQUEST rows, ring, width]."""
        layer = self.pools.layer(layer_id)
        return getattr(layer, names[0]), getattr(layer, names[1])

    # ---- compressed entries --------------------------------------------------------------------------
    def write_blocks(self, layer_id: int, name: str, blocks: NewBlocks, entries: torch.Tensor) -> None:
        """Store the entries [N, c] of the blocks this step completed."""
        self.write_entries(layer_id, name, blocks.slots, entries)

    def write_entries(self, layer_id: int, name: str, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Store entries [N, c] at BLOCK slots [N] of buffer `name`."""
        layer = self.pools.layer(layer_id)
        buf = getattr(layer, name)
        buf[slots] = _stored(entries, buf, getattr(layer, f"{name}_codec"))

    def read_blocks(self, layer_id: int, name: str, ratio: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(every request's complete blocks' entries [B, N, c] in `dtype`, padded; per token how many it
        sees [T])."""
        slots, visible = self.plan.blocks(ratio)
        layer = self.pools.layer(layer_id)
        return _values(getattr(layer, name)[slots], getattr(layer, f"{name}_codec"), dtype), visible

    def block_entries(self, layer_id: int, name: str,
                      ratio: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(buffer `name` itself [BLOCK slots, c] when it stores values in the model dtype, else None; every
        request's block table [B, N], padded as `read_blocks`; per token how many blocks it sees [T]): what
        a kernel that reads the entries in place takes."""
        slots, visible = self.plan.blocks(ratio)
        layer = self.pools.layer(layer_id)
        return (getattr(layer, name) if getattr(layer, f"{name}_codec") is None else None), slots, visible

    def query_tiles(self, bytes_per_token: int) -> list[tuple[int, int, int, int]]:
        """Token ranges (a, b) over requests r0..r1-1 whose per-token working set fits `TILE_BYTES`."""
        return self.plan.tiles(bytes_per_token, TILE_BYTES)

    def per_token(self, per_request: torch.Tensor, a: int, b: int, r0: int, r1: int) -> torch.Tensor:
        """Rows of `per_request` [B, ...] for the tile's tokens a..b-1 (of requests r0..r1-1): a view when
        each of those requests has one token, else a gather."""
        if self.plan.one_token_each(r0, r1):
            return per_request[r0:r1]
        return per_request[self.plan.tok_req[a:b]]

    # ---- attention -----------------------------------------------------------------------------------
    def attend(self, layer_id: int, q: torch.Tensor, window: WindowKeys, sink: torch.Tensor, scale: float,
               ratio: int = 0, selected: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]: per query, one softmax over its window keys and its compressed
        entries (ratio 4: the blocks `selected` [T, k] names, -1 = none; ratio 128: every visible
        block); the sink a_h is an extra logit with a zero value, so it only enlarges the denominator.
        Both products run in q's dtype (fp32 accumulation, fp32 logits: `logits_f32`); the softmax in fp32.
        With `sparse_kernel` (module docstring) one Triton kernel computes the same."""
        if self._use_kernel(q.device):
            return self._attend_kernel(layer_id, q, window, sink, scale, ratio, selected)
        T, H, D = q.shape
        sink = sink.float()[None, :]
        width = window.index.shape[1]
        shared = slots = codec = None
        n = 0
        if ratio:
            layer = self.pools.layer(layer_id)
            buf, codec = layer.ckv, layer.ckv_codec
            slots, _ = self.plan.blocks(ratio)
            if selected is None:
                shared = _values(buf[slots], codec, q.dtype)  # [B, N, D]: a request's queries share its blocks
                n = shared.shape[1]
            else:
                n = selected.shape[1]
        # Which keys each query may see: the window's valid positions, then the visible blocks (ratio
        # 128: the same for every layer of the step) or the indexer's picks.
        if shared is not None:
            seen = self.plan.key_mask(window.valid, ratio)
        elif selected is not None:
            seen = torch.cat([window.valid, selected >= 0], dim=1)
        else:
            seen = window.valid
        keys_bytes = (width + n) * D * q.element_size()
        if selected is not None and codec is not None:  # each tile decodes its picks
            keys_bytes += n * codec.decode_bytes
        tiles = self.query_tiles(keys_bytes + 3 * H * (width + n) * 4)
        out = torch.empty_like(q) if len(tiles) > 1 else None
        for a, b, r0, r1 in tiles:
            qt = q[a:b]
            keys = window.source[window.index[a:b]].to(q.dtype)  # [t, W, D]
            logits = [logits_f32(qt, keys.transpose(1, 2))]
            extra = None
            if shared is not None:
                if r1 - r0 == 1:  # one request: its blocks once, not per query
                    extra = shared[r0]
                    logits.append(logits_f32(qt.flatten(0, 1), extra.T).view(b - a, H, n))
                else:
                    extra = self.per_token(shared, a, b, r0, r1)
                    logits.append(logits_f32(qt, extra.transpose(1, 2)))
            elif selected is not None:
                chosen = selected[a:b].clamp(min=0)
                extra = _values(buf[slots[self.plan.tok_req[a:b, None], chosen]], codec, q.dtype)  # [t, k, D]
                logits.append(logits_f32(qt, extra.transpose(1, 2)))
            logits = (torch.cat(logits, -1) if len(logits) > 1 else logits[0]) * scale
            logits = torch.where(seen[a:b, None, :], logits, float("-inf"))
            top = torch.maximum(logits.amax(-1), sink)
            weights = torch.exp(logits - top[..., None])
            denom = weights.sum(-1) + torch.exp(sink - top)
            probs = (weights / denom[..., None]).to(q.dtype)
            o = torch.bmm(probs[..., :width], keys)
            if extra is not None and extra.dim() == 2:
                o += (probs[..., width:].flatten(0, 1) @ extra).view(b - a, H, D)
            elif extra is not None:
                o += torch.bmm(probs[..., width:], extra)
            if out is None:
                return o
            out[a:b] = o
        return out

    def _use_kernel(self, device: torch.device) -> bool:
        if self.sparse_kernel is None:
            return device.type == "cuda" and _triton_installed()
        return self.sparse_kernel

    def _attend_kernel(self, layer_id: int, q: torch.Tensor, window: WindowKeys, sink: torch.Tensor, scale: float,
                       ratio: int, selected: torch.Tensor | None) -> torch.Tensor:
        """`attend` through the Triton kernel: it takes the plan's per-request block table as is, with the
        indexer's picks (ratio 4) or each token's visible count (ratio 128), so no per-token key list is
        built here."""
        from kestrel.attention.triton.dsv4_sparse import sparse_attention

        entries = {}
        if ratio:
            layer = self.pools.layer(layer_id)
            slots, visible = self.plan.blocks(ratio)
            entries = dict(entries=layer.ckv, codec=layer.ckv_codec, entry_table=slots, tok_row=self.plan.tok_req,
                           picks=selected, counts=visible if selected is None else None)
        return sparse_attention(q, window.source, window.index, window.valid, sink, scale, **entries,
                                **self.kernel_options)


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def dsv4_backend(batch: "ForwardBatch") -> DSV4Backend:
    """The batch's V4 backend (the half serving its forward mode, when prefill and decode differ)."""
    backend = batch.attn_backend
    if isinstance(backend, HybridBackend):
        backend = backend.backend_for(batch.forward_mode)
    if not isinstance(backend, DSV4Backend):
        raise TypeError(f"DeepSeek-V4 attention needs the 'dsv4' attention backend, got {backend.name!r}")
    return backend
