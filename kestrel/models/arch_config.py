"""The model architecture as kestrel needs it, parsed once from a HF `config.json` dict.

Checkpoints in the wild use either the transformers-4 rope keys (`rope_theta`, `rope_scaling`) or the
transformers-5 ones (`rope_parameters: {"rope_type", "rope_theta", ...}`); both parse to the same
`RopeConfig`. Rope types are validated where the rope is built (`layers/rotary.py`), so sizing the KV
cache works for any config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.layers.rotary import RopeConfig

# Differences between the Llama-family architectures that the config does not spell out.
_QWEN_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Architectures whose attention has per-head q/k RMSNorm and `attention_bias` on q, k, v and o.
_QWEN3_ATTENTION = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ArchConfig:
    """Llama-family architecture. `sliding_windows[i]` is layer i's window (None: full attention)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before rope
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...]


def check_silu(config: dict[str, Any], who: str) -> None:
    """Refuse an activation other than SiLU (transformers' "swish" is the same function)."""
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r} is not supported; {who} 'silu' (or its other name, 'swish')")


def parse_arch_config(config: dict[str, Any]) -> ArchConfig:
    """Validate and normalize a HF config dict; raises ValueError naming what is unsupported."""
    archs = config.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no `architectures` entry; cannot tell which model to build")
    arch = archs[0]
    check_silu(config, "Llama-family models need")
    check_sizes(config)
    missing = [key for key in _SIZES if key != "num_key_value_heads" and key not in config]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing")
    hidden, heads, num_layers, intermediate, vocab = (config[key] for key in _SIZES[:5])
    kv_heads = config.get("num_key_value_heads") or heads
    # Qwen3's config class defaults head_dim to 128 rather than hidden / heads.
    default_head_dim = 128 if arch == "Qwen3ForCausalLM" else hidden // heads
    # Qwen2 always has q/k/v bias (and no o_proj bias), Qwen2-MoE unless `qkv_bias` says not; Llama and
    # Qwen3(-MoE) put `attention_bias` on all four; Mistral and Mixtral have none, whatever it says.
    attention_bias = bool(config.get("attention_bias", False)) and arch in ("LlamaForCausalLM", *_QWEN3_ATTENTION)
    qkv_bias = True if arch == "Qwen2ForCausalLM" else bool(config.get("qkv_bias", True)) \
        if arch == "Qwen2MoeForCausalLM" else attention_bias
    o_proj_bias = attention_bias
    eos = config.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return ArchConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=config.get("head_dim") or default_head_dim,
        rms_norm_eps=config.get("rms_norm_eps", _DEFAULTS.get(arch, {}).get("rms_norm_eps", 1e-6)),
        vocab_size=vocab,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(config.get("mlp_bias", False)),
        qk_norm=arch in _QWEN3_ATTENTION,
        rope=parse_rope(config),
        sliding_windows=_sliding_windows(arch, config, num_layers),
        eos_token_ids=eos_ids,
    )


# What transformers' config classes default to where they differ from the common defaults (rope theta
# 10000, RMSNorm epsilon 1e-6, no window), for config.json files that leave the key out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "MixtralForCausalLM": {"rope_theta": 1e6, "rms_norm_eps": 1e-5},
    "MistralForCausalLM": {"sliding_window": 4096},
}

_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
          "num_key_value_heads")


def check_sizes(config: dict[str, Any]) -> None:
    """The sizes a Llama-family config gives are positive integers that fit together (heads split the
    hidden size unless head_dim is given, key/value heads split the heads); ValueError naming them.
    Sizes it leaves out are not checked here (config-only folders for resolving omit them)."""
    for key in _SIZES:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    hidden, heads, kv_heads = (config.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    if heads and kv_heads and heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    qwen3 = (config.get("architectures") or [None])[0] == "Qwen3ForCausalLM"  # its head_dim defaults to 128
    if hidden and heads and hidden % heads and not config.get("head_dim") and not qwen3:
        raise ValueError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}), and no "
                         "head_dim is given")


def parse_rope(config: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; transformers 4 writes `rope_theta` + optional `rope_scaling`.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    # transformers 5 may also write a null top-level `rope_theta` next to `rope_parameters`.
    arch = (config.get("architectures") or [None])[0]
    theta = params.get("rope_theta") or config.get("rope_theta") or _DEFAULTS.get(arch, {}).get("rope_theta", 1e4)
    rope_type = params.get("rope_type", params.get("type", "default"))
    original_max = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn"):
        # As transformers: a top-level value (Phi-3 style) wins over the rope section's, and without
        # either the model's max length stands in.
        original_max = config.get("original_max_position_embeddings") or original_max \
            or config.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and original_max:
        factor = config.get("max_position_embeddings", original_max) / original_max  # transformers' fallback
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original_max,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
    )


def _sliding_windows(arch: str, config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer window, matching transformers: Mistral and Mixtral window every layer when
    `sliding_window` is set, Qwen3-MoE too with `use_sliding_window`; Qwen2/3 and Qwen2-MoE only with
    `use_sliding_window`, on layers marked "sliding_attention" (by default Qwen2/3's are those from
    `max_window_layers` on, Qwen2-MoE's the even ones below it); Llama never."""
    window = config.get("sliding_window", _DEFAULTS.get(arch, {}).get("sliding_window")) or None  # Qwen2-MoE: 0
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers
    if window is None or not config.get("use_sliding_window", False):
        return (None,) * num_layers
    if arch == "Qwen3MoeForCausalLM":
        return (window,) * num_layers
    if arch == "Qwen2MoeForCausalLM":
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 and i < config.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)]
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch in _QWEN_ARCHS:
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * num_layers
