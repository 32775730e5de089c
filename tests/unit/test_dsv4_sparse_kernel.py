"""The Triton kernel of DeepSeek-V4's sparse attention (kestrel/attention/triton/dsv4_sparse.py) against
the dsv4 backend's torch path (`DSV4Backend.attend` with sparse_kernel=False), in Triton's CPU
interpreter: window only, ratio 4 (indexer picks with -1s, invalid window rows), ratio 128 (every
visible block; also a decode step's static-sizes plan), the sink, model-dtype and packed FP8 entries,
one kernel pass and split-K. Tiny shapes (H 20 over two head tiles, D 64, window 8), fp32 and fp16.
Runtime ≈ 15 s on 2 shared cores."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
from kestrel.attention.dsv4 import DSV4Backend, WindowKeys  # noqa: E402
from kestrel.attention.dsv4_plan import StepPlan, V4Span  # noqa: E402
from kestrel.quant.kv_entries import RopeEntryFP8  # noqa: E402

H, D, ROPE, WINDOW, TOPK, TABLE_WIDTH = 20, 64, 16, 8, 6, 512
PADDING_ROW = 7
# fp32: the same products in another order (the kernel's tiles, exp2, the split merge). fp16: the
# interpreter works in fp32 after loading, while the CPU torch path rounds the logits (no out_dtype
# on CPU) and the probabilities to fp16 (logits ~2: steps of ~1e-3).
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=5e-3, rtol=5e-3)}


def table() -> torch.Tensor:
    """req_to_token: row r holds slots r * 512 + position (pages of whole rows; row 7 the padding row)."""
    return torch.arange(8)[:, None] * TABLE_WIDTH + torch.arange(TABLE_WIDTH)[None, :]


def backend_pair(gen: torch.Generator, ratio: int, fp8: bool, dtype: torch.dtype):
    """(kernel backend, torch backend) over the same compressed buffer (random entries, or their packed
    FP8 rows) and the token count of their plans' block tables."""
    codec = RopeEntryFP8(D, ROPE) if fp8 else None
    entries = None
    if ratio:
        values = torch.randn(8 * TABLE_WIDTH // ratio, D, generator=gen) * 2
        entries = codec.encode(values) if fp8 else values.to(dtype)
    layer = SimpleNamespace(ckv=entries, ckv_codec=codec)
    pools = SimpleNamespace(layer=lambda layer_id: layer)
    return DSV4Backend(pools, None, sparse_kernel=True), DSV4Backend(pools, None, sparse_kernel=False)


def step_inputs(plan: StepPlan, gen: torch.Generator, dtype: torch.dtype, ratio: int):
    """q, the window keys (some valid rows switched off at random), the sink and, at ratio 4, picks
    among each token's visible blocks with some -1s."""
    T = plan.num_tokens
    index, valid = plan.window(WINDOW)
    valid = valid & (torch.rand(valid.shape, generator=gen) > 0.2)
    source = torch.randn(plan.num_requests * (WINDOW - 1) + T, D, generator=gen).to(dtype)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    sink = torch.randn(H, generator=gen) * 2
    selected = None
    if ratio == 4:
        _, visible = plan.blocks(4)
        cols = (torch.rand(T, TOPK, generator=gen) * visible[:, None].clamp(min=1)).long()
        none = (torch.rand(T, TOPK, generator=gen) < 0.3) | (cols >= visible[:, None])
        selected = cols.masked_fill(none, -1)
    return q, WindowKeys(source, index, valid), sink, selected


# A prefill from 0 (the window's early rows invalid), a decode, an extend across blocks; at ratio 128
# positions past 128 and 256 so tokens see 0, 1 or 2 blocks, one extend crossing a block's end.
SPANS = {0: [(0, 0, 5), (1, 37, 1), (2, 20, 3)], 4: [(0, 0, 5), (1, 37, 1), (2, 18, 3)],
         128: [(0, 125, 4), (1, 300, 1), (2, 254, 3)]}


@pytest.mark.parametrize("ratio, fp8, dtype, splits", [
    (0, False, torch.float32, None), (0, False, torch.float16, 3),
    (4, False, torch.float32, 3), (4, True, torch.float32, None),
    (4, False, torch.float16, None), (128, False, torch.float32, None), (128, True, torch.float32, 2),
])
def test_kernel_equals_torch_path(ratio: int, fp8: bool, dtype: torch.dtype, splits: int | None) -> None:
    gen = torch.Generator().manual_seed(ratio * 10 + int(fp8) + (splits or 0))
    spans, start = [], 0
    for row, prefix, extend in SPANS[ratio]:
        spans.append(V4Span(row, prefix, extend, start))
        start += extend
    plan = StepPlan(spans, table(), (ratio,) if ratio else (), PADDING_ROW)
    kernel, torch_path = backend_pair(gen, ratio, fp8, dtype)
    # Key tiles of 4 rows: the window (8) and the entries take several, split-K cuts them unevenly.
    kernel.kernel_options = dict(block_n=4, num_splits=splits or 1)
    kernel.plan = torch_path.plan = plan
    q, window, sink, selected = step_inputs(plan, gen, dtype, ratio)
    got = kernel.attend(0, q, window, sink, D ** -0.5, ratio, selected)
    want = torch_path.attend(0, q, window, sink, D ** -0.5, ratio, selected)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    # The sink matters: without it the same keys give another output wherever a token sees keys.
    if ratio == 0 and splits is None:
        no_sink = torch_path.attend(0, q, window, torch.full_like(sink, -torch.inf), D ** -0.5)
        assert (no_sink - got).abs().amax() > 1e-2


def test_static_decode_plan_ratio_128() -> None:
    """A decode step's static-sizes plan (`StepPlan.decode`, the CUDA-graph one): the block table is
    the static width (512 positions: 4 blocks) and each token stops at its visible count; the default
    splits and tiles."""
    gen = torch.Generator().manual_seed(5)
    rows, prefix = torch.tensor([3, 0, 5]), torch.tensor([383, 40, 200])
    plan = StepPlan.decode(rows, prefix, table(), (128,), PADDING_ROW, TABLE_WIDTH)
    kernel, torch_path = backend_pair(gen, 128, False, torch.float32)
    kernel.plan = torch_path.plan = plan
    q, window, sink, _ = step_inputs(plan, gen, torch.float32, 128)
    got = kernel.attend(0, q, window, sink, D ** -0.5, 128)
    torch.testing.assert_close(got, torch_path.attend(0, q, window, sink, D ** -0.5, 128), **TOL[torch.float32])


def test_invalid_arguments_are_refused() -> None:
    from kestrel.attention.triton.dsv4_sparse import sparse_attention

    q = torch.zeros(1, H, D)
    index, valid = torch.zeros(1, WINDOW, dtype=torch.int64), torch.ones(1, WINDOW, dtype=torch.bool)
    with pytest.raises(ValueError, match="exactly one of picks / counts"):
        sparse_attention(q, torch.zeros(4, D), index, valid, torch.zeros(H), 1.0, entries=torch.zeros(4, D),
                         entry_table=torch.zeros(1, 4, dtype=torch.int64), tok_row=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="window source must be in q's dtype"):
        sparse_attention(q, torch.zeros(4, D, dtype=torch.float16), index, valid, torch.zeros(H), 1.0)
