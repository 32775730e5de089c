"""Mixtral (8x7B, 8x22B): Mistral's attention (a sliding window on every layer when `sliding_window` is
set), every MLP a MoE layer of `num_local_experts` experts of width `intermediate_size`, softmax top-k
renormalised. The checkpoint's `block_sparse_moe` is the layer's `mlp`; experts per expert
`experts.E.w1` (gate), `w3` (up), `w2` (down)."""
from __future__ import annotations

from typing import Any

from kestrel.layers.moe import MoEConfig, RouterConfig
from kestrel.layers.moe.loading import MIXTRAL_EXPERTS
from kestrel.models.llama_moe import LlamaMoeForCausalLM, MoeArchConfig, parse_moe_arch, required


def parse_mixtral_config(config: dict[str, Any]) -> MoeArchConfig:
    router = RouterConfig("softmax_topk", required(config, "num_local_experts", "num_experts"),
                          required(config, "num_experts_per_tok"), renormalize=True)
    moe = MoEConfig(required(config, "hidden_size"), required(config, "intermediate_size"), router)
    return parse_moe_arch(config, moe, [True] * required(config, "num_hidden_layers"))


class MixtralForCausalLM(LlamaMoeForCausalLM):
    parse_config = staticmethod(parse_mixtral_config)
    expert_checkpoint = MIXTRAL_EXPERTS
    checkpoint_renames = ((r"\.block_sparse_moe\.", ".mlp."),)
