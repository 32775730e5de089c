"""V4's grouped-GEMM MoE (kestrel/layers/moe/fused_moe.py) on the CPU through Triton's interpreter,
fp32: the alignment of assignments into expert tiles (each local assignment once, whole tiles per expert,
static shapes, other ranks' experts dropped, no host read), the fused sum = the hit-expert loop
(the layer's "loop" path) with an expert-parallel offset and the clamp firing, and MoE.forward
with the fused path forced = with the loop."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kestrel.distributed.parallel_state import ParallelState
from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.layers.moe import MoE
from kestrel.layers.moe.config import ExpertActivation
from kestrel.models.deepseek_v4.moe import v4_moe
from tests.model import dsv4_reference as ref
from tests.model.test_deepseek_v4_batched import NoHostReads

pytest.importorskip("triton")
from kestrel.layers.moe import fused_moe as fm  # noqa: E402 - after the skip: triton is optional

LIMIT = 1.0  # small: the clamp fires on random weights


def random_ids(T: int, k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct global expert ids per token (as top-k gives)."""
    return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(T)])


@pytest.mark.parametrize("T, k, count, first, block_m", [
    (1, 6, 4, 4, 16), (5, 3, 9, 9, 16), (33, 3, 4, 4, 16), (40, 6, 9, 9, 32), (200, 2, 4, 0, 64)])
def test_alignment_puts_each_local_assignment_once_in_its_experts_tiles(T, k, count, first, block_m) -> None:
    gen = torch.Generator().manual_seed(T + k + count)
    ids = random_ids(T, k, 3 * count, gen)  # ranks of `count` experts each, this one at `first`
    with NoHostReads():
        tiles = fm.align_assignments(ids, first, count, block_m)
    n, bound = T * k, fm.max_tiles(T * k, count, block_m)
    assert tiles.block_m == block_m
    assert tiles.rows.shape == (bound * block_m,) and tiles.tile_expert.shape == (bound,)
    assert bound <= math.ceil(n / block_m) + count  # never above the loose bound
    local = ids.reshape(-1) - first
    mine = ((local >= 0) & (local < count)).nonzero().flatten()
    assert 0 < mine.numel() < n, "the case should mix this rank's experts and others'"
    valid = tiles.rows < n
    assert sorted(tiles.rows[valid].tolist()) == mine.tolist()  # each local assignment once, no other
    used = 0
    for e in range(count):  # the experts' tiles in order, each expert's rows first in its tiles
        hits = int((local == e).sum())
        span = slice(used * block_m, (used + math.ceil(hits / block_m)) * block_m)
        assert (local[tiles.rows[span][:hits]] == e).all() and not valid[span][hits:].any()
        assert (tiles.tile_expert[used:used + math.ceil(hits / block_m)] == e).all()
        used += math.ceil(hits / block_m)
    assert used <= bound and (tiles.tile_expert[used:] == -1).all() and not valid[used * block_m:].any()


@pytest.mark.parametrize("ids, count, tile_expert", [
    ([[0, 1, 2], [3, 4, 9]], 5, [0, 1, 2, 3, 4]),  # every expert one row (and another rank's)
    ([[0]] * 7 + [[1], [2]], 3, [0, 0, 0, 1, 2]),  # one row each, the rest in one expert
    ([[7, 8], [9, 7], [8, 9]], 3, [-1, -1, -1, -1]),  # no local expert at all
])
def test_alignment_tile_bound(ids, count, tile_expert) -> None:
    """max_tiles (block_m 3 here) reached by its worst cases, and every tile unused without local rows."""
    ids = torch.tensor(ids)
    tiles = fm.align_assignments(ids, 0, count, 3)
    assert tiles.tile_expert.tolist() == tile_expert
    n = ids.numel()
    local = ids.reshape(-1)
    for t, e in enumerate(tile_expert):
        rows = tiles.rows[3 * t:3 * t + 3]
        assert (local[rows[rows < n]] == e).all() and ((rows < n).any() or e == -1)


def moe_layer(experts: int, k: int, seed: int, parallel: ParallelState) -> MoE:
    """A V4 MoE of `experts` routed experts with random weights, widths 48 and 40 (no tile divides them)."""
    cfg = dataclasses.replace(parse_v4_config(ref.RefConfig().native_config()), hidden_size=48,
                              moe_intermediate_size=40, n_routed_experts=experts, num_experts_per_tok=k,
                              swiglu_limit=LIMIT)
    layer = v4_moe(cfg, hash_routing=False, parallel=parallel)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 * 2)
    return layer


def ep_moe(count: int, k: int, seed: int) -> MoE:
    """Rank 1 of 2: experts count .. 2 count - 1 of 2 count."""
    return moe_layer(2 * count, k, seed, ParallelState(1, 2, ep_size=2))


@pytest.mark.parametrize("count", [4, 9])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_fused_moe_equals_hit_expert_loop(T, k, count) -> None:
    layer = ep_moe(count, k, seed=T * 100 + k * 10 + count)
    experts = layer.experts
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, experts.w13.shape[2], generator=gen)
    ids = random_ids(T, k, 2 * count, gen)
    weights = torch.rand(T, k, generator=gen)
    inter = experts.w2.shape[2]
    gate = torch.einsum("td,ecd->tec", x, experts.w13[:, :inter])
    assert (gate > LIMIT).any(), "the clamp should fire"
    loop, fused = torch.zeros(T, x.shape[1]), torch.zeros(T, x.shape[1])
    with torch.no_grad():
        layer.add_routed(x, ids, weights, loop, "loop")
        layer.add_routed(x, ids, weights, fused, "fused")
    if T > 1:
        assert loop.abs().sum() > 0
    torch.testing.assert_close(fused, loop, atol=1e-5, rtol=1e-5)


def test_fused_moe_with_tall_tiles_equals_the_loop() -> None:
    layer = ep_moe(4, 3, seed=1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 48, generator=gen)
    ids, weights = random_ids(50, 3, 8, gen), torch.rand(50, 3, generator=gen)
    loop = torch.zeros(50, 48)
    with torch.no_grad():
        layer.add_routed(x, ids, weights, loop, "loop")
        fused = fm.fused_moe(x, ids, weights, layer.experts.w13, layer.experts.w2, 4,
                             ExpertActivation("clamped_silu", LIMIT), cfg=fm.MoeTileConfig(block_m=64, block_n=32, block_k=16))
    torch.testing.assert_close(fused, loop, atol=1e-5, rtol=1e-5)


def test_forward_with_the_fused_path_equals_the_loop(monkeypatch) -> None:
    """One rank holding 18 experts (above EVERY_EXPERT_MAX: what the fused path serves on CUDA)."""
    layer = moe_layer(18, 3, seed=5, parallel=ParallelState())
    x = torch.randn(7, 48, generator=torch.Generator().manual_seed(5))
    assert layer.routed_path(x) == "loop"  # the CPU's eager path
    outs = {}
    for path in ("fused", "loop"):
        monkeypatch.setattr(layer, "routed_path", lambda x, path=path: path)
        with torch.no_grad():
            outs[path] = layer(x, torch.arange(7))
    torch.testing.assert_close(outs["fused"], outs["loop"], atol=1e-5, rtol=1e-5)
