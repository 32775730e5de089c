"""V4's MoE sublayer (docs/design/deepseek-v4.md §4) as a use of the shared MoE layer (kestrel/layers/moe):
every layer is MoE; the first `num_hash_layers` route by a fixed token-id table, the others by top-k of
the scores plus a selection-only bias. Routed and shared experts are SwiGLU with the same clamp; the
routed weights are renormalised and scaled.

Expert parallelism (`ep_size` = tp_size): each rank holds n_routed_experts / ep_size consecutive routed
experts. Every rank holds every token (the rest of the model is replicated), so dispatching a token
to its experts' ranks is each rank picking the tokens routed to its own experts; the combine is the
layer's one all-reduce, which also carries the shared expert (added by rank 0)."""
from __future__ import annotations

from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.moe import MoE, MoEConfig
from kestrel.layers.moe.config import ExpertActivation, RouterConfig
from kestrel.models.deepseek_v4.config import V4Config


def v4_moe_config(cfg: V4Config, hash_routing: bool) -> MoEConfig:
    router = RouterConfig("hash" if hash_routing else "biased_topk", cfg.n_routed_experts, cfg.num_experts_per_tok,
                          renormalize=True, scoring_func=cfg.scoring_func, scaling_factor=cfg.routed_scaling_factor,
                          vocab_size=cfg.vocab_size)
    return MoEConfig(cfg.hidden_size, cfg.moe_intermediate_size, router,
                     ExpertActivation("clamped_silu", cfg.swiglu_limit),
                     shared_intermediate_size=cfg.moe_intermediate_size)


def v4_moe(cfg: V4Config, hash_routing: bool, parallel: ParallelState = ParallelState()) -> MoE:
    """Parameters under DeepSeek's native names: `gate.weight`, `gate.e_score_correction_bias` (native
    `gate.bias`) or the buffer `gate.tid2eid`, `experts.w13` / `experts.w2` (stacked), `shared_experts.w1|w2|w3`."""
    return MoE(v4_moe_config(cfg, hash_routing), parallel)
