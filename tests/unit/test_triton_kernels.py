"""Triton extend/decode kernels against a naive float64 reference on random paged layouts."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")
from kestrel.attention.triton.decode import decode_attention  # noqa: E402
from kestrel.attention.triton.extend import extend_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UPCAST = DEVICE == "cpu"


def paged_layout(seq_lens: list[int], slots_total: int, gen: torch.Generator):
    """A req_to_token table whose rows point at scattered, non-contiguous slots (never slot 0)."""
    perm = torch.randperm(slots_total - 1, generator=gen) + 1
    table = torch.zeros((len(seq_lens) + 2, max(seq_lens) + 3), dtype=torch.int64)
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)]
    used = 0
    for row, n in zip(rows.tolist(), seq_lens):
        table[row, :n] = perm[used:used + n]
        used += n
    return table.to(DEVICE), rows.to(DEVICE)


def run_decode(q, k_buf, v_buf, table, rows, seq, scale, window, upcast, num_splits, **kwargs):
    """decode_attention with the new tokens' K/V taken out of the pool (NaN left there) and passed in,
    as the backend calls it; checks that the kernel put them back."""
    new_slots = table[rows, torch.tensor(seq, device=table.device) - 1]
    k_new, v_new = k_buf[new_slots].flatten(1).clone(), v_buf[new_slots].flatten(1).clone()
    k_buf[new_slots], v_buf[new_slots] = float("nan"), float("nan")
    out = torch.empty_like(q)
    decode_attention(q, k_new, v_new, k_buf, v_buf, out, table, rows, torch.tensor(seq, device=table.device),
                     new_slots, scale, window, upcast, num_splits, **kwargs)
    assert torch.equal(k_buf[new_slots].flatten(1), k_new) and torch.equal(v_buf[new_slots].flatten(1), v_new)
    return out


def reference(q, k_buf, v_buf, table, rows, prefix, extend, scale, window, sinks=None):
    """Softmax attention in float64; `sinks` [heads]: each head's sink logit joins the denominator."""
    outs = []
    start = 0
    for row, p, e in zip(rows.tolist(), prefix, extend):
        slots = table[row, :p + e]
        k = k_buf[slots].double().repeat_interleave(q.shape[1] // k_buf.shape[1], dim=1)
        v = v_buf[slots].double().repeat_interleave(q.shape[1] // k_buf.shape[1], dim=1)
        qi = q[start:start + e].double()
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(p, p + e, device=q.device)[:, None]
        k_pos = torch.arange(p + e, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= q_pos - k_pos < window
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # the sink's column is dropped after the softmax
            s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, e, 1)], dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1)[..., :-1], v))
        else:
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += e
    return torch.cat(outs)


CASES = [  # (gqa group, head_dim, dtype, window)
    (1, 64, torch.float32, None), (2, 128, torch.float32, None), (4, 64, torch.float16, None),
    (8, 128, torch.float32, None), (4, 64, torch.float32, 7), (2, 64, torch.bfloat16, None),
]


# Split keys (a verify's few tokens over a long prefix) on a GQA case, a window and bf16.
@pytest.mark.parametrize("group, head_dim, dtype, window, num_splits",
                         [(*case, 1) for case in CASES] + [(*CASES[i], 3) for i in (2, 4, 5)])
def test_extend_matches_reference(group, head_dim, dtype, window, num_splits):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + num_splits)
    kv_heads = 2
    prefix = [0, 5, 17, 0, 40]
    extend = [9, 1, 23, 33, 4]
    seq = [p + e for p, e in zip(prefix, extend)]
    table, rows = paged_layout(seq, 300, gen)
    k_buf = torch.randn(300, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_buf = torch.randn(300, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(sum(extend), kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    out = torch.empty_like(q)
    ext = torch.tensor(extend, device=DEVICE)
    extend_attention(q, k_buf, v_buf, out, table, rows, torch.tensor(prefix, device=DEVICE), ext,
                     torch.cumsum(ext, 0) - ext, max(extend), 1 / math.sqrt(head_dim), window, UPCAST,
                     block_m=16, block_n=16, num_splits=num_splits)
    ref = reference(q, k_buf, v_buf, table, rows, prefix, extend, 1 / math.sqrt(head_dim), window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("group, head_dim, dtype, window", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(group, head_dim, dtype, window, num_splits):
    gen = torch.Generator().manual_seed(group * 100 + head_dim + num_splits)
    kv_heads = 2
    seq = [1, 6, 40, 17, 64]
    table, rows = paged_layout(seq, 300, gen)
    k_buf = torch.randn(300, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_buf = torch.randn(300, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(seq), kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    ref = reference(q, k_buf, v_buf, table, rows, [s - 1 for s in seq], [1] * len(seq), 1 / math.sqrt(head_dim),
                    window)
    out = run_decode(q, k_buf, v_buf, table, rows, seq, 1 / math.sqrt(head_dim), window, UPCAST, num_splits,
                     block_n=16)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# Attention sinks (gpt-oss), with and without a window, one split and several (the sink then joins
# in the merge, once): direct and split paths of both kernels.
SINK_CASES = [(2, 16, None, 1), (2, 16, 5, 1), (4, 32, None, 3), (2, 16, 6, 3)]


@pytest.mark.parametrize("group, head_dim, window, num_splits", SINK_CASES)
def test_extend_with_sinks(group, head_dim, window, num_splits):
    gen = torch.Generator().manual_seed(7 + group + num_splits)
    kv_heads = 2
    prefix, extend = [0, 9, 3], [11, 2, 6]
    seq = [p + e for p, e in zip(prefix, extend)]
    table, rows = paged_layout(seq, 80, gen)
    k_buf = torch.randn(80, kv_heads, head_dim, generator=gen).to(DEVICE)
    v_buf = torch.randn(80, kv_heads, head_dim, generator=gen).to(DEVICE)
    q = torch.randn(sum(extend), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    sinks = (torch.randn(kv_heads * group, generator=gen) * 2).to(DEVICE)
    out = torch.empty_like(q)
    ext = torch.tensor(extend, device=DEVICE)
    extend_attention(q, k_buf, v_buf, out, table, rows, torch.tensor(prefix, device=DEVICE), ext,
                     torch.cumsum(ext, 0) - ext, max(extend), 1 / math.sqrt(head_dim), window, UPCAST,
                     block_m=16, block_n=16, num_splits=num_splits, sinks=sinks)
    ref = reference(q, k_buf, v_buf, table, rows, prefix, extend, 1 / math.sqrt(head_dim), window, sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group, head_dim, window, num_splits", SINK_CASES)
def test_decode_with_sinks(group, head_dim, window, num_splits):
    gen = torch.Generator().manual_seed(11 + group + num_splits)
    kv_heads = 2
    seq = [1, 7, 30]
    table, rows = paged_layout(seq, 80, gen)
    k_buf = torch.randn(80, kv_heads, head_dim, generator=gen).to(DEVICE)
    v_buf = torch.randn(80, kv_heads, head_dim, generator=gen).to(DEVICE)
    q = torch.randn(len(seq), kv_heads * group, head_dim, generator=gen).to(DEVICE)
    sinks = (torch.randn(kv_heads * group, generator=gen) * 2).to(DEVICE)
    ref = reference(q, k_buf, v_buf, table, rows, [s - 1 for s in seq], [1] * len(seq), 1 / math.sqrt(head_dim),
                    window, sinks)
    out = run_decode(q, k_buf, v_buf, table, rows, seq, 1 / math.sqrt(head_dim), window, UPCAST, num_splits,
                     block_n=16, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
