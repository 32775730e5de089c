"""The draft-backend factory: which half each product comes from, the override, stamps on every product
and child, refusals at start-up, and `kestrel explain`."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kestrel.attention import registry
from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.cache.kv_layout import KVLayout
from kestrel.cli import main
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.speculative.draft_backends import create_draft_backends, draft_backend_plan

# Opaque but for the layout, which the factories read (its form: MHA here); handed to the backends untouched.
POOLS, REQ_TO_TOKEN = SimpleNamespace(layout=KVLayout.full_attention(1, 1, 8, torch.float32)), object()


@pytest.fixture
def dirs(tmp_path):
    def folder(name, **config):
        (tmp_path / name).mkdir()
        base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 512,
                "max_position_embeddings": 128}
        (tmp_path / name / "config.json").write_text(json.dumps({**base, **config}))
        return str(tmp_path / name)

    return {"target": folder("target"), "eagle": folder("eagle", num_hidden_layers=1)}


@pytest.fixture
def test_backends():
    """Entries that behave like real ones: one that builds another backend than its key says (a
    fallback), one that cannot serve draft decode, one that cannot serve draft extend."""
    def build(pools, req_to_token, config):
        return "torch_native", TorchNativeBackend(pools, req_to_token, name="torch_native")

    registry.register("fallback", unavailable=lambda c: None)(build)
    registry.register("no_draft_decode", unavailable=lambda c: None, draft_modes=frozenset({"extend"}))(build)
    registry.register("no_draft_extend", unavailable=lambda c: None, draft_modes=frozenset({"decode"}))(build)
    yield
    for name in ("fallback", "no_draft_decode", "no_draft_extend"):
        del registry.REGISTRY[name]


def config(dirs, algorithm="EAGLE", **kw) -> EngineConfig:
    draft = {"speculative_draft_model_path": dirs["eagle"]} if algorithm == "EAGLE" else {}
    return resolve_config(EngineConfig.from_flat(model=dirs["target"], device="cpu",
                                                 speculative_algorithm=algorithm, **draft, **kw))


def stamps(backends) -> tuple[str | None, list[str], str]:
    decode = backends.decode
    return (decode.name if decode else None, [c.name for c in decode.attn_backends] if decode else [],
            backends.extend.name)


def test_one_draft_decode_backend_per_draft_forward_and_the_pools_pass_through(dirs):
    backends = create_draft_backends(config(dirs), POOLS, REQ_TO_TOKEN)  # EAGLE on Llama: 5 steps
    assert stamps(backends) == ("torch_native", ["torch_native"] * 4, "torch_native")
    children = backends.decode.attn_backends
    assert len({id(c) for c in children}) == 4 and len(backends.decode) == 4  # each step its own metadata
    assert all(c.pools is POOLS and c.req_to_token is REQ_TO_TOKEN for c in [*children, backends.extend])


def test_halves_follow_the_target_pair_and_the_attention_mode(dirs):
    split = dict(prefill_attention_backend="triton", decode_attention_backend="torch_native")
    plan = draft_backend_plan(config(dirs, **split))
    assert (plan.decode, plan.extend) == ("torch_native", "triton")
    assert plan.extend_source == "the target's prefill half (speculative_attention_mode=prefill)"
    backends = create_draft_backends(config(dirs, **split), POOLS, REQ_TO_TOKEN)
    assert stamps(backends) == ("torch_native", ["torch_native"] * 4, "triton")
    plan = draft_backend_plan(config(dirs, speculative_attention_mode="decode", **split))
    assert (plan.decode, plan.extend) == ("torch_native", "torch_native")


def test_the_override_wins_and_every_stamp_is_canonical(dirs, test_backends):
    split = dict(prefill_attention_backend="triton", decode_attention_backend="triton")
    plan = draft_backend_plan(config(dirs, speculative_draft_attention_backend="sdpa", **split))
    assert (plan.decode, plan.extend) == ("sdpa", "sdpa")
    assert plan.decode_source == plan.extend_source == "from --speculative-draft-attention-backend 'sdpa'"
    # An entry that builds another backend than its key: products and children carry what they are.
    backends = create_draft_backends(config(dirs, speculative_draft_attention_backend="fallback", **split),
                                     POOLS, REQ_TO_TOKEN)
    assert stamps(backends) == ("torch_native", ["torch_native"] * 4, "torch_native")


def test_a_single_draft_step_needs_no_decode_container(dirs):
    shape = dict(speculative_num_steps=1, speculative_eagle_topk=4, speculative_num_draft_tokens=5)
    backends = create_draft_backends(config(dirs, **shape), POOLS, REQ_TO_TOKEN)
    assert backends.decode is None and backends.extend.name == "torch_native"


def test_backends_that_cannot_serve_a_draft_mode_are_refused_at_start_up(dirs, test_backends):
    with pytest.raises(ValueError, match="EAGLE is not supported in decode attention backend no_draft_decode; "
                                         "backends that serve draft decode: .*torch_native, triton"):
        config(dirs, decode_attention_backend="no_draft_decode")
    with pytest.raises(ValueError, match="EAGLE is not supported in draft-extend attention backend no_draft_extend"):
        config(dirs, prefill_attention_backend="no_draft_extend")
    with pytest.raises(ValueError, match="not supported in decode attention backend no_draft_decode"):
        config(dirs, speculative_draft_attention_backend="no_draft_decode")
    # Not needed, not refused: one draft step builds no decode container.
    config(dirs, decode_attention_backend="no_draft_decode", speculative_num_steps=1, speculative_eagle_topk=1,
           speculative_num_draft_tokens=2)
    # Without speculation the backend is fine.
    resolve_config(EngineConfig.from_flat(model=dirs["target"], device="cpu",
                                          decode_attention_backend="no_draft_decode"))


def test_ngram_has_no_draft_backends(dirs):
    cfg = config(dirs, algorithm="NGRAM")
    assert draft_backend_plan(cfg) is None
    with pytest.raises(ValueError, match="NGRAM runs no draft model"):
        create_draft_backends(cfg, POOLS, REQ_TO_TOKEN)


def test_explain_shows_the_draft_backends(dirs, capsys):
    assert main(["explain", "--model", dirs["target"], "--device", "cpu", "--speculative-algorithm", "EAGLE",
                 "--speculative-draft-model-path", dirs["eagle"], "--prefill-attention-backend", "triton"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: EAGLE  steps 5, topk 4, draft tokens 8; off above 32 running requests" in out
    assert f"draft model: {dirs['eagle']}" in out
    assert "draft decode   torch_native   x4 (one per draft step), the target's decode half" in out
    assert "draft extend   triton         the target's prefill half (speculative_attention_mode=prefill)" in out
    assert main(["explain", "--model", dirs["target"], "--device", "cpu", "--speculative-algorithm", "NGRAM"]) == 0
    assert "draft backends: none (NGRAM" in capsys.readouterr().out
    assert main(["explain", "--model", dirs["target"], "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding" not in out
    assert "[off] speculative_algorithm set x prompt_logprobs" in out


@pytest.fixture
def v4(tmp_path):
    """A DeepSeek-V4 folder (config only: nothing here loads weights) with one MTP layer."""
    from tests.model.dsv4_reference import RefConfig

    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "config.json").write_text(json.dumps(RefConfig().native_config()))
    return str(tmp_path / "v4")


def test_nextn_on_deepseek_v4_drafts_on_dsv4_and_refuses_other_backends(v4, capsys):
    cfg = resolve_config(EngineConfig.from_flat(model=v4, device="cpu", speculative_algorithm="NEXTN"))
    assert cfg.speculative.speculative_draft_model_path == v4
    backends = create_draft_backends(cfg, POOLS, REQ_TO_TOKEN)  # 3 steps: 2 lane forwards after the extend
    assert stamps(backends) == ("dsv4", ["dsv4"] * 2, "dsv4")
    assert main(["explain", "--model", v4, "--device", "cpu", "--speculative-algorithm", "NEXTN"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: NEXTN  steps 3, topk 1, draft tokens 4" in out
    assert f"draft model: {v4}" in out
    assert "draft decode   dsv4           x2 (one per draft step), the target's decode half" in out
    assert "draft extend   dsv4           the target's prefill half" in out
    with pytest.raises(ValueError, match="attention backend 'torch_native' .from speculative_draft_attention_backend. "
                                         "cannot serve this model's attention, DeepSeek-V4's .*; use one of: dsv4$"):
        resolve_config(EngineConfig.from_flat(model=v4, device="cpu", speculative_algorithm="NEXTN",
                                              speculative_draft_attention_backend="torch_native"))
