"""EngineConfig resolution and the attention resolver."""
from __future__ import annotations

import json

import pytest

from kestrel.attention import registry
from kestrel.attention.registry import attention_backends
from kestrel.config import EngineConfig


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                     "max_position_embeddings": 128}))
    return str(tmp_path)


def resolve(model_dir, **kw) -> EngineConfig:
    return EngineConfig.from_flat(model=model_dir, device="cpu", **kw).resolve()


def test_resolve_fills_every_automatic_choice(model_dir):
    c = resolve(model_dir)
    assert c.resolved and c.device == "cpu" and c.model.dtype == "float32"
    assert c.model.context_length == 128 and c.cache.max_total_tokens == 32768
    assert c.scheduler.chunked_prefill_size > 0 and c.scheduler.max_running_requests > 0
    assert c.attention.attention_backend is None  # the base stays an input, never filled in


@pytest.mark.parametrize("fields, expected", [
    ({}, ("torch_native", "torch_native")), ({"attention_backend": "sdpa"}, ("sdpa", "sdpa")),
    ({"prefill_attention_backend": "sdpa"}, ("sdpa", "torch_native")),
    ({"decode_attention_backend": "torch_native"}, ("torch_native", "torch_native")),
    ({"attention_backend": "reference"}, ("torch_native", "torch_native"))])
def test_resolver_never_returns_none_and_maps_aliases(model_dir, monkeypatch, fields, expected):
    monkeypatch.setitem(registry.ALIASES, "reference", "torch_native")  # kestrel has no alias today
    pair = attention_backends(resolve(model_dir, **fields))
    assert (pair.prefill, pair.decode) == expected


@pytest.mark.parametrize("bad, field", [
    ({"dtype": "float8"}, "dtype"), ({"page_size": 0}, "page_size"), ({"max_total_tokens": 0}, "max_total_tokens"),
    ({"chunked_prefill_size": 0}, "chunked_prefill_size"), ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ({"max_running_requests": 0}, "max_running_requests"), ({"speculative_attention_mode": "both"},
                                                            "speculative_attention_mode"),
    ({"triton_decode_split": "ragged"}, "triton_decode_split"),
])
def test_bad_values_name_the_field(model_dir, bad, field):
    with pytest.raises(ValueError, match=field):
        resolve(model_dir, **bad)


def test_device_cuda_without_a_gpu_is_a_clear_error(model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="CUDA is not available"):
        EngineConfig.from_flat(model=model_dir, device="cuda").resolve()


def test_a_context_length_past_the_models_positions_is_refused_naming_both(model_dir, monkeypatch):
    monkeypatch.delenv("KESTREL_ALLOW_LONG_CONTEXT", raising=False)
    assert resolve(model_dir, context_length=100).model.context_length == 100
    with pytest.raises(ValueError, match=r"context_length=4096 is longer than the model's 128 positions "
                                         r"\(max_position_embeddings.*rope is not scaled.*<= 128"):
        resolve(model_dir, context_length=4096)
    monkeypatch.setenv("KESTREL_ALLOW_LONG_CONTEXT", "1")  # a plain rope stays refused
    with pytest.raises(ValueError, match="rope is not scaled"):
        resolve(model_dir, context_length=4096)


def test_a_scaled_rope_runs_past_its_positions_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("KESTREL_ALLOW_LONG_CONTEXT", raising=False)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                     "max_position_embeddings": 128, "rope_scaling": rope}))
    with pytest.raises(ValueError, match=r"longer than the model's 128 positions.*KESTREL_ALLOW_LONG_CONTEXT=1"):
        resolve(str(tmp_path), context_length=512)
    monkeypatch.setenv("KESTREL_ALLOW_LONG_CONTEXT", "1")
    c = resolve(str(tmp_path), context_length=512)
    hf = c.model.hf_config
    # The model builds its rope tables for 512 positions; the llama3 scaling keeps its original 128.
    assert c.model.context_length == hf["max_position_embeddings"] == 512
    assert hf["rope_scaling"] == {**rope, "original_max_position_embeddings": 128}
