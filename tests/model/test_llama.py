"""Llama-family models against transformers as the oracle, through the torch_native backend."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kestrel.core.forward_mode import ForwardMode
from kestrel.models.arch_config import parse_arch_config
from kestrel.models.loader import load_model, read_arch_config
from kestrel.models.registry import model_class
from tests.model.harness import Harness
from tests.tiny_models import make_tiny_model

PROMPT_LENS = (5, 11, 17)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CASES = {
    "llama": ("llama", {}),
    "mistral_sliding": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "llama_tied": ("llama", dict(tie=True)),
    "llama3_rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama_sharded": ("llama", dict(max_shard_size="40KB")),
    "mistral_attention_bias_ignored": ("mistral", dict(attention_bias=True)),  # Mistral's attention has none
    # MoE families: the Llama decoder with MoE layers (kestrel/models/llama_moe.py).
    "qwen3_moe": ("qwen3_moe", {}),  # renormalised top-2 of 8
    "qwen3_moe_dense_layer": ("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=False, num_experts_per_tok=3)),
    "qwen2_moe": ("qwen2_moe", {}),  # gated shared expert, q/k/v bias
    "mixtral_sliding": ("mixtral", {}),  # window 8 on every layer
    "mixtral_top1_of_8": ("mixtral", dict(sliding_window=None, num_local_experts=8, num_experts_per_tok=1)),
}


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()


def _hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_then_decode_matches_transformers(case: str, tmp_path: Path) -> None:
    arch, overrides = CASES[case]
    path = make_tiny_model(arch, tmp_path, **overrides)
    if "max_shard_size" in overrides:
        assert (path / "model.safetensors.index.json").is_file()
    model, hf = load_model(path, torch.float32, "cpu"), _hf(path)
    prompts = _prompts(model.config.vocab_size)
    harness = Harness(model, len(prompts))

    prefill = harness.step(prompts)
    for prompt, logits in zip(prompts, prefill):
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)

    next_tokens = [[int(logits[-1].argmax())] for logits in prefill]  # greedy continuation
    for prompt, tok, logits in zip(prompts, next_tokens, harness.step(next_tokens, ForwardMode.DECODE)):
        torch.testing.assert_close(logits[0], _hf_logits(hf, prompt + tok)[-1], atol=1e-4, rtol=1e-4)


def _edited_config_matches_transformers(path: Path, edit) -> torch.nn.Module:
    """Rewrite the checkpoint's config.json with `edit`, then compare prefill logits with transformers'."""
    import json

    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    model, hf = load_model(path, torch.float32, "cpu"), _hf(path)
    prompts = _prompts(model.config.vocab_size, seed=3)
    for prompt, logits in zip(prompts, Harness(model, len(prompts)).step(prompts)):
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)
    return model


def test_keys_a_config_leaves_out_take_transformers_defaults_for_its_architecture(tmp_path: Path) -> None:
    """Mixtral's config class defaults rope theta to 1e6 and the norms' epsilon to 1e-5 (not 1e4 / 1e-6)."""
    def drop(config: dict) -> None:
        for key in ("rope_parameters", "rope_theta", "rope_scaling", "rms_norm_eps"):
            config.pop(key, None)

    model = _edited_config_matches_transformers(make_tiny_model("mixtral", tmp_path, rope_theta=1e6,
                                                                rms_norm_eps=1e-5), drop)
    assert model.config.rope.theta == 1e6 and model.config.rms_norm_eps == 1e-5


def test_a_top_level_original_max_position_embeddings_wins_over_the_rope_section(tmp_path: Path) -> None:
    """As transformers reads it (Phi-3 style configs): yarn over 16 original positions, not the section's 64."""
    def outer(config: dict) -> None:
        config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64}
        config["original_max_position_embeddings"] = 16

    model = _edited_config_matches_transformers(make_tiny_model("llama", tmp_path), outer)
    assert model.config.rope.original_max_position_embeddings == 16


@pytest.mark.parametrize("arch", ["mistral", "mixtral", "qwen2_moe"])
def test_chunked_prefill_matches_whole_prefill(arch: str, tmp_path: Path) -> None:
    # Mistral's and Mixtral's window (8) is shorter than the prompts, so the second chunk must respect it
    # across the split; a MoE layer routes each token alone whatever chunk it comes in.
    model = load_model(make_tiny_model(arch, tmp_path), torch.float32, "cpu")
    prompts = _prompts(model.config.vocab_size, seed=2)
    whole = Harness(model, len(prompts)).step(prompts)
    chunked = Harness(model, len(prompts))
    cut = [2, 4, 9]
    first = chunked.step([p[:c] for p, c in zip(prompts, cut)])
    second = chunked.step([p[c:] for p, c in zip(prompts, cut)])
    for w, a, b in zip(whole, first, second):
        torch.testing.assert_close(torch.cat([a, b]), w, atol=1e-5, rtol=1e-5)


def test_bf16_checkpoint_loads_as_float32(tmp_path: Path) -> None:
    path = make_tiny_model("qwen3", tmp_path, dtype="bfloat16")
    model, hf = load_model(path, torch.float32, "cpu"), _hf(path)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    prompts = _prompts(model.config.vocab_size)
    for prompt, logits in zip(prompts, Harness(model, len(prompts)).step(prompts)):
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 1e-2), (torch.bfloat16, 8e-2)])
def test_float32_checkpoint_loads_cast(dtype: torch.dtype, atol: float, tmp_path: Path) -> None:
    # transformers in the same dtype is the oracle; the tolerance is that dtype's rounding over 2 layers.
    path = make_tiny_model("llama", tmp_path)
    model, hf = load_model(path, dtype, "cpu"), _hf(path, dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    prompts = _prompts(model.config.vocab_size)
    for prompt, logits in zip(prompts, Harness(model, len(prompts)).step(prompts)):
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=atol, rtol=0)


def test_loader_ignores_harmless_tensors_and_reports_mismatches(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path, tie=True)
    tensors = load_file(path / "model.safetensors")
    extra = {"lm_head.weight": tensors["model.embed_tokens.weight"].clone(),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    save_file({**tensors, **extra}, path / "model.safetensors")
    load_model(path, torch.float32, "cpu")

    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.ones(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unexpected \['model.layers.0.mlp.extra"):
        load_model(path, torch.float32, "cpu")

    # A projection that the model merges (k_proj into qkv_proj) is reported by shard.
    tensors["model.norm.weight"] = torch.ones(tensors["model.layers.0.input_layernorm.weight"].shape)
    del tensors["model.layers.0.mlp.extra.weight"], tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.qkv_proj.weight#1'\], unexpected \[\]"):
        load_model(path, torch.float32, "cpu")


def test_dummy_load_format_needs_only_a_config(tmp_path: Path) -> None:
    path = make_tiny_model("qwen3", tmp_path)
    (path / "model.safetensors").unlink()
    model = load_model(path, torch.float32, "cpu", load_format="dummy")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match="load_format"):
        load_model(path, torch.float32, "cpu", load_format="pt")


def test_read_arch_config_sizes_the_cache(tmp_path: Path) -> None:
    cfg = read_arch_config(make_tiny_model("qwen3", tmp_path))
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (2, 2, 32, 512)
    assert cfg.eos_token_ids == (1,) and cfg.qk_norm and not cfg.qkv_bias


def _config(arch: str = "LlamaForCausalLM", **extra: object) -> dict:
    return dict(architectures=[arch], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=32, **extra)


def test_transformers4_and_5_rope_formats_parse_alike() -> None:
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    v4 = parse_arch_config(_config(rope_theta=10000.0, rope_scaling={**scaling, "type": scaling.pop("rope_type")}))
    v5 = parse_arch_config(_config(rope_parameters=LLAMA3_ROPE))
    assert v4.rope == v5.rope and v5.rope.rope_type == "llama3" and v5.rope.factor == 8.0


def test_unsupported_configs_raise() -> None:
    with pytest.raises(ValueError, match="'longrope'.*default, linear, llama3, yarn"):
        model_class(["LlamaForCausalLM"])(parse_arch_config(_config(rope_parameters={"rope_type": "longrope"})))
    with pytest.raises(ValueError, match="gelu"):
        parse_arch_config(_config(hidden_act="gelu"))
    parse_arch_config(_config(hidden_act="swish"))  # transformers' other name for silu
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        model_class(["GPT2LMHeadModel"])


def test_sliding_windows_follow_transformers() -> None:
    qwen = dict(arch="Qwen2ForCausalLM", sliding_window=6, max_window_layers=1)
    assert parse_arch_config(_config(**qwen)).sliding_windows == (None, None)
    assert parse_arch_config(_config(**qwen, use_sliding_window=True)).sliding_windows == (None, 6)
    assert parse_arch_config(_config("MistralForCausalLM", sliding_window=6)).sliding_windows == (6, 6)
    assert parse_arch_config(_config(sliding_window=6)).sliding_windows == (None, None)
