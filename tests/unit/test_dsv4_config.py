"""DeepSeek-V4 at start-up: the shipped Flash-shaped config, its KV layout, and the split-backend rule."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kestrel.attention.registry import REGISTRY, attention_backends
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.models.deepseek_v4.kv_layout import v4_kv_layout

SLICE = Path(__file__).parents[2] / "kestrel/assets/configs/deepseek-v4-flash-slice"


def test_flash_slice_config_and_layout() -> None:
    cfg = parse_v4_config(json.loads((SLICE / "config.json").read_text()))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.index_topk) == \
        (4096, 64, 512, 128, 512)
    assert cfg.compress_ratios == (0, 0, 4, 128, 4, 128, 4, 128) and cfg.mtp_compress_ratio == 0
    assert cfg.yarn is not None and cfg.yarn.factor == 16 and cfg.compress_rope_theta == 160000
    assert cfg.num_hash_layers == 3 and cfg.qk_rope_head_dim == 64
    layout = v4_kv_layout(cfg, torch.bfloat16)
    # bf16 entries: per C4 layer (512 + 128) x 2 B per 4 tokens, per C128 layer 512 x 2 B per 128 tokens.
    assert layout.bytes_per_token == 3 * (512 + 128) * 2 / 4 + 3 * 512 * 2 / 128
    assert layout.page_multiple == 128


def hf_spelling(**rope: dict) -> dict:
    """The HF spelling of the reference's tiny config; `rope` replaces parts of rope_parameters."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "num_attention_heads": 8, "head_dim": 64, "partial_rotary_factor": 0.25, "q_lora_rank": 64, "o_groups": 2,
        "o_lora_rank": 32, "sliding_window": 16,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                            "compress": {"rope_type": "yarn", "rope_theta": 1.6e5, "factor": 4,
                                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
                            **rope},
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "routed_scaling_factor": 1.5, "swiglu_limit": 1.0, "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096, "eos_token_id": 1}


def test_hf_and_native_spellings_parse_alike() -> None:
    from tests.model.dsv4_reference import RefConfig

    native = parse_v4_config(RefConfig().native_config())
    assert parse_v4_config(hf_spelling()) == native
    # transformers writes the attention factor it applies: 1 is what V4 uses.
    compress = hf_spelling()["rope_parameters"]["compress"]
    assert parse_v4_config(hf_spelling(compress={**compress, "attention_factor": 1.0})) == native


def test_rope_settings_v4_does_not_use_are_refused() -> None:
    """transformers applies them; kestrel would silently compute other logits."""
    compress = hf_spelling()["rope_parameters"]["compress"]
    with pytest.raises(ValueError, match=r"attention_factor=0\.8.*compressed layers' rope only.*set it to 1"):
        parse_v4_config(hf_spelling(compress={**compress, "attention_factor": 0.8}))
    main = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match=r"rope_parameters.main has rope_type 'yarn'.*plain rope"):
        parse_v4_config(hf_spelling(main=main))
    legacy = {k: v for k, v in hf_spelling().items() if k != "rope_parameters"}
    with pytest.raises(ValueError, match="attention_factor=2"):
        parse_v4_config({**legacy, "rope_scaling": {**compress, "attention_factor": 2}})


def test_bad_compress_ratio_is_a_clear_error() -> None:
    from tests.model.dsv4_reference import RefConfig

    bad = {**RefConfig().native_config(), "compress_ratios": [0, 8, 128, 4, 0]}
    with pytest.raises(ValueError, match=r"compress ratios must be in \(0, 4, 128\), got \[8\]"):
        parse_v4_config(bad)


def test_v4_model_defaults_to_dsv4_and_rejects_other_backends() -> None:
    assert REGISTRY["dsv4"].attention_kinds == {"dsv4"} and "dsv4" not in REGISTRY["torch_native"].attention_kinds
    resolved = resolve_config(EngineConfig.from_flat(model=str(SLICE), device="cpu"))
    assert (attention_backends(resolved).prefill, attention_backends(resolved).decode) == ("dsv4", "dsv4")
    for flags in ({"attention_backend": "torch_native"}, {"decode_attention_backend": "torch_native"},
                  {"prefill_attention_backend": "torch_native", "decode_attention_backend": "dsv4"}):
        with pytest.raises(ValueError, match="cannot serve this model's attention, DeepSeek-V4's .*; use one of: dsv4$"):
            resolve_config(EngineConfig.from_flat(model=str(SLICE), device="cpu", **flags))


def test_dsv4_backend_for_another_model_is_an_error() -> None:
    with pytest.raises(ValueError, match="'dsv4' .* cannot serve this model's attention, per-head K/V .* it serves DeepSeek-V4's"):
        resolve_config(EngineConfig.from_flat(model="demo", device="cpu", decode_attention_backend="dsv4"))


def test_page_size_defaults_to_the_kv_block_ratio_for_v4_and_1_otherwise(caplog) -> None:
    with caplog.at_level("INFO", logger="kestrel.config_resolve"):
        v4 = resolve_config(EngineConfig.from_flat(model=str(SLICE), device="cpu"))
    assert v4.cache.page_size == 128 and "page_size 128" in caplog.text
    assert resolve_config(EngineConfig.from_flat(model=str(SLICE), device="cpu", page_size=256)).cache.page_size \
        == 256
    assert resolve_config(EngineConfig.from_flat(model="demo", device="cpu")).cache.page_size == 1
    with pytest.raises(ValueError, match="page_size must be a multiple of 128 .* got 64; use --page-size 128"):
        resolve_config(EngineConfig.from_flat(model=str(SLICE), device="cpu", page_size=64))
