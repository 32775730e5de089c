"""DeepSeek-V4's sparse attention in one kernel: per query token, one softmax over its window keys and
its compressed entries, with the attention sink, for every head (what `DSV4Backend.attend`'s torch
path computes; docs/design/deepseek-v4.md §2.7).

MQA with one K=V head: every head of a token reads the same key rows, so a program takes one token and a
tile of BLOCK_H heads, loads a tile of BLOCK_N key rows once and uses it for both products of all its
heads (logits q·kᵀ, then p·k: the values are the keys). The softmax is online, in fp32 (exp2, logits
scaled by log2 e). The sink a_h is an extra logit whose value is 0: it starts the running state
(max a_h, sum 1, output 0), so it only enlarges the denominator.

A token's keys are one sequence of `W + n` entries: its window (W rows of `window_source` through
`window_index`, masked by `window_valid`), then its compressed entries, column c of its row of
`entry_table` (a BLOCK slot of `entries`), column c named either by `picks` (ratio 4: the indexer's
picks, -1 = none) or by position (ratio 128: columns below the token's `counts`, its visible blocks).
Both ratios use the plan's per-request block table as is, so no per-token slot list is built in torch
(at an 8k prefill chunk of 64k context, that list would be 32 MiB per ratio-128 layer), and a ratio-128
token's loop stops at its visible blocks rather than at the table's static width (a decode graph's).

Split-K for few tokens (decode): the key sequence is cut into `num_splits` chunks, each program writes a
partial output and its log-sum-exp, and `merge_splits` (the paged decode kernel's stage 2) mixes them;
the sink goes with split 0. The split count comes from static shapes only, and nothing here reads the
device on the host, so a decode step's launch is the same in every replay of a CUDA graph.

Packed FP8 entries (`RopeEntryFP8`) are decoded in registers, exactly as the codec's `decode`: e4m3
nope values times their group's ue8m0 scale (2^(byte - 127)), then the bf16 rope values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel import envs
from kestrel.attention.triton.decode import merge_splits
from kestrel.envs import triton_jit
from kestrel.quant.kv_entries import GROUP, RopeEntryFP8

_LOG2E = 1.4426950408889634
_SM_COUNT: dict[int, int] = {}


@triton_jit
def _entry_rows(E, E16, slots, mask, stride_e, stride_e16, offs_d, d_mask,
                HEAD_DIM: tl.constexpr, FP8: tl.constexpr, NOPE: tl.constexpr, ROPE_OFF16: tl.constexpr,
                SCALE_GROUP: tl.constexpr):
    """Key rows [BLOCK_N, BLOCK_D] of the compressed entries at `slots` (masked rows: 0), as float32 for
    a packed FP8 buffer (exact; the caller converts), else in the buffer's dtype."""
    if FP8:
        row = E + slots[:, None] * stride_e
        is_nope = mask[:, None] & (offs_d < NOPE)[None, :]
        nope = tl.load(row + offs_d[None, :], mask=is_nope, other=0).to(tl.float8e4nv, bitcast=True)
        scale_byte = tl.load(row + NOPE + offs_d[None, :] // SCALE_GROUP, mask=is_nope, other=127)
        scale = (scale_byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        # bf16 rope values through their int16 bits: the float32 with the same top half, exactly.
        is_rope = mask[:, None] & ((offs_d >= NOPE) & d_mask)[None, :]
        rope = tl.load(E16 + slots[:, None] * stride_e16 + ROPE_OFF16 + (offs_d - NOPE)[None, :],
                       mask=is_rope, other=0)
        rope = ((rope.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        return tl.where((offs_d < NOPE)[None, :], nope.to(tl.float32) * scale, rope)
    else:
        return tl.load(E + slots[:, None] * stride_e + offs_d[None, :], mask=mask[:, None] & d_mask[None, :],
                       other=0.0)


@triton_jit
def _fold(q, k, valid, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """Fold key rows k [BLOCK_N, BLOCK_D] (valid [BLOCK_N]) into the online softmax of q [BLOCK_H, BLOCK_D]
    (log2 units); the values are the keys."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split that has seen nothing yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return m_new, l_i, acc


@triton_jit
def _sparse_kernel(
    Q, O, mid_o, mid_lse, sink, W_src, W_index, W_valid, E, E16, E_table, tok_row, picks, counts,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ws, stride_wit, stride_wvt, stride_e, stride_e16,
    stride_tab, stride_pt, stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    num_heads, window, n_entries, num_splits, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ENTRIES: tl.constexpr, HAS_PICKS: tl.constexpr, FP8: tl.constexpr, NOPE: tl.constexpr,
    ROPE_OFF16: tl.constexpr, SCALE_GROUP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:  # the interpreter computes bf16 wrong: work in float32 there
        q = q.to(tl.float32)

    # This token's keys: W window rows, then its compressed entries' columns [0, n).
    n = 0
    row = 0
    if HAS_ENTRIES:
        row = tl.load(tok_row + t)
        if HAS_PICKS:
            n = n_entries
        else:
            n = tl.load(counts + t).to(tl.int32)
    total = window + n
    chunk = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, total)

    # Split 0 starts from the sink: max a_h, sum exp(a_h - a_h) = 1, output 0.
    a = tl.load(sink + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    first = split == 0
    m_i = tl.where(first, a, float("-inf"))
    l_i = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    for j0 in range(lo, tl.minimum(hi, window), BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < tl.minimum(hi, window)
        src = tl.load(W_index + t * stride_wit + offs_n, mask=n_mask, other=0)
        valid = n_mask & (tl.load(W_valid + t * stride_wvt + offs_n, mask=n_mask, other=0) != 0)
        k = tl.load(W_src + src[:, None] * stride_ws + offs_d[None, :], mask=valid[:, None] & d_mask[None, :],
                    other=0.0).to(q.dtype)
        m_i, l_i, acc = _fold(q, k, valid, m_i, l_i, acc, qk_scale, PRECISION)
    if HAS_ENTRIES:
        for j0 in range(tl.maximum(lo, window) - window, hi - window, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            valid = cols < hi - window
            if HAS_PICKS:
                cols = tl.load(picks + t * stride_pt + cols, mask=valid, other=-1)
                valid = cols >= 0
            slots = tl.load(E_table + row * stride_tab + cols, mask=valid, other=0)
            k = _entry_rows(E, E16, slots, valid, stride_e, stride_e16, offs_d, d_mask,
                            HEAD_DIM, FP8, NOPE, ROPE_OFF16, SCALE_GROUP).to(q.dtype)
            m_i, l_i, acc = _fold(q, k, valid, m_i, l_i, acc, qk_scale, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(O + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=hd_mask)
    else:  # natural-log lse for the merge; an empty split gets -inf (weight 0)
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_i)) * 0.6931471805599453)
        tl.store(mid_o + t * stride_mt + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :], out,
                 mask=hd_mask)
        tl.store(mid_lse + t * stride_lt + heads * stride_lh + split, lse, mask=h_mask)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the split path
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def default_splits(tokens: int, head_tiles: int, keys: int, block_n: int, device: torch.device) -> int:
    """Splits per token so that the grid covers the device about twice over, each split at least one key
    tile: from static sizes only (the same for every replay of a captured decode step)."""
    programs = tokens * head_tiles
    want = -(-2 * _sm_count(device) // max(1, programs))
    return max(1, min(want, keys // block_n, 64))


def sparse_attention(q: torch.Tensor, window_source: torch.Tensor, window_index: torch.Tensor,
                     window_valid: torch.Tensor, sink: torch.Tensor, scale: float, *,
                     entries: torch.Tensor | None = None, codec: RopeEntryFP8 | None = None,
                     entry_table: torch.Tensor | None = None, tok_row: torch.Tensor | None = None,
                     picks: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                     num_splits: int | None = None, block_h: int = 16, block_n: int = 32,
                     num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D] in q's dtype (module docstring). Window: key rows
    `window_source[window_index]` [T, W] (source in q's dtype) where `window_valid` [T, W]. Compressed
    entries (optional): `entries` [slots, D] in q's dtype, or packed uint8 [slots, codec.nbytes] with a
    `RopeEntryFP8` codec; `entry_table` [R, N] BLOCK slots, `tok_row` [T] each token's row of it; then
    either `picks` [T, k] (columns, -1 = none) or `counts` [T] (columns 0 .. counts - 1). `sink` [H]."""
    # The kernel steps rows by their strides and assumes unit stride along the last dim.
    q, window_source, window_index, window_valid, entries, entry_table, picks = (
        t if t is None or t.stride(-1) == 1 else t.contiguous()
        for t in (q, window_source, window_index, window_valid, entries, entry_table, picks))
    T, H, D = q.shape
    if window_source.dtype != q.dtype:
        raise ValueError(f"the window source must be in q's dtype {q.dtype}, got {window_source.dtype}")
    has_entries = entries is not None
    if has_entries and (entry_table is None or tok_row is None or (picks is None) == (counts is None)):
        raise ValueError("compressed entries need entry_table, tok_row and exactly one of picks / counts")
    fp8 = codec is not None
    if fp8:
        if not isinstance(codec, RopeEntryFP8) or codec.width != D or entries.dtype != torch.uint8:
            raise ValueError(f"packed entries must be uint8 rows of a RopeEntryFP8 codec of width {D}, got "
                             f"{codec} over {entries.dtype}")
        if codec.rope_offset % 2 or entries.stride(0) % 2:
            raise ValueError("the packed rows' bf16 rope values must be 2-byte aligned")
    elif has_entries and entries.dtype != q.dtype:
        raise ValueError(f"unpacked entries must be in q's dtype {q.dtype}, got {entries.dtype}")
    dev = q.device
    out = torch.empty_like(q)
    if T == 0:  # Triton refuses an empty grid
        return out
    W = window_index.shape[1]
    n_entries = 0 if not has_entries else (picks.shape[1] if picks is not None else entry_table.shape[1])
    block_d = triton.next_power_of_2(D)
    head_tiles = triton.cdiv(H, block_h)
    if num_splits is None:
        num_splits = default_splits(T, head_tiles, W + n_entries, block_n, dev)
    direct = num_splits == 1
    mid_shape = (1, 1, 1) if direct else (T, H, num_splits)
    mid_o = torch.empty((*mid_shape, block_d), dtype=torch.float32, device=dev)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=dev)
    dummy = window_index  # stands for the absent pointers (never read)
    E = entries if has_entries else window_source
    E16 = entries.view(torch.int16) if fp8 else E
    table = entry_table if has_entries else dummy
    _sparse_kernel[(T, head_tiles, num_splits)](
        q, out, mid_o, mid_lse, sink, window_source, window_index, window_valid.view(torch.uint8), E, E16, table,
        tok_row if has_entries else dummy, picks if picks is not None else dummy,
        counts if counts is not None else dummy,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), window_source.stride(0), window_index.stride(0),
        window_valid.stride(0), E.stride(0), E16.stride(0), table.stride(0),
        picks.stride(0) if picks is not None else 0, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), H, W, n_entries, num_splits, scale * _LOG2E,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=block_n, HAS_ENTRIES=has_entries,
        HAS_PICKS=picks is not None, FP8=fp8, NOPE=codec.nope if fp8 else 0,
        ROPE_OFF16=codec.rope_offset // 2 if fp8 else 0, SCALE_GROUP=GROUP, UPCAST=envs.triton_interpret(),
        # float32 stays float32 (TF32 would drift from the torch path); half types use tensor cores.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DIRECT=direct,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        merge_splits(mid_o, mid_lse, out, num_splits)
    return out
