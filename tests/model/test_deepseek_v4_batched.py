"""The dsv4 backend's batched path (one gathered softmax for all requests, a per-step index plan) against
the naive reference: a batch of different lengths prefilled together, then decoded together across
ratio-4 and ratio-128 block boundaries with a verify-sized extend in the middle; once with the default
query tiles and once with tiles of a few tokens, so a prefill is cut inside a request and a decode tile
holds several requests. Also the tile packing itself, and the decode plan with static sizes that a CUDA
graph replays (padded to a bucket, no host reads) = the eager decode."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel.attention import dsv4
from kestrel.attention.dsv4_plan import StepPlan, V4Span
from kestrel.layers.moe import paths as moe
from kestrel.runner.cuda_graph import CudaGraphRunner
from kestrel.models.deepseek_v4.model import DeepseekV4ForCausalLM
from tests.model import dsv4_reference as ref
from tests.model.dsv4_harness import V4Harness, reference_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the reference's setup too

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


# ---- decode with static sizes: what a CUDA graph of a decode step replays ------------------------------
class NoHostReads(TorchDispatchMode):
    """Fails on every op that reads a tensor's values on the host or has a value-dependent shape: none
    may run inside a captured CUDA graph (`.tolist()` does not dispatch, so it is patched separately)."""

    FORBIDDEN = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.FORBIDDEN:
            raise AssertionError(f"{func} reads the device on the host: it cannot run in a CUDA graph")
        return func(*args, **(kwargs or {}))


# (request, prefill): positions then cross ratio-4 blocks (request 1 at 3 and 7) and the ratio-128 block
# at 127 (requests 0 and 2); the steps run 3 requests in a bucket of 4, then 2 in a bucket of 2, 1 in 1.
STATIC_PREFILL = ((1, 124), (2, 2), (3, 125))
STATIC_STEPS = [[0, 1, 2]] * 4 + [[0, 2], [1], [0, 1, 2]]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_static_decode_plan_equals_eager_decode(model, expected, monkeypatch, kv_dtype) -> None:
    """Two copies of the same state: one decoded eagerly (plan from host lengths), one through the CUDA-graph
    runner's static buffers without capture (padded to its bucket, `StepPlan.decode`, the MoE's every-expert
    path, no host read): the same logits at every step, and (unquantized entries) the reference's. With
    packed FP8 entries the codec's encode / decode run inside the graph too."""
    seqs, logits = expected
    seqs = [seqs[i] for i, _ in STATIC_PREFILL]
    ref_logits = [logits[i] for i, _ in STATIC_PREFILL]
    eager = V4Harness(model, len(seqs), kv_dtype=kv_dtype)
    lens = [n for _, n in STATIC_PREFILL]
    eager.logits([s[:n] for s, n in zip(seqs, lens)])
    static = copy.deepcopy(eager, memo={id(model): model})  # the KV memory and allocator after the prefill
    runner = CudaGraphRunner(model, static.backend, static.memory.req_to_token.padding_row, max_bs=4,
                             device=torch.device("cpu"), capture=False,
                             max_seq_len=static.backend.graph_max_seq_len)
    assert runner.buckets == [1, 2, 4]
    monkeypatch.setattr(moe, "capturing", lambda x: True)

    def no_tolist(*_):
        raise AssertionError(".tolist() reads the device on the host: it cannot run in a CUDA graph")

    for step, requests in enumerate(STATIC_STEPS):
        chunks = [[seqs[r][lens[r]]] for r in requests]
        want = eager.logits(chunks, requests)
        fb = static.batch(chunks, requests, static.backend)
        assert runner.can_run(fb)
        # The host-read guard (slow: every op through Python) on the first step, a padded bucket.
        with torch.no_grad(), NoHostReads() if step == 0 else contextlib.nullcontext(), monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", no_tolist)
            got = runner.run_uncaptured(fb).logits
        assert static.backend.plan.spans is None  # the static plan served it
        for j, r in enumerate(requests):
            torch.testing.assert_close(got[j:j + 1], want[j], atol=2e-5, rtol=0)
            if kv_dtype == torch.float32:
                torch.testing.assert_close(got[j], ref_logits[r][lens[r]], atol=ATOL, rtol=0)
            lens[r] += 1
    assert lens[0] > 128 and lens[2] > 128 and lens[1] > 7
    runner.max_seq_len = max(fb.seq_lens_cpu) - 1  # a longer sequence than the graphs serve: eager
    assert not runner.can_run(fb)


def test_every_expert_moe_equals_hit_expert_loop(model) -> None:
    """The MoE's graph-safe sum (every expert, weight 0 where not routed) = its loop over the hit experts."""
    layer = model.layers[-1].ffn
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, CFG.hidden_size, generator=gen)
    ids, weights = layer.gate(x, torch.arange(5))
    loop, every = (torch.zeros(5, CFG.hidden_size) for _ in range(2))
    with torch.no_grad():
        layer.add_routed(x, ids, weights, loop, "loop")
        layer.add_routed(x, ids, weights, every, "every")
    assert loop.abs().sum() > 0
    torch.testing.assert_close(every, loop, atol=1e-5, rtol=1e-5)
