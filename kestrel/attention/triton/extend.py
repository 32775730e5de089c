"""Paged extend attention: each request's new tokens attend to its cached prefix and to themselves.

The new tokens' K/V are already in the pool, so one loop over the request's `req_to_token` row covers
prefix and new tokens alike. Grid: (request, query head, block of new tokens); variable lengths in one
launch. Online softmax in float32.

A few new tokens per request over a long prefix (a speculative verify: 4-16 tokens) would give the GPU
one program per (request, head) walking the whole prefix alone, so there the keys are split into
`num_splits` chunks, each program writes a partial output and its log-sum-exp, and the decode kernel's
merge combines them (at batch 1 on an 8B model this takes a verify's attention from ~36 to a few us per
layer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.attention.triton.common import attend_block, sink_denominator
from kestrel.attention.triton.decode import merge_splits
from kestrel.envs import triton_jit


@triton_jit
def _extend_kernel(
    Q, K, V, O, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_starts, tree_mask, tree_starts, Positions,
    mid_o, mid_lse, Sinks, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_row, stride_mt, stride_mh, stride_ms, stride_lt, stride_lh, sm_scale, v_scale, window, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    TREE: tl.constexpr, SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr, RING: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    split = 0
    if SPLIT:
        split = m_block % num_splits
        m_block = m_block // num_splits
    extend = tl.load(extend_lens + b)
    if m_block * BLOCK_M < extend:
        prefix = tl.load(prefix_lens + b)
        q_start = tl.load(q_starts + b)
        row = tl.load(req_pool_indices + b)
        kv_head = h // GROUP

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < extend
        d_mask = offs_d < HEAD_DIM
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:  # the interpreter computes bf16 wrong: work in float32 there
            q = q.to(tl.float32)
        if TREE:  # a tree node sits at prefix + its depth, not at prefix + its index
            q_pos = tl.load(Positions + q_start + offs_m, mask=m_mask, other=0).to(tl.int32)
        else:
            q_pos = prefix + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys up to the last query position of this block; earlier ones outside the window are skipped.
        end = prefix + tl.minimum(extend, (m_block + 1) * BLOCK_M)
        start = 0
        if USE_WINDOW:  # a tree's block may hold a node of any depth: from the root's window on
            lowest = prefix if TREE else prefix + m_block * BLOCK_M
            start = tl.maximum(lowest - window + 1, 0) // BLOCK_N * BLOCK_N
        if SPLIT:  # this program's share of the keys, in whole blocks
            chunk = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
            start = start + split * chunk
            end = tl.minimum(start + chunk, end)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            if TREE:  # new tokens see the whole prefix and, among themselves, what the tree mask says
                tree_start = tl.load(tree_starts + b)
                rel = offs_n - prefix
                bits = tl.load(tree_mask + tree_start + offs_m[:, None] * extend + rel[None, :],
                               mask=m_mask[:, None] & (rel[None, :] >= 0) & n_mask[None, :], other=0)
                visible = ((rel[None, :] < 0) | (bits != 0)) & n_mask[None, :]
            else:
                visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if USE_WINDOW:
                in_window = q_pos[:, None] - offs_n[None, :] < window
                if TREE:  # among the new tokens the tree mask decides (a tree is shorter than a window)
                    in_window = in_window | (offs_n[None, :] >= prefix)
                visible = visible & in_window
            m_i, l_i, acc = attend_block(q, K, V, req_to_token, row, stride_row, kv_head, stride_kt, stride_kh,
                                         stride_vt, stride_vh, offs_n, n_mask, visible, offs_d, d_mask, m_i, l_i,
                                         acc, sm_scale, PRECISION, RING)
        if HAS_SINKS and not SPLIT:  # split shares get the sink once, in the merge
            out = acc / sink_denominator(l_i, m_i, tl.load(Sinks + h))[:, None] * v_scale
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
        if SPLIT:  # an empty share (or all of it masked) weighs 0 in the merge
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_i))
            rows = (q_start + offs_m) * stride_mt + h * stride_mh + split * stride_ms
            tl.store(mid_o + rows[:, None] + offs_d[None, :], out, mask=m_mask[:, None] & d_mask[None, :])
            tl.store(mid_lse + (q_start + offs_m) * stride_lt + h * stride_lh + split, lse, mask=m_mask)
        else:
            tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                     out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend: int, sm_scale: float,
                     sliding_window: int | None, upcast: bool, tree_mask: torch.Tensor | None = None,
                     tree_starts: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                     block_m: int = 64, block_n: int = 64, num_splits: int = 1,
                     sinks: torch.Tensor | None = None, ring: int = 0,
                     positions: torch.Tensor | None = None) -> None:
    """q/out: [T, num_heads, head_dim]; k_buf/v_buf: [slots, num_kv_heads, head_dim] (FP8 buffers store
    value / scale, dequantized in registers); lens per request; `tree_mask` / `tree_starts` as in
    ForwardBatch (None: causal among the new tokens), with the new tokens' `positions` [T] (a node's is
    prefix + its depth: what a sliding window measures from). `num_splits` > 1 splits each block's keys across
    that many programs (for few new tokens over a long prefix); it must not depend on lengths where a
    CUDA graph captures the call. `sinks`: float32 [num_heads] attention-sink logits (None: no sink).
    `ring` > 0: k_buf/v_buf are sliding-window rings of that length, flattened to [rows * ring, ...]
    (kestrel.attention.window_ring), read without `req_to_token`."""
    tree = tree_mask is not None
    if tree and positions is None:
        raise ValueError("a tree's extend needs the new tokens' positions")
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_buf.shape[1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    mid_shape = (q.shape[0], num_heads, num_splits) if split else (1, 1, 1)
    mid_o = torch.empty((*mid_shape, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    grid = (extend_lens.shape[0], num_heads, triton.cdiv(max_extend, block_m) * num_splits)
    _extend_kernel[grid](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_starts,
        tree_mask if tree else q_starts, tree_starts if tree else q_starts,  # unused without a tree
        positions if tree else q_starts,
        mid_o, mid_lse, sinks if sinks is not None else mid_lse, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), sm_scale * k_scale, v_scale, sliding_window or 0, num_splits,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, USE_WINDOW=sliding_window is not None, UPCAST=upcast,
        # float32 stays float32 (TF32 would drift from the reference); half types use tensor cores.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TREE=tree, SPLIT=split,
        HAS_SINKS=sinks is not None, RING=ring,
    )
    if split:
        merge_splits(mid_o, mid_lse, out, num_splits, sinks=sinks)
