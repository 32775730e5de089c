"""The MoE layer's fused decode route on CUDA in bf16 at real families' widths (random weights): the Triton
router picks the ids `Router.forward` picks; the whole forward, eager and captured in a CUDA graph and
replayed on new tokens, equals today's decode forward (torch router, "gemv", torch combine) within bf16's
rounding, for Qwen3-MoE, gpt-oss (logit and expert biases, its clamped SwiGLU), Qwen2-MoE (a gated shared
expert, no renormalising) and Mixtral."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.moe import ExpertActivation, MoE, MoEConfig, RouterConfig, paths

FAMILIES = {
    "qwen3-30b-a3b": MoEConfig(2048, 768, RouterConfig("softmax_topk", 128, 8)),
    "gpt-oss-20b": MoEConfig(2880, 2880, RouterConfig("topk_softmax", 32, 4, logit_bias=True),
                             ExpertActivation("gpt_oss", limit=7.0), expert_bias=True),
    "qwen1.5-moe-a2.7b": MoEConfig(2048, 1408, RouterConfig("softmax_topk", 60, 4, renormalize=False),
                                   shared_intermediate_size=5632, shared_expert_gate=True),
    "mixtral-8x7b": MoEConfig(4096, 14336, RouterConfig("softmax_topk", 8, 2)),
}


def build(cfg: MoEConfig) -> MoE:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            layer = MoE(cfg)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return layer


def forward(layer: MoE, x: torch.Tensor, fused: bool, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(paths, "FUSED_DECODE_ROUTE", fused)
        assert paths.takes_decode_route(x, layer.experts, layer.cfg.router) == fused
        return layer(x)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_decode_route_equals_todays_decode(family, monkeypatch):
    from kestrel.layers.moe.route_kernels import route

    layer = build(FAMILIES[family])
    gen = torch.Generator("cuda").manual_seed(1)
    for T in (1, 2, paths.GEMV_MAX_TOKENS):
        x = torch.randn(T, layer.cfg.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            want_ids, want_weights = layer.gate(x)
            ids, weights = route(x, layer.gate.weight, layer.gate.bias, layer.cfg.router)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights)
        want, got = forward(layer, x, False, monkeypatch), forward(layer, x, True, monkeypatch)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"T={T}")

        static = x.clone()
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(paths, "FUSED_DECODE_ROUTE", True)
            layer(static)  # compiles the kernels before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = layer(static)
        fresh = torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(captured.float(), forward(layer, fresh, False, monkeypatch).float(),
                                   atol=2e-2, rtol=2e-2, msg=f"T={T}, replayed")
