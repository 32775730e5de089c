"""The MoE layer's fused decode route (`MoE.forward_decode`: route_kernels.py's router, gemv_moe.py's GEMVs and
combine) on the CPU through Triton's interpreter: the router kernels pick the ids `Router.forward` picks and
weigh them alike, for "softmax_topk" with and without renormalising and "topk_softmax", with a logit bias, at
1, 3 and 4 tokens, expert counts and top-k that are not powers of two; the whole forward equals the torch
forward (router + the hit-expert loop + the torch combine) for each activation, with and without expert
biases, with a rank holding half the experts, with Qwen2-MoE's gated shared expert, and under tensor
parallelism hands the all-reduce a float32 partial; no op reads the device on the host."""
from __future__ import annotations

import pytest
import torch

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.moe import ExpertActivation, MoE, MoEConfig, RouterConfig, paths
from kestrel.layers.moe.routers import Router
from tests.model.test_deepseek_v4_batched import NoHostReads

pytest.importorskip("triton")
from kestrel.layers.moe import gemv_moe, route_kernels  # noqa: E402 - after the skip: triton is optional

H, INTER, E, K = 40, 24, 12, 3
SMALL = route_kernels.RouteConfig(block_e=4, block_k=16, num_warps=1)  # partial expert and reduction blocks
TOKENS = (1, 3, 4)
ROUTERS = {"qwen3": dict(kind="softmax_topk"), "qwen2-no-renorm": dict(kind="softmax_topk", renormalize=False),
           "biased-softmax": dict(kind="softmax_topk", logit_bias=True),
           "gpt-oss": dict(kind="topk_softmax", logit_bias=True)}
ACTS = [ExpertActivation("silu"), ExpertActivation("clamped_silu", limit=0.5),
        ExpertActivation("gpt_oss", limit=0.5, alpha=1.702)]
# Each activation under another router kind, so that every kind meets the experts' kernels.
ACT_ROUTERS = {"silu": "qwen3", "clamped_silu": "qwen2-no-renorm", "gpt_oss": "gpt-oss"}


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return module


@pytest.mark.parametrize("experts, top_k", [(13, 5), (60, 8), (7, 1)])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_router_kernels_pick_and_weigh_as_the_router(router, experts, top_k):
    cfg = RouterConfig(num_experts=experts, top_k=top_k, **ROUTERS[router])
    gate = randomized(Router(cfg, H), seed=experts)
    gen = torch.Generator().manual_seed(top_k)
    for T in TOKENS:
        x = torch.randn(T, H, generator=gen)
        with torch.no_grad():
            want_ids, want_weights = gate(x)
            ids, weights = route_kernels.route(x, gate.weight, gate.bias, cfg, SMALL)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (T, top_k)
        assert torch.equal(ids, want_ids), f"T={T}"
        torch.testing.assert_close(weights, want_weights, msg=f"T={T}")


def test_an_equal_logit_goes_to_the_lower_expert_id():
    """Experts 2, 5 and 9 have the same weight row, so the same logit, the largest: ids 2, 5, 9 in order."""
    cfg = RouterConfig("topk_softmax", 11, 3)
    gate = randomized(Router(cfg, H), seed=1)
    with torch.no_grad():
        gate.weight[[5, 9]] = gate.weight[2] = gate.weight.abs().sum(0)
        ids, weights = route_kernels.route(torch.rand(2, H) + 0.1, gate.weight, None, cfg, SMALL)
    assert ids.tolist() == [[2, 5, 9]] * 2
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))


def test_route_refuses_other_router_kinds():
    with pytest.raises(ValueError, match="softmax_topk, topk_softmax"):
        route_kernels.route(torch.zeros(1, H), torch.zeros(8, H), None, RouterConfig("biased_topk", 8, 2))


def layer(cfg: MoEConfig, parallel: ParallelState = ParallelState(), dtype: torch.dtype = torch.float32) -> MoE:
    return randomized(MoE(cfg, parallel), seed=7).to(dtype)  # the router's weight stays float32 in use


@pytest.fixture
def decode_route(monkeypatch):
    """A function: the forward through the fused decode route, as a CUDA decode step would take it, without
    host reads; and the combine kernel spied on, so that a test knows the route ran."""
    combined = []

    def spy(*args, **kwargs):
        combined.append(1)
        return combine(*args, **kwargs)

    combine = gemv_moe.combine_rows
    monkeypatch.setattr(gemv_moe, "combine_rows", spy)

    def forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
        with monkeypatch.context() as m:
            m.setattr(paths, "FUSED_DECODE_ROUTE", True)
            m.setattr(paths, "choose_path", lambda x, experts: "gemv")
            before = len(combined)
            with torch.no_grad(), NoHostReads():
                out = moe(x)
            assert len(combined) == before + 1, "the fused decode route did not run"
        return out

    return forward


def torch_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Today's forward on the CPU: the torch router, the hit-expert loop, the torch combine."""
    assert not paths.takes_decode_route(x, moe.experts, moe.cfg.router)
    with torch.no_grad():
        return moe(x)


@pytest.fixture
def identity_all_reduce(monkeypatch):
    """One rank's partial sum stands for the sum over the ranks (no process group here); the partials
    handed to the all-reduce are kept."""
    partials = []
    monkeypatch.setattr(ParallelState, "all_reduce", lambda self, x: partials.append(x) or x)
    return partials


@pytest.mark.parametrize("act", ACTS, ids=[a.kind for a in ACTS])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("ep_rank", [None, 1], ids=["all_experts", "ep_half"])
def test_fused_forward_equals_the_torch_forward(act, bias, ep_rank, decode_route, identity_all_reduce):
    parallel = ParallelState() if ep_rank is None else ParallelState(ep_rank, 2, ep_size=2)
    router = RouterConfig(num_experts=E, top_k=K, **ROUTERS[ACT_ROUTERS[act.kind]])
    moe = layer(MoEConfig(H, INTER, router, act, expert_bias=bias), parallel)
    assert moe.experts.count == (E if ep_rank is None else E // 2)
    gen = torch.Generator().manual_seed(3)
    clamped = False
    for T in TOKENS:
        x = torch.randn(T, H, generator=gen) * 2
        want, got = torch_forward(moe, x), decode_route(moe, x)
        assert got.shape == (T, H) and got.dtype == x.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"T={T}")
        if ep_rank is not None:  # another rank's experts add 0: some token routed there, and the sum is partial
            ids, _ = moe.gate(x)
            assert (ids < moe.experts.first).any() or T == 1
        clamped |= bool((torch.einsum("th,eih->tei", x, moe.experts.w13[:, :INTER]) > act.limit).any())
    if act.kind != "silu":
        assert clamped, "the clamp should fire"


@pytest.mark.parametrize("tp_rank", [None, 0, 1], ids=["one_rank", "tp_rank0", "tp_rank1"])
def test_qwen2_moe_gated_shared_expert(tp_rank, decode_route, identity_all_reduce):
    """Qwen2-MoE: no renormalising, a shared expert scaled by sigmoid(gate x) added in the combine kernel.
    Two ranks (tp_size 2, ep_size 2): rank 0 adds the shared expert, rank 1 does not."""
    parallel = ParallelState() if tp_rank is None else ParallelState(tp_rank, 2, ep_size=2)
    cfg = MoEConfig(H, INTER, RouterConfig("softmax_topk", E, K, renormalize=False), shared_intermediate_size=32,
                    shared_expert_gate=True)
    moe = layer(cfg, parallel)
    assert moe.shared_experts.adds == (tp_rank != 1)
    for T in TOKENS:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        torch.testing.assert_close(decode_route(moe, x), torch_forward(moe, x), atol=1e-5, rtol=1e-5)


def test_tensor_parallel_reduces_float32_then_casts(decode_route, identity_all_reduce):
    """Half precision under tensor parallelism: the all-reduce gets the float32 partial (as the torch forward
    gives it), the layer returns it cast to x's dtype; the same numbers as the torch forward."""
    cfg = MoEConfig(H, INTER, RouterConfig("topk_softmax", E, K, logit_bias=True),
                    ExpertActivation("gpt_oss", limit=7.0), expert_bias=True, shared_intermediate_size=16)
    moe = layer(cfg, ParallelState(0, 2, ep_size=1), torch.float16)
    moe.gate.float()
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(5)).half()
    want = torch_forward(moe, x)
    got = decode_route(moe, x)
    want_partial, got_partial = identity_all_reduce
    assert got_partial.dtype == want_partial.dtype == torch.float32 and got.dtype == torch.float16
    torch.testing.assert_close(got_partial, want_partial, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_gemv_moe_still_sums_on_its_own():
    """`gemv_moe` (the "gemv" path and the benchmark's sweep) = `gemv_rows` summed by the combine kernel."""
    moe = layer(MoEConfig(H, INTER, RouterConfig("softmax_topk", E, K)), ParallelState(1, 2, ep_size=2))
    e = moe.experts
    x = torch.randn(3, H)
    with torch.no_grad():
        ids, weights = moe.gate(x)
        want = gemv_moe.gemv_moe(x, ids, weights, e.w13, e.w2, e.first, moe.cfg.activation)
        rows = torch.full((ids.numel(), H), float("nan"))  # other ranks' rows: never written, never read
        gemv_moe.gemv_rows(x, ids, weights, e.w13, e.w2, e.first, moe.cfg.activation, None, None, rows)
        got = torch.empty(3, H)
        gemv_moe.combine_rows(rows, ids, e.first, e.count, got)
    torch.testing.assert_close(got, want)


def test_the_down_gemv_takes_its_own_config():
    """A down config of its own (gemv_moe.DOWN_CONFIG or down_cfg) changes the tiling, not the sum."""
    moe = layer(MoEConfig(H, INTER, RouterConfig("softmax_topk", E, K)))
    e = moe.experts
    x = torch.randn(2, H)
    with torch.no_grad():
        ids, weights = moe.gate(x)
        want = gemv_moe.gemv_moe(x, ids, weights, e.w13, e.w2, e.first, moe.cfg.activation)
        got = gemv_moe.gemv_moe(x, ids, weights, e.w13, e.w2, e.first, moe.cfg.activation,
                                down_cfg=gemv_moe.GemvConfig(block_n=8, block_k=16, num_warps=2))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
