"""The inner step shared by the extend and decode kernels: one block of a request's keys."""
from __future__ import annotations

import triton.language as tl

from kestrel.envs import triton_jit


@triton_jit
def attend_block(q, K, V, req_to_token, row, stride_row, kv_head, stride_kt, stride_kh, stride_vt, stride_vh,
                 offs_n, n_mask, visible, offs_d, d_mask, m_i, l_i, acc, sm_scale, PRECISION: tl.constexpr,
                 RING: tl.constexpr):
    """Load the K/V of key positions `offs_n` through the request's req_to_token `row` and fold them into
    the running (max m_i, sum l_i, weighted values acc) of an online softmax; `visible` masks scores.
    `RING` > 0: K/V are sliding-window rings of that length (kestrel.attention.window_ring), position p
    of the request at slot row * RING + p % RING, and the table is not read.

    K/V are converted to q's dtype in registers: float32 where the caller upcast q (the interpreter),
    and an FP8 pool's entries to the model dtype (exact). Their scales are the callers': the K scale is
    folded into `sm_scale`, the V scale multiplies the final output."""
    if RING:
        slots = row * RING + offs_n % RING
    else:
        slots = tl.load(req_to_token + row * stride_row + offs_n, mask=n_mask, other=0)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no visible key yet keep m = -inf; shift by 0 so exp() stays finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton_jit
def sink_denominator(l_i, m_i, sink):
    """The online softmax's denominator with an attention sink: the keys' sum l_i (relative to their max
    m_i) plus the sink's exp(sink - m_i). A row that saw no key (m_i = -inf, l_i = 0) is measured from
    the sink itself, so its output stays 0 without an infinity."""
    m_safe = tl.where(m_i == float("-inf"), sink, m_i)
    return l_i + tl.exp(sink - m_safe)
