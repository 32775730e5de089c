"""DeepSeek-V3's architecture (V3, R1, V3.1, Kimi-K2) as kestrel needs it, parsed once from config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.layers.moe.config import MoEConfig, RouterConfig
from kestrel.layers.rotary import RopeConfig, yarn_softmax_scale
from kestrel.models.arch_config import check_silu, parse_rope

_SIZES = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
          "vocab_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
          "num_experts_per_tok")


@dataclass(frozen=True)
class V3Config:
    """Multi-head latent attention: q from `q_lora_rank` (None: one q_proj), per token one latent of
    `kv_lora_rank` plus one rope key of `qk_rope_head_dim` shared by all heads; a head's key is
    [nope (from the latent) | rope], its value `v_head_dim` wide (from the latent). `rope_interleave`:
    the checkpoint's rope dims pair up as (0, 1), (2, 3), ... rather than (i, i + d/2).
    `moe_layers[i]`: layer i's MLP is `moe` (else dense, `intermediate_size`); the MTP layers
    (`num_nextn_predict_layers`, layer ids from num_hidden_layers on) are MoE layers."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    rope_interleave: bool
    softmax_scale: float
    moe: MoEConfig
    moe_layers: tuple[bool, ...]
    num_nextn_predict_layers: int
    eos_token_ids: tuple[int, ...]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def parse_v3_config(config: dict[str, Any]) -> V3Config:
    """Validate a DeepSeek-V3-family config.json; ValueError naming what is missing or unsupported."""
    missing = [key for key in _SIZES if config.get(key) is None]
    if missing:
        raise ValueError(f"DeepSeek-V3 config.json lacks {', '.join(missing)}")
    for key in (*_SIZES, "q_lora_rank"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    check_silu(config, "DeepSeek-V3 uses")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads={config['num_key_value_heads']}: MLA has one key/value per query "
                         f"head ({heads})")
    if config.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported: DeepSeek-V3's projections have no biases")
    scoring = config.get("scoring_func", "sigmoid")
    topk_method = config.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or topk_method != "noaux_tc":
        raise ValueError(f"scoring_func={scoring!r}, topk_method={topk_method!r}: DeepSeek-V3 routing is 'sigmoid' "
                         "scores with 'noaux_tc' (correction-bias) selection")
    experts = config["n_routed_experts"]
    router = RouterConfig("biased_topk", experts, config["num_experts_per_tok"],
                          renormalize=bool(config.get("norm_topk_prob", True)), scoring_func="sigmoid",
                          scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                          n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1)
    moe = MoEConfig(config["hidden_size"], config["moe_intermediate_size"], router,
                    shared_intermediate_size=config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0))
    num_layers, first_dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 0)
    freq = config.get("moe_layer_freq", 1)
    rope = parse_rope(config)
    qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    eos = config.get("eos_token_id")
    return V3Config(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        vocab_size=config["vocab_size"],
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope=rope,
        rope_interleave=bool(config.get("rope_interleave", True)),
        softmax_scale=yarn_softmax_scale(rope, qk_head_dim ** -0.5),
        moe=moe,
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        num_nextn_predict_layers=config.get("num_nextn_predict_layers") or 0,
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
    )
