"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per head), MoE layers with
a softmax top-k router (renormalised with `norm_topk_prob`) and no shared expert; dense MLPs on the
layers `mlp_only_layers` / `decoder_sparse_step` leave out. Experts per expert: `mlp.experts.E.gate_proj`."""
from __future__ import annotations

from typing import Any

from kestrel.layers.moe import MoEConfig, RouterConfig
from kestrel.models.llama_moe import LlamaMoeForCausalLM, MoeArchConfig, parse_moe_arch, qwen_sparse_layers, required


def parse_qwen3_moe_config(config: dict[str, Any]) -> MoeArchConfig:
    router = RouterConfig("softmax_topk", required(config, "num_experts", "num_local_experts"),
                          required(config, "num_experts_per_tok"), renormalize=bool(config.get("norm_topk_prob", False)))
    moe = MoEConfig(required(config, "hidden_size"), required(config, "moe_intermediate_size"), router)
    return parse_moe_arch(config, moe, qwen_sparse_layers(config))


class Qwen3MoeForCausalLM(LlamaMoeForCausalLM):
    parse_config = staticmethod(parse_qwen3_moe_config)
