"""Which backends serve an MLA model: the resolver's fit rule for each half and for the draft, the
factories' MLA forms and their stamps, and `kestrel explain` (docs/design/attention-backends.md §7)."""
from __future__ import annotations

import json

import pytest
import torch

from kestrel.attention import registry
from kestrel.attention.mla.torch_native import TorchNativeMLABackend
from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.cache.kv_layout import KVLayout
from kestrel.cache.kv_memory import KVPools
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.cli import main
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "vocab_size": 512,
      "max_position_embeddings": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 32,
      "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "num_nextn_predict_layers": 1}


@pytest.fixture
def v3(tmp_path):
    (tmp_path / "v3").mkdir()
    (tmp_path / "v3" / "config.json").write_text(json.dumps(V3))
    return str(tmp_path / "v3")


def resolve(model: str, **fields) -> EngineConfig:
    return resolve_config(EngineConfig.from_flat(model=model, device="cpu", **fields))


def test_kinds_are_honest():
    kinds = {name: entry.attention_kinds for name, entry in registry.REGISTRY.items()}
    assert kinds["torch_native"] >= {"mha", "mla"} and kinds["sdpa"] == {"mha"} and kinds["dsv4"] == {"dsv4"}


def test_mla_model_defaults_to_an_mla_backend_and_each_half_is_checked(v3):
    pair = resolve(v3).attention.backends
    assert (pair.prefill, pair.decode) == ("torch_native", "torch_native")
    for flags, field in (({"attention_backend": "sdpa"}, "attention_backend"),
                         ({"prefill_attention_backend": "sdpa"}, "prefill_attention_backend"),
                         ({"decode_attention_backend": "dsv4"}, "decode_attention_backend")):
        with pytest.raises(ValueError, match=rf"\(from {field}\) cannot serve this model's attention, Multi-head "
                                             r"Latent Attention .*; use one of: torch_native"):
            resolve(v3, **flags)


def test_mha_model_refuses_a_backend_that_serves_only_mla(monkeypatch):
    entry = registry.REGISTRY["torch_native"]
    monkeypatch.setitem(registry.REGISTRY, "mla_only", registry.BackendEntry(
        entry.factory, entry.unavailable, attention_kinds=frozenset({"mla"})))
    with pytest.raises(ValueError, match=r"'mla_only' \(from decode_attention_backend\) cannot serve this model's "
                                         r"attention, per-head K/V .*: it serves Multi-head Latent Attention"):
        resolve("demo", decode_attention_backend="mla_only")


def test_factories_build_the_form_the_pools_call_for():
    table = ReqToTokenPool(2, 8, "cpu")
    latent = KVPools(KVLayout.latent_attention(1, 32, 8, torch.float32), 16, 3, "cpu")
    per_head = KVPools(KVLayout.full_attention(1, 1, 8, torch.float32), 16, 3, "cpu")
    config = EngineConfig.from_flat(model="demo", device="cpu")
    mla = registry.create_backend("torch_native", latent, table, config)
    mha = registry.create_backend("torch_native", per_head, table, config)
    assert isinstance(mla, TorchNativeMLABackend) and isinstance(mha, TorchNativeBackend)
    assert mla.name == mha.name == "torch_native"


def test_explain_shows_the_attention_kind_and_the_refusal(v3, capsys):
    assert main(["explain", "--model", v3, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "attention kind: mla (Multi-head Latent Attention" in out
    assert "prefill  torch_native" in out and "decode   torch_native" in out
