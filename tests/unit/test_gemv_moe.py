"""The MoE layer's "gemv" routed path (kestrel/layers/moe/gemv_moe.py) on the CPU through Triton's
interpreter, fp32: = the hit-expert loop ("loop") for each gated activation, with and without expert biases,
with expert parallelism (a rank holding half the experts: others' assignments add 0), at 1, 3 and 8 tokens
and 1, 2 and 4 experts per token, widths that leave partial column and reduction blocks; no host read."""
from __future__ import annotations

import pytest
import torch

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.moe import ExpertActivation, MoE, MoEConfig, RouterConfig
from kestrel.layers.moe.paths import ADD_ROUTED
from tests.model.test_deepseek_v4_batched import NoHostReads

pytest.importorskip("triton")
from kestrel.layers.moe import gemv_moe as gm  # noqa: E402 - after the skip: triton is optional

H, INTER, E = 40, 24, 8
SMALL = gm.GemvConfig(block_n=16, block_k=16, num_warps=1)  # 3 column blocks of H, 2 of I: masks exercised
ACTS = [ExpertActivation("silu"), ExpertActivation("clamped_silu", limit=0.5),
        ExpertActivation("gpt_oss", limit=0.5, alpha=1.702)]


def layer(act: ExpertActivation, bias: bool, parallel: ParallelState) -> MoE:
    cfg = MoEConfig(hidden_size=H, intermediate_size=INTER, router=RouterConfig("softmax_topk", E, 4),
                    activation=act, expert_bias=bias)
    moe = MoE(cfg, parallel)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in moe.experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return moe


@pytest.mark.parametrize("act", ACTS, ids=[a.kind for a in ACTS])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("ep_rank", [None, 1], ids=["all_experts", "ep_half"])
def test_gemv_path_equals_the_loop(act, bias, ep_rank, monkeypatch):
    parallel = ParallelState() if ep_rank is None else ParallelState(ep_rank, 2, ep_size=2)
    moe = layer(act, bias, parallel)
    experts = moe.experts
    assert experts.count == (E if ep_rank is None else E // 2)
    monkeypatch.setitem(ADD_ROUTED, "gemv", lambda x, ids, w, ex, a, out: out.add_(gm.gemv_moe(
        x, ids, w, ex.w13, ex.w2, ex.first, a, ex.b13, ex.down_bias(), SMALL)))
    gen = torch.Generator().manual_seed(3)
    clamped = False
    for T in (1, 3, 8):
        for k in (1, 2, 4):
            x = torch.randn(T, H, generator=gen) * 2
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
            weights = torch.rand(T, k, generator=gen)
            want, got = torch.ones(T, H), torch.ones(T, H)  # both add to what is there
            with torch.no_grad():
                moe.add_routed(x, ids, weights, want, "loop")
                with NoHostReads():
                    moe.add_routed(x, ids, weights, got, "gemv")
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"T={T} k={k}")
            gate = torch.einsum("th,eih->tei", x, experts.w13[:, :INTER])
            clamped |= bool((gate > act.limit).any())
    if act.kind != "silu":
        assert clamped, "the clamp should fire"


def test_other_ranks_assignments_add_nothing():
    """A rank holding experts 4..7, every assignment to 0..3: the output is untouched."""
    moe = layer(ACTS[0], True, ParallelState(1, 2, ep_size=2))
    x = torch.randn(3, H)
    out = torch.zeros(3, H)
    with torch.no_grad():
        moe.add_routed(x, torch.tensor([[0, 1], [2, 3], [3, 0]]), torch.ones(3, 2), out, "gemv")
    assert (out == 0).all()
