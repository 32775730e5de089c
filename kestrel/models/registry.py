"""HF `architectures` names -> kestrel model classes."""
from __future__ import annotations

from typing import Any

from kestrel.models.base import CausalLM
from kestrel.models.deepseek_v3.model import DeepseekV3ForCausalLM
from kestrel.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kestrel.models.gpt_oss.model import GptOssForCausalLM
from kestrel.models.llama import LlamaForCausalLM
from kestrel.models.mixtral import MixtralForCausalLM
from kestrel.models.qwen2_moe import Qwen2MoeForCausalLM
from kestrel.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[CausalLM]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architectures: list[str]) -> type[CausalLM]:
    """The class for the first supported name in `architectures` (a config.json field)."""
    for name in architectures:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(f"unsupported model architectures {architectures}; "
                     f"supported: {', '.join(supported_architectures())}")


def needs_dsv4_attention(architectures: list[str]) -> bool:
    """DeepSeek-V4's sliding-window + compressed sparse attention runs only on a V4-capable backend
    (and such a backend serves nothing else)."""
    return "DeepseekV4ForCausalLM" in architectures


def needs_mla_attention(architectures: list[str]) -> bool:
    """DeepSeek-V3's Multi-head Latent Attention (also R1, V3.1 and Kimi-K2, which share its class):
    its layers hand the backend queries and compressed latents, which only an MLA backend serves."""
    return "DeepseekV3ForCausalLM" in architectures


def attention_kind(architectures: list[str]) -> str:
    """The attention registry's kind of this model's attention: "dsv4", "mla" or "mha"."""
    if needs_dsv4_attention(architectures):
        return "dsv4"
    return "mla" if needs_mla_attention(architectures) else "mha"


def needs_attention_sinks(architectures: list[str]) -> bool:
    """gpt-oss's layers have attention sinks (and alternate sliding-window and full attention): only a
    backend that serves both runs it (the attention registry's `attention_sinks`)."""
    return "GptOssForCausalLM" in architectures


def kv_page_multiple(hf_config: dict[str, Any]) -> int:
    """KV page sizes must be multiples of this for the model of `hf_config` (config.json): the ratio
    of its compressed KV blocks (DeepSeek-V4), else 1. Reads the config only, builds no model."""
    if not needs_dsv4_attention(hf_config.get("architectures") or []):
        return 1
    import torch

    from kestrel.models.deepseek_v4.config import parse_v4_config
    from kestrel.models.deepseek_v4.kv_layout import v4_kv_layout

    return v4_kv_layout(parse_v4_config(hf_config), torch.bfloat16).page_multiple
