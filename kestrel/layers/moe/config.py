"""What a MoE layer is, as data: its router, its experts' activation and sizes, its shared expert.

A family's config parser builds one `MoEConfig` per MoE layer kind; the layer (`layer.py`) and its
pieces read nothing else."""
from __future__ import annotations

from dataclasses import dataclass

ROUTERS = ("softmax_topk", "topk_softmax", "biased_topk", "hash")
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
ACTIVATIONS = ("silu", "clamped_silu", "gpt_oss")


@dataclass(frozen=True)
class RouterConfig:
    """How a token picks its `top_k` of `num_experts` routed experts and weighs them (routers.py):

    - "softmax_topk": softmax over all logits, top-k, renormalised to sum 1 if `renormalize`
      (Qwen3-MoE / Qwen2-MoE: `norm_topk_prob`; Mixtral: always);
    - "topk_softmax": top-k of the logits, softmax over the k picked (gpt-oss);
    - "biased_topk": scores = `scoring_func`(logits); experts picked by scores + a selection-only
      correction bias, within the best `topk_group` of `n_group` groups (DeepSeek-V3; V4 has one
      group); weights = the picked scores, renormalised if `renormalize`, times `scaling_factor`;
    - "hash": experts from a fixed token-id table [vocab_size, top_k], weighed as "biased_topk"
      (DeepSeek-V4's first layers).
    `logit_bias`: the gate linear has a bias (gpt-oss)."""

    kind: str
    num_experts: int
    top_k: int
    renormalize: bool = True
    scoring_func: str = "softmax"
    scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    logit_bias: bool = False
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ROUTERS:
            raise ValueError(f"MoE router {self.kind!r} is not supported; supported: {', '.join(ROUTERS)}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"MoE scoring_func {self.scoring_func!r} is not supported; supported: "
                             f"{', '.join(SCORING_FUNCS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide the {self.num_experts} experts and topk_group="
                             f"{self.topk_group} be in 1..n_group")
        if self.kind == "hash" and self.vocab_size < 1:
            raise ValueError("hash routing needs the vocabulary size (its token-id table has a row per token)")


@dataclass(frozen=True)
class ExpertActivation:
    """The gated activation between an expert's gate|up and down projections (`activation.py`):

    - "silu": SiLU(gate) * up (Qwen, Mixtral);
    - "clamped_silu": SiLU(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4);
    - "gpt_oss": g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""

    kind: str = "silu"
    limit: float = float("inf")
    alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.kind!r} is not supported; supported: {', '.join(ACTIVATIONS)}")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE sublayer: `router`, routed experts of width `intermediate_size` on `hidden_size`
    (gate|up and down projections with optional per-expert biases, `activation`), an optional shared
    expert of width `shared_intermediate_size` (0: none) that every token runs, optionally scaled by
    sigmoid(x . w) per token (`shared_expert_gate`, Qwen2-MoE)."""

    hidden_size: int
    intermediate_size: int
    router: RouterConfig
    activation: ExpertActivation = ExpertActivation()
    expert_bias: bool = False
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False

    @property
    def num_experts(self) -> int:
        return self.router.num_experts
