"""DeepSeek-V4's architecture as kestrel needs it, parsed once from a `config.json` dict.

Two spellings exist: the HF one (`hidden_size`, `layer_types`, `rope_parameters: {main, compress}`,
`mlp_layer_types`; transformers' `DeepseekV4Config`) and DeepSeek's native one (`dim`, `n_layers`,
`compress_ratios`, `rope_factor`, ...; REF `ModelArgs`). Both parse to the same `V4Config`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMPRESS_RATIOS = (0, 4, 128)
# HF's names for the three attention kinds (docs/design/deepseek-v4.md §1.2).
_LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
# What a config.json may ask of the rope, said where it asks for more (refused: silently dropping it would
# give other logits than transformers, which applies both).
_V4_YARN = ("DeepSeek-V4 applies YaRN (factor, original_max_position_embeddings, beta_fast, beta_slow) to the "
            "compressed layers' rope only (rope_parameters.compress), without an attention factor")


@dataclass(frozen=True)
class YarnConfig:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class V4Config:
    """`compress_ratios[i]` for main layer i; `mtp_compress_ratio` for the MTP layer (always 0 in the
    released models). `yarn` applies to the compressed layers' rope only (docs/design/deepseek-v4.md §2.1)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    compress_ratios: tuple[int, ...]
    mtp_compress_ratio: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnConfig | None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    num_nextn_predict_layers: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        bad = [r for r in (*self.compress_ratios, self.mtp_compress_ratio) if r not in COMPRESS_RATIOS]
        if bad:
            raise ValueError(f"DeepSeek-V4 compress ratios must be in {COMPRESS_RATIOS}, got {bad}")
        if len(self.compress_ratios) != self.num_hidden_layers:
            raise ValueError(f"{len(self.compress_ratios)} compress ratios for {self.num_hidden_layers} layers")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and fit head_dim "
                             f"({self.head_dim}) and index_head_dim ({self.index_head_dim})")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"o_groups={self.o_groups}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={self.scoring_func!r}; supported: {', '.join(SCORING_FUNCS)}")
        if self.num_nextn_predict_layers > 1:
            raise ValueError(f"num_nextn_predict_layers={self.num_nextn_predict_layers}; at most 1 is supported")

    @property
    def num_key_value_heads(self) -> int:
        return 1  # one K=V head (docs/design/deepseek-v4.md §2.3)


def is_native(config: dict[str, Any]) -> bool:
    """DeepSeek's own `config.json` (REF `ModelArgs`) rather than the HF spelling."""
    return "dim" in config and "n_layers" in config


def parse_v4_config(config: dict[str, Any]) -> V4Config:
    """Validate and normalise either spelling; raises ValueError naming what is wrong or missing."""
    try:
        return _parse_native(config) if is_native(config) else _parse_hf(config)
    except KeyError as e:
        raise ValueError(f"DeepSeek-V4 config.json lacks the field {e.args[0]!r}") from None


def _eos(config: dict[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id", 1)
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def _ratios(entries: list[int], num_layers: int) -> tuple[tuple[int, ...], int]:
    """(main layers' ratios, the MTP layer's): the list has one entry per layer, plus optionally the MTP's."""
    if len(entries) not in (num_layers, num_layers + 1):
        raise ValueError(f"compress_ratios has {len(entries)} entries; expected {num_layers} or {num_layers + 1}")
    return tuple(int(r) for r in entries[:num_layers]), int(entries[num_layers]) if len(entries) > num_layers else 0


def _parse_native(c: dict[str, Any]) -> V4Config:
    n = c["n_layers"]
    ratios, mtp_ratio = _ratios(c["compress_ratios"], n)
    factor = float(c.get("rope_factor", 1.0))
    yarn = None if factor == 1.0 else YarnConfig(factor, int(c["original_seq_len"]), float(c.get("beta_fast", 32)),
                                                 float(c.get("beta_slow", 1)))
    _check_shared(c.get("n_shared_experts", 1))
    return V4Config(
        architecture="DeepseekV4ForCausalLM", vocab_size=c["vocab_size"], hidden_size=c["dim"], num_hidden_layers=n,
        compress_ratios=ratios, mtp_compress_ratio=mtp_ratio, num_attention_heads=c["n_heads"],
        head_dim=c["head_dim"], qk_rope_head_dim=c["rope_head_dim"], q_lora_rank=c["q_lora_rank"],
        o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"], sliding_window=c["window_size"],
        rope_theta=float(c.get("rope_theta", 10000.0)), compress_rope_theta=float(c["compress_rope_theta"]),
        yarn=yarn, index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"], hc_mult=c.get("hc_mult", 4), hc_sinkhorn_iters=c.get("hc_sinkhorn_iters", 20),
        hc_eps=float(c.get("hc_eps", 1e-6)), rms_norm_eps=float(c.get("norm_eps", 1e-6)),
        n_routed_experts=c["n_routed_experts"], num_experts_per_tok=c["n_activated_experts"],
        moe_intermediate_size=c["moe_inter_dim"], num_hash_layers=c.get("n_hash_layers", 0),
        scoring_func=c.get("score_func", "sqrtsoftplus"), routed_scaling_factor=float(c.get("route_scale", 1.0)),
        swiglu_limit=float(c.get("swiglu_limit", 0.0)) or float("inf"),
        num_nextn_predict_layers=c.get("n_mtp_layers", 0), max_position_embeddings=c.get("max_seq_len", 1 << 20),
        eos_token_ids=_eos(c),
    )


def _parse_hf(c: dict[str, Any]) -> V4Config:
    n = c["num_hidden_layers"]
    if "compress_ratios" in c:  # legacy HF spelling, still in the released config.json files
        ratios, mtp_ratio = _ratios(c["compress_ratios"], n)
    else:
        types = c["layer_types"][:n]
        rates = {**{k: v for k, v in _LAYER_TYPE_RATIO.items() if v}, **(c.get("compress_rates") or {})}
        unknown = sorted(set(types) - set(_LAYER_TYPE_RATIO))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not DeepSeek-V4 layer types ({', '.join(_LAYER_TYPE_RATIO)})")
        ratios, mtp_ratio = tuple(0 if t == "sliding_attention" else int(rates[t]) for t in types), 0
    head_dim = c.get("head_dim", 512)
    rope_dim = c.get("qk_rope_head_dim") or int(head_dim * c.get("partial_rotary_factor", 64 / 512))
    rope = c.get("rope_parameters") or {}
    if isinstance(rope.get("compress"), dict):  # transformers >= 5.24 nests the two ropes
        main, comp = rope.get("main", {}), rope["compress"]
        if main.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.main has rope_type {main['rope_type']!r}, which kestrel does not apply: "
                             f"DeepSeek-V4 rotates its sliding-window layers with plain rope ({_V4_YARN})")
        rope_theta = main.get("rope_theta", c.get("rope_theta", 10000.0))
        compress_theta = comp.get("rope_theta", c.get("compress_rope_theta", 160000.0))
        yarn_params = comp if comp.get("rope_type") == "yarn" else None
    else:
        rope_theta, compress_theta = c.get("rope_theta", 10000.0), c.get("compress_rope_theta", 160000.0)
        scaling = c.get("rope_scaling") or rope
        yarn_params = scaling if scaling.get("rope_type", scaling.get("type")) == "yarn" else None
    factor = (yarn_params or {}).get("attention_factor")
    if factor is not None and float(factor) != 1.0:
        raise ValueError(f"the YaRN rope parameters set attention_factor={factor}, which kestrel does not apply: "
                         f"{_V4_YARN}; remove it or set it to 1")
    yarn = None if yarn_params is None else YarnConfig(
        float(yarn_params["factor"]), int(yarn_params["original_max_position_embeddings"]),
        float(yarn_params.get("beta_fast", 32)), float(yarn_params.get("beta_slow", 1)))
    mlp_types = c.get("mlp_layer_types")
    num_hash = sum(t == "hash_moe" for t in mlp_types) if mlp_types else c.get("num_hash_layers", 3)
    if mlp_types and list(mlp_types[:num_hash]) != ["hash_moe"] * num_hash:
        raise ValueError(f"mlp_layer_types {mlp_types}: hash layers must be the first ones")
    _check_shared(c.get("n_shared_experts", 1))
    return V4Config(
        architecture=(c.get("architectures") or ["DeepseekV4ForCausalLM"])[0], vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"], num_hidden_layers=n, compress_ratios=ratios, mtp_compress_ratio=mtp_ratio,
        num_attention_heads=c["num_attention_heads"], head_dim=head_dim, qk_rope_head_dim=rope_dim,
        q_lora_rank=c["q_lora_rank"], o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"],
        sliding_window=c["sliding_window"], rope_theta=float(rope_theta), compress_rope_theta=float(compress_theta),
        yarn=yarn, index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"], index_topk=c["index_topk"],
        hc_mult=c.get("hc_mult", 4), hc_sinkhorn_iters=c.get("hc_sinkhorn_iters", 20),
        hc_eps=float(c.get("hc_eps", 1e-6)), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        n_routed_experts=c["n_routed_experts"], num_experts_per_tok=c["num_experts_per_tok"],
        moe_intermediate_size=c["moe_intermediate_size"], num_hash_layers=num_hash,
        scoring_func=c.get("scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        swiglu_limit=float(c.get("swiglu_limit") or float("inf")),
        num_nextn_predict_layers=c.get("num_nextn_predict_layers", 0),
        max_position_embeddings=c.get("max_position_embeddings", 1 << 20), eos_token_ids=_eos(c),
    )


def _check_shared(n_shared: int) -> None:
    if n_shared != 1:
        raise ValueError(f"n_shared_experts={n_shared}; DeepSeek-V4 has exactly one shared expert")
