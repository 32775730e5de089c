"""Tiny random HF checkpoints for tests, built with transformers in well under a second.

Weights are drawn wider than transformers' default (and norms/biases randomized too), so logits
differ clearly between tokens and every loaded tensor matters to the output.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Short name -> HF architecture; either spelling is accepted.
ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
             initializer_range=0.08, hidden_act="silu", bos_token_id=0, eos_token_id=1, pad_token_id=2)

# What makes each architecture's tiny model exercise its differences.
_ARCH_EXTRA: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(rope_theta=10000.0),
    "MistralForCausalLM": dict(rope_theta=10000.0, sliding_window=8),  # windows bite on short prompts
    "Qwen2ForCausalLM": dict(rope_theta=1000000.0),  # q/k/v bias comes with the architecture
    "Qwen3ForCausalLM": dict(rope_theta=1000000.0, head_dim=32),  # head_dim != hidden / heads
    # MoE: more experts than a token picks, widths that differ from the dense MLP's.
    "Qwen3MoeForCausalLM": dict(rope_theta=1000000.0, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=48, norm_topk_prob=True),
    "Qwen2MoeForCausalLM": dict(rope_theta=1000000.0, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                                shared_expert_intermediate_size=80),
    "MixtralForCausalLM": dict(rope_theta=10000.0, num_local_experts=4, num_experts_per_tok=2, intermediate_size=96,
                               sliding_window=8),
}


def make_tiny_model(arch: str, path: str | Path, *, vocab_size: int = 512, dtype: str = "float32",
                    tie: bool = False, seed: int = 0, with_tokenizer: bool = False,
                    **config_overrides: Any) -> Path:
    """Save a random tiny `arch` model (config.json + safetensors) to `path` and return the path.

    `config_overrides` go to the transformers config (e.g. `rope_scaling={...}`,
    `num_hidden_layers=3`), except `max_shard_size`, which goes to `save_pretrained` to shard it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    arch = ARCHS.get(arch, arch)
    if arch not in _ARCH_EXTRA:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)} or {sorted(_ARCH_EXTRA)}")
    shard_size = config_overrides.pop("max_shard_size", None)
    save_kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    special: dict[str, Any] = {}
    if with_tokenizer:
        from tests.tiny_tokenizer import build_tokenizer

        tok = build_tokenizer(path, vocab_size)
        special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model_type = {name: short for short, name in ARCHS.items()}[arch]  # the short names are HF model types
    config = AutoConfig.for_model(model_type, **{**_BASE, **_ARCH_EXTRA[arch], **special,
                                                 "vocab_size": vocab_size, "tie_word_embeddings": tie,
                                                 "architectures": [arch], **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # float32: randomize at full precision, then cast
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path
