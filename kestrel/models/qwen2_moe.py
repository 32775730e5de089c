"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias unless `qkv_bias` is
false), MoE layers with a softmax top-k router and a shared expert whose output is scaled per token by
sigmoid(shared_expert_gate x). The checkpoint's `mlp.shared_expert.{gate,up,down}_proj` are the layer's
`shared_experts.{w1,w3,w2}`."""
from __future__ import annotations

from typing import Any

from kestrel.layers.moe import MoEConfig, RouterConfig
from kestrel.models.llama_moe import LlamaMoeForCausalLM, MoeArchConfig, parse_moe_arch, qwen_sparse_layers, required


def parse_qwen2_moe_config(config: dict[str, Any]) -> MoeArchConfig:
    router = RouterConfig("softmax_topk", required(config, "num_experts", "num_local_experts"),
                          required(config, "num_experts_per_tok"), renormalize=bool(config.get("norm_topk_prob", False)))
    moe = MoEConfig(required(config, "hidden_size"), required(config, "moe_intermediate_size"), router,
                    shared_intermediate_size=required(config, "shared_expert_intermediate_size"),
                    shared_expert_gate=True)
    return parse_moe_arch(config, moe, qwen_sparse_layers(config))


class Qwen2MoeForCausalLM(LlamaMoeForCausalLM):
    parse_config = staticmethod(parse_qwen2_moe_config)
    checkpoint_renames = ((r"\.mlp\.shared_expert\.gate_proj\.", ".mlp.shared_experts.w1."),
                          (r"\.mlp\.shared_expert\.up_proj\.", ".mlp.shared_experts.w3."),
                          (r"\.mlp\.shared_expert\.down_proj\.", ".mlp.shared_experts.w2."))
