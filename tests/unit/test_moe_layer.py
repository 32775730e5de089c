"""The shared MoE layer (kestrel/layers/moe) against transformers' own routers and experts: each router kind
picks the same experts with the same weights; gpt-oss's experts (interleaved gate|up, transposed down,
biases, its clamped SwiGLU) loaded through the layer's stacked layouts give transformers' output on all
four paths (the grouped GEMM and the GEMVs through Triton's interpreter); expert and tensor parallelism
split the experts so that the ranks' partial sums add up to one rank's."""
from __future__ import annotations

import pytest
import torch
import transformers

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.moe import ExpertActivation, MoE, MoEConfig, RouterConfig
from kestrel.layers.moe.loading import (ExpertCheckpoint, StackedLayout, interleaved_gate_up,
                                        interleaved_gate_up_bias, transposed)
from kestrel.layers.moe.routers import Router

H, E, K = 32, 8, 2
GPT_OSS_EXPERTS = ExpertCheckpoint(stacked={
    "gate_up_proj": StackedLayout("gate_up", interleaved_gate_up),
    "gate_up_proj_bias": StackedLayout("gate_up_bias", interleaved_gate_up_bias),
    "down_proj": StackedLayout("down", transposed), "down_proj_bias": StackedLayout("down_bias")})


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
    return module


def _hf_router(name: str, **config):
    """transformers' router of family `name`, random weights (and biases)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dsv3
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss
    from transformers.models.mixtral import modeling_mixtral as mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    router_cls, config_cls = {"Qwen3Moe": (qwen3_moe.Qwen3MoeTopKRouter, transformers.Qwen3MoeConfig),
                              "Mixtral": (mixtral.MixtralTopKRouter, transformers.MixtralConfig),
                              "GptOss": (gpt_oss.GptOssTopKRouter, transformers.GptOssConfig),
                              "DeepseekV3": (dsv3.DeepseekV3TopkRouter, transformers.DeepseekV3Config)}[name]
    cfg = config_cls(hidden_size=H, num_experts_per_tok=K, num_local_experts=E, n_routed_experts=E, **config)
    return _randomized(router_cls(cfg), seed=len(name))


@pytest.mark.parametrize("hf_name, hf_config, ours", [
    ("Qwen3Moe", dict(norm_topk_prob=True), RouterConfig("softmax_topk", E, K, renormalize=True)),
    ("Qwen3Moe", dict(norm_topk_prob=False), RouterConfig("softmax_topk", E, K, renormalize=False)),
    ("Mixtral", {}, RouterConfig("softmax_topk", E, K)),
    ("GptOss", {}, RouterConfig("topk_softmax", E, K, logit_bias=True)),
    ("DeepseekV3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
     RouterConfig("biased_topk", E, K, scoring_func="sigmoid", scaling_factor=2.5, n_group=4, topk_group=2)),
], ids=["qwen3-renorm", "qwen3", "mixtral", "gpt-oss", "deepseek-v3-groups"])
def test_each_router_picks_and_weighs_as_transformers(hf_name, hf_config, ours):
    hf = _hf_router(hf_name, **hf_config)
    router = Router(ours, H)
    with torch.no_grad():
        router.weight.copy_(hf.weight)
        if ours.logit_bias:
            router.bias.copy_(hf.bias)
        if ours.kind == "biased_topk":
            router.e_score_correction_bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
        _, want_w, want_ids = hf(x)
        ids, weights = router(x)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert len(ids.unique()) > K  # the tokens do not all pick the same experts
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))


def _gpt_oss_experts(limit: float = 1.5):
    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=24, num_local_experts=E, swiglu_limit=limit)
    return _randomized(transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg), seed=3)


def _gpt_oss_layer(hf, parallel: ParallelState = ParallelState()) -> MoE:
    cfg = MoEConfig(H, 24, RouterConfig("topk_softmax", E, K, logit_bias=True),
                    ExpertActivation("gpt_oss", limit=hf.limit, alpha=hf.alpha), expert_bias=True)
    layer = MoE(cfg, parallel, GPT_OSS_EXPERTS)
    loader = layer.experts.tensor_loader()
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert loader.load(name, lambda name=name: getattr(hf, name).detach()) is not None
    return layer


@pytest.mark.parametrize("path", ["loop", "every", "fused", "gemv"])
def test_gpt_oss_experts_through_the_layer_equal_transformers(path):
    pytest.importorskip("triton")
    hf = _gpt_oss_experts()
    layer = _gpt_oss_layer(hf)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(9)])
    weights = torch.rand(9, K, generator=gen)
    out = torch.zeros(9, H)
    with torch.no_grad():
        want = hf(x, ids, weights)
        layer.add_routed(x, ids, weights, out, path)
    gate = x @ layer.experts.w13[:, :24].transpose(1, 2)
    assert (gate > hf.limit).any(), "the clamp should fire"
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_ranks_partial_sums_add_up_to_one_rank(ep_size):
    """Two ranks (tp_size 2): experts split (ep_size 2) or each expert's width split (ep_size 1), with
    expert biases (added once) and a gated shared expert (its width split, added once)."""
    hf = _gpt_oss_experts()
    whole = _gpt_oss_layer(hf)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ids, weights = whole.gate(x)
        want = torch.zeros(7, H)
        whole.add_routed(x, ids, weights, want, "loop")
        got = torch.zeros(7, H)
        for rank in range(2):
            part = _gpt_oss_layer(hf, ParallelState(rank, 2, ep_size=ep_size))
            assert part.experts.count == E // ep_size and part.experts.w2.shape[2] == 24 * ep_size // 2
            part.add_routed(x, ids, weights, got, "every")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
