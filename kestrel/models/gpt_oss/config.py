"""gpt-oss's architecture as kestrel needs it, parsed once from config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.layers.moe.config import ExpertActivation, MoEConfig, RouterConfig
from kestrel.layers.rotary import RopeConfig
from kestrel.models.arch_config import parse_rope
from kestrel.quant.mxfp4 import check_mxfp4_config, is_mxfp4_checkpoint

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssConfig:
    """`sliding_windows[i]`: layer i's window (None: full attention). Attention has biases on q, k, v and
    o (as the released checkpoints; `attention_bias` false: none) and a learned sink per head;
    `num_attention_heads * head_dim` need not equal `hidden_size`.
    `mxfp4`: the checkpoint stores the experts as MXFP4 blocks and scales (kestrel.quant.mxfp4)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]
    moe: MoEConfig
    mxfp4: bool
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = True


def parse_gpt_oss_config(config: dict[str, Any]) -> GptOssConfig:
    """Validate a gpt-oss config.json; ValueError naming what is missing or unsupported."""
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
             "intermediate_size", "num_local_experts", "num_experts_per_tok")
    missing = [key for key in sizes if key not in config]
    if missing:
        raise ValueError(f"gpt-oss config.json lacks {', '.join(missing)}")
    for key in sizes:
        if isinstance(config[key], bool) or not isinstance(config[key], int) or config[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {config[key]!r}")
    num_layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    layer_types = config.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(num_layers)]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must give one of {LAYER_TYPES} per layer ({num_layers}); got {layer_types}")
    window = config.get("sliding_window")
    if window is None and "sliding_attention" in layer_types:
        raise ValueError("layer_types has sliding_attention layers but the config gives no sliding_window")
    mxfp4 = is_mxfp4_checkpoint(config)
    if mxfp4:
        check_mxfp4_config(config)
    elif config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise ValueError(f"gpt-oss checkpoint quantized with {method!r}; kestrel loads gpt-oss in float or with "
                         "MXFP4 experts (quantization_config.quant_method 'mxfp4')")
    eos = config.get("eos_token_id")
    router = RouterConfig("topk_softmax", config["num_local_experts"], config["num_experts_per_tok"],
                          logit_bias=True)
    activation = ExpertActivation("gpt_oss", limit=float(config.get("swiglu_limit", 7.0)),
                                  alpha=float(config.get("swiglu_alpha", 1.702)))
    return GptOssConfig(
        hidden_size=config["hidden_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        max_position_embeddings=config.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope=parse_rope({"rope_theta": 150000.0, **config}),
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
        moe=MoEConfig(config["hidden_size"], config["intermediate_size"], router, activation, expert_bias=True),
        mxfp4=mxfp4,
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        attention_bias=bool(config.get("attention_bias", True)),
    )
