"""The dsv4 backend's batched path (one gathered softmax for all requests, a per-step index plan) against
the naive reference: a batch of different lengths prefilled together, then decoded together across
ratio-4 and ratio-128 block boundaries with a verify-sized extend in the middle; once with the default
query tiles and once with tiles of a few tokens, so a prefill is cut inside a request and a decode tile
holds several requests. Also the tile packing itself."""
from __future__ import annotations

import pytest
import torch

from kestrel.attention import dsv4
from kestrel.attention.dsv4_plan import StepPlan, V4Span
from kestrel.models.deepseek_v4.model import DeepseekV4ForCausalLM
from tests.model import dsv4_reference as ref
from tests.model.dsv4_harness import V4Harness, reference_model

CFG = ref.RefConfig(index_n_heads=16)  # as test_deepseek_v4.py: no exact ties in the indexer's top-k
ATOL = 5e-4


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return ref.random_weights(CFG, seed=0)


@pytest.fixture(scope="module")
def model(weights) -> DeepseekV4ForCausalLM:
    return reference_model(CFG, weights)


@pytest.fixture(scope="module")
def expected(weights):
    """Four sequences and the reference's logits at every position."""
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(20 + i)).tolist()
            for i, n in enumerate((260, 136, 12, 139))]
    return seqs, [ref.forward(s, weights, CFG).logits for s in seqs]


# Prefill lengths, then per step each request's new tokens: C4 blocks complete at p = 3 mod 4, C128
# blocks at p = 127 (request 1) and 255 (request 0) during the decode steps; request 1 extends 3 in one.
PREFILL = (250, 124, 2, 129)
STEPS = [(1, 1, 1, 1), (1, 1, 1, 1), (1, 3, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("tile_bytes", [dsv4.TILE_BYTES, 20_000])
def test_batched_steps_across_block_boundaries_match_reference(model, expected, monkeypatch, tile_bytes) -> None:
    monkeypatch.setattr(dsv4, "TILE_BYTES", tile_bytes)
    seqs, logits = expected
    h = V4Harness(model, len(seqs))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = [[part] for part in h.logits([s[:n] for s, n in zip(seqs, PREFILL)])]
        lens = list(PREFILL)
        for step in STEPS:
            out = h.logits([s[n:n + e] for s, n, e in zip(seqs, lens, step)])
            for i, e in enumerate(step):
                got[i].append(out[i])
                lens[i] += e
    finally:
        torch.set_num_threads(before)
    assert lens[0] > 255 and PREFILL[1] < 127 < lens[1]
    for i, n in enumerate(lens):
        torch.testing.assert_close(torch.cat(got[i]), logits[i][:n], atol=ATOL, rtol=0)


def test_tiles_take_whole_requests_and_cut_only_long_ones() -> None:
    spans, start = [], 0
    for extend in (1, 1, 3, 10, 1, 2):
        spans.append(V4Span(row=len(spans) + 1, prefix=5, extend=extend, start=start))
        start += extend
    plan = StepPlan(spans, torch.zeros(8, 64, dtype=torch.int64), block_ratios=(4,), padding_row=7)
    tiles = plan.tiles(bytes_per_token=10, budget=40)  # 4 tokens a tile
    assert tiles == [(0, 2, 0, 2), (2, 5, 2, 3), (5, 9, 3, 4), (9, 13, 3, 4), (13, 15, 3, 4), (15, 18, 4, 6)]
    assert plan.tiles(10, 10**6) == [(0, 18, 0, 6)]
