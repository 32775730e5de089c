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


# ---- split halves and draft backends -------------------------------------------------------------
def latent_pools() -> tuple[KVPools, ReqToTokenPool]:
    return KVPools(KVLayout.latent_attention(1, 32, 8, torch.float32), 16, 3, "cpu"), ReqToTokenPool(2, 8, "cpu")


def test_split_halves_resolve_and_each_decision_reads_its_half(v3, monkeypatch):
    from kestrel.attention.decisions import cuda_graph_backends, extend_prefix_reuse, shared_triton_kernel

    cfg = resolve(v3, prefill_attention_backend="triton", decode_attention_backend="torch_native")
    assert (cfg.attention.backends.prefill, cfg.attention.backends.decode) == ("triton", "torch_native")
    assert cuda_graph_backends(cfg) == ["torch_native"] and not shared_triton_kernel(cfg)
    # An MLA-capable prefill half without prefix reuse turns radix reuse off; the decode half never does.
    entry = registry.REGISTRY["torch_native"]
    monkeypatch.setitem(registry.REGISTRY, "no_prefix_mla", registry.BackendEntry(
        entry.factory, entry.unavailable, extend_prefix=False, attention_kinds=frozenset({"mla"})))
    assert not extend_prefix_reuse(resolve(v3, prefill_attention_backend="no_prefix_mla",
                                           decode_attention_backend="torch_native"))
    assert extend_prefix_reuse(resolve(v3, prefill_attention_backend="torch_native",
                                       decode_attention_backend="no_prefix_mla"))


def test_a_hybrid_routes_each_mode_to_its_mla_half():
    from kestrel.attention.hybrid import HybridBackend
    from kestrel.attention.mla.base import mla_backend
    from kestrel.attention.mla.triton_backend import TritonMLABackend
    from kestrel.core.forward_mode import ForwardMode
    from tests.unit.mla_cases import make_case

    case = make_case([3, 5], [1, 1], page_size=1)
    prefill = TritonMLABackend(case.pools, case.req_to_token, upcast=True)
    decode = TorchNativeMLABackend(case.pools, case.req_to_token, name="torch_native")
    case.batch.attn_backend = HybridBackend(prefill, decode, "prefill")
    assert case.batch.attn_backend.name == "hybrid(prefill=triton,decode=torch_native)"
    assert mla_backend(case.batch) is decode
    case.batch.forward_mode = ForwardMode.TARGET_VERIFY
    assert mla_backend(case.batch) is prefill
    case.batch.attn_backend = TorchNativeBackend(case.pools, case.req_to_token)
    with pytest.raises(TypeError, match="needs an MLA backend, got 'torch_native'"):
        mla_backend(case.batch)


@pytest.fixture
def nextn_on_v3(monkeypatch):
    """NEXTN's own rule admits only targets whose MTP layer kestrel runs; V3's comes with its model."""
    from kestrel.speculative import resolve as spec_resolve

    monkeypatch.setattr(spec_resolve, "_dsv4_target", lambda target_hf: True)


def test_nextn_on_an_mla_model_drafts_on_mla_backends_with_honest_stamps(v3, capsys, nextn_on_v3):
    from kestrel.attention.mla.triton_backend import TritonMLABackend
    from kestrel.speculative.draft_backends import create_draft_backends, draft_backend_plan

    cfg = resolve(v3, speculative_algorithm="NEXTN", prefill_attention_backend="triton",
                  decode_attention_backend="torch_native")
    plan = draft_backend_plan(cfg)
    assert (plan.decode, plan.extend) == ("torch_native", "triton")
    pools, table = latent_pools()
    backends = create_draft_backends(cfg, pools, table)
    children = backends.decode.attn_backends
    assert backends.decode.name == "torch_native" and len(children) == plan.decode_steps
    assert all(isinstance(c, TorchNativeMLABackend) and c.name == "torch_native" for c in children)
    assert isinstance(backends.extend, TritonMLABackend) and backends.extend.name == "triton"
    assert main(["explain", "--model", v3, "--device", "cpu", "--speculative-algorithm", "NEXTN",
                 "--prefill-attention-backend", "triton", "--decode-attention-backend", "torch_native"]) == 0
    out = capsys.readouterr().out
    assert f"draft decode   torch_native   x{plan.decode_steps} (one per draft step), the target's decode half" in out
    assert "draft extend   triton         the target's prefill half" in out


def test_the_draft_override_must_serve_the_drafts_attention(v3, tmp_path, nextn_on_v3):
    with pytest.raises(ValueError, match=r"'sdpa' \(from speculative_draft_attention_backend\) cannot serve this "
                                         r"model's attention, Multi-head Latent Attention"):
        resolve(v3, speculative_algorithm="NEXTN", speculative_draft_attention_backend="sdpa")
    # A STANDALONE draft with per-head K/V beside an MLA target: its own kind decides.
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 512, "max_position_embeddings": 128}))
    cfg = resolve(v3, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tmp_path / "draft"),
                  speculative_draft_attention_backend="sdpa")
    assert registry.draft_attention_backends(cfg).decode == "sdpa"
