"""gpt-oss through the engine: greedy tokens against transformers on every backend that serves sinks
(torch_native, Triton under the interpreter, sdpa), chunked prefill across the window, radix reuse
refused (the window layers keep rings), the backend rule, and the real configs resolving with
--load-format dummy."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kestrel import Engine, SamplingParams
from kestrel.attention import registry
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.models.gpt_oss.config import parse_gpt_oss_config
from kestrel.hf_config import read_hf_config
from tests.e2e.conftest import assert_pool_full
from tests.model.gpt_oss_tiny import WINDOW, make_gpt_oss

CONFIGS = Path(__file__).parents[2] / "kestrel/assets/configs"
NEW_TOKENS = 2 * WINDOW + 2  # decode crosses several window boundaries


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss_engine"), seed=3)


@pytest.fixture(scope="module")
def prompts_and_expected(tiny: Path):
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 13)]
    prompts.append(prompts[1][:9] + [7, 8])  # shares a prefix with the second: a radix hit
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    return prompts, expected


@pytest.mark.parametrize("backend, rings", [("torch_native", True), ("sdpa", True), ("torch_native", False),
                                           ("sdpa", False)])
def test_greedy_matches_transformers(tiny, prompts_and_expected, backend, rings):
    prompts, expected = prompts_and_expected
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with Engine(model=str(tiny), device="cpu", dtype="float32", attention_backend=backend, chunked_prefill_size=8,
                page_size=1, disable_window_rings=not rings) as engine:
        cold = engine.generate(prompt_token_ids=prompts[:2], sampling_params=params)
        again = engine.generate(prompt_token_ids=prompts[1:], sampling_params=params)  # shared prefixes
        assert [o.token_ids for o in cold] == expected[:2]
        assert [o.token_ids for o in again] == expected[1:]
        assert engine.kv_memory.pools[0].layout.has_rings == rings
        # The window rings keep no prefix's window keys: radix reuse is off (docs/design/window-rings.md);
        # full K/V in the window layers (--disable-window-rings) keeps it.
        assert engine.config.cache.disable_radix_cache == rings
        assert (again[0].meta["cached_tokens"] > 0 and again[1].meta["cached_tokens"] > 0) != rings
        assert_pool_full(engine)


@pytest.mark.parametrize("topk", [1, 2])
def test_speculative_trees_over_rings_are_refused(tiny, topk):
    with pytest.raises(ValueError, match="speculative trees .* cannot run over this model's sliding-window rings"):
        Engine(model=str(tiny), device="cpu", dtype="float32", speculative_algorithm="NGRAM", speculative_num_steps=3,
               speculative_eagle_topk=topk, speculative_num_draft_tokens=6)


@pytest.mark.parametrize("backend, rings, spec", [
    ("torch_native", True, dict(speculative_algorithm="STANDALONE", speculative_eagle_topk=1)),
    ("torch_native", False, dict(speculative_algorithm="STANDALONE", speculative_eagle_topk=2)),
    ("torch_native", False, dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2)),
    ("triton", False, dict(speculative_algorithm="STANDALONE", speculative_eagle_topk=2))])
def test_speculative_greedy_across_windows_equals_plain_greedy(tiny, prompts_and_expected, backend, rings, spec):
    """Chains over rings; trees over full K/V, where a node at depth d of a verify sits at prefix + d and its
    window counts from there, not from its index in the tree. The model drafts for itself (STANDALONE):
    every draft is accepted, so verify rounds cross the window boundaries."""
    prompts, expected = prompts_and_expected
    steps = NEW_TOKENS if backend == "torch_native" else WINDOW + 3
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    draft = dict(speculative_draft_model_path=str(tiny)) if spec["speculative_algorithm"] == "STANDALONE" else {}
    with Engine(model=str(tiny), device="cpu", dtype="float32", attention_backend=backend, page_size=1,
                disable_window_rings=not rings, speculative_num_steps=3,
                speculative_num_draft_tokens=4 if spec["speculative_eagle_topk"] == 1 else 6, **spec, **draft) as engine:
        n = 2 if backend == "torch_native" else 1  # the Triton interpreter is slow
        outs = engine.generate(prompt_token_ids=prompts[:n], sampling_params=params)
        assert [o.token_ids for o in outs] == [e[:steps] for e in expected[:n]]
        assert sum(o.meta.get("spec_verify_ct", 0) for o in outs) > 0


def test_triton_greedy_matches_transformers(tiny, prompts_and_expected):
    """The Triton extend (chunked, split over keys) and decode kernels with sinks and windows, under the
    interpreter: fewer steps, each costs seconds there."""
    pytest.importorskip("triton")
    prompts, expected = prompts_and_expected
    steps = WINDOW + 2
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    with Engine(model=str(tiny), device="cpu", dtype="float32", attention_backend="triton", chunked_prefill_size=8,
                page_size=1) as engine:
        outs = engine.generate(prompt_token_ids=prompts[:2], sampling_params=params)
        assert [o.token_ids for o in outs] == [e[:steps] for e in expected[:2]]


def test_backend_without_sinks_is_refused(tiny, monkeypatch):
    entry = registry.REGISTRY["torch_native"]
    monkeypatch.setitem(registry.REGISTRY, "no_sinks", dataclasses.replace(entry, attention_sinks=False))
    with pytest.raises(ValueError, match="'no_sinks'.*cannot serve attention sinks.*torch_native"):
        resolve_config(EngineConfig.from_flat(model=str(tiny), device="cpu", decode_attention_backend="no_sinks"))


@pytest.mark.parametrize("name, layers, experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_real_configs_resolve_for_dummy_loading(name, layers, experts):
    """The config-only folders parse to the published shapes and resolve as a dummy-format launch (the
    MXFP4 quantization_config included), without building the model."""
    folder = CONFIGS / name
    cfg = parse_gpt_oss_config(read_hf_config(str(folder)))
    assert (cfg.num_hidden_layers, cfg.moe.num_experts, cfg.moe.router.top_k) == (layers, experts, 4)
    assert cfg.sliding_windows[:2] == (128, None) and cfg.mxfp4 and cfg.rope.rope_type == "yarn"
    assert cfg.num_attention_heads * cfg.head_dim == 4096 != cfg.hidden_size
    resolved = resolve_config(EngineConfig.from_flat(model=str(folder), device="cpu", load_format="dummy",
                                                       max_total_tokens=256))
    assert resolved.model.quantization is None


def test_window_layers_are_rings_in_the_layout_and_the_pool(monkeypatch):
    """gpt-oss-20b's layout: its 12 window layers hold per-request rings, so a token costs the 12 full
    layers' K/V only (half of full K/V everywhere), and the same free memory holds about twice the tokens."""
    from kestrel.cache.kv_layout import KVLayout, window_ring_length
    from kestrel.cache.kv_memory import pool_size
    from kestrel.config import CacheConfig

    cfg = parse_gpt_oss_config(read_hf_config(str(CONFIGS / "gpt-oss-20b")))
    kv_heads, head_dim, bf16 = cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16
    rings = KVLayout.windowed_attention(cfg.sliding_windows, kv_heads, head_dim, bf16, step_tokens=4)
    full = KVLayout.full_attention(cfg.num_hidden_layers, kv_heads, head_dim, bf16)
    entry = 2 * kv_heads * head_dim * 2  # K and V in bf16
    assert full.bytes_per_token == 24 * entry and rings.bytes_per_token == 12 * entry
    assert window_ring_length(128, 4) == 255 and rings.bytes_per_request == 12 * 255 * entry
    assert rings.prefix_cache_unsupported and full.prefix_cache_unsupported is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * 2**30, 80 * 2**30))
    cache = CacheConfig(mem_fraction_static=0.9, page_size=16)
    grown = pool_size(cache, [rings], 64, torch.device("cuda")) / pool_size(cache, [full], 64, torch.device("cuda"))
    assert 1.95 < grown < 2.0  # twice the tokens, less the 65 rows of rings


def test_startup_log_and_retraction_with_rings(tiny, prompts_and_expected, caplog):
    """The start-up log counts the rings per request; a pool too small for all requests retracts some,
    and their re-prefill (chunked across the window) rebuilds the rings: the tokens stay transformers'."""
    prompts, expected = prompts_and_expected
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with caplog.at_level("INFO", logger="kestrel.runner.build"):
        with Engine(model=str(tiny), device="cpu", dtype="float32", attention_backend="torch_native",
                    chunked_prefill_size=4, page_size=1, max_total_tokens=40, schedule_conservativeness=0) as engine:
            outs = engine.generate(prompt_token_ids=prompts * 2, sampling_params=params)
            assert engine.scheduler.num_retractions > 0
            assert_pool_full(engine)
    assert [o.token_ids for o in outs] == expected * 2
    pool_line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool"))
    assert "per token" in pool_line and f"window{WINDOW}: 2 layers x {2 * WINDOW - 1} entries per request" in pool_line
