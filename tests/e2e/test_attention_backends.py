"""Split prefill/decode backends: identical greedy tokens, routing, stamps, decisions, start-up errors."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.attention import decisions, registry
from kestrel.attention.hybrid import HybridBackend, serving_half
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.core.forward_mode import ForwardMode
from tests.e2e.conftest import assert_pool_full
from tests.e2e.test_engine import prompts_with_shared_prefixes

pytest.importorskip("triton")

LAUNCHES = [
    {},  # default: torch_native on CPU
    {"attention_backend": "triton"},
    {"prefill_attention_backend": "triton"},
    {"decode_attention_backend": "triton"},
    {"prefill_attention_backend": "triton", "decode_attention_backend": "torch_native"},
    {"prefill_attention_backend": "torch_native", "decode_attention_backend": "triton"},
    {"decode_attention_backend": "triton", "triton_decode_split": "length"},  # chunks of 8 keys on CPU
]


def test_greedy_tokens_identical_across_split_launches(tiny_model):
    model = tiny_model("qwen2")
    prompts = prompts_with_shared_prefixes(4, seed=6)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    results = []
    for launch in LAUNCHES:
        with Engine(model=model, device="cpu", dtype="float32", chunked_prefill_size=16, **launch) as engine:
            first = engine.generate(prompt_token_ids=prompts[:2], sampling_params=params)
            second = engine.generate(prompt_token_ids=prompts[2:], sampling_params=params)  # radix hits
            results.append([o.token_ids for o in first + second])
            assert_pool_full(engine)
    assert all(r == results[0] for r in results[1:])


def test_mixed_steps_decodes_through_the_decode_kernel_give_the_same_greedy_tokens(tiny_model, monkeypatch):
    """MIXED steps through the Triton backend, their decodes through the extend kernel, then through the
    decode kernel (`DECODE_KERNEL_FOR_MIXED_DECODES`), against torch_native: the same greedy tokens."""
    from kestrel.attention import triton_backend

    model = tiny_model("qwen2")
    prompts = prompts_with_shared_prefixes(4, seed=6)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    split_steps = []
    serve = triton_backend.TritonBackend._extend_then_decodes
    monkeypatch.setattr(triton_backend.TritonBackend, "_extend_then_decodes",
                        lambda self, *args: split_steps.append(self._decode_tail) or serve(self, *args))
    results = []
    for launch, split in (({}, False), ({"attention_backend": "triton"}, False), ({"attention_backend": "triton"}, True)):
        monkeypatch.setattr(triton_backend, "DECODE_KERNEL_FOR_MIXED_DECODES", split)
        # Chunks of 24 tokens: over the 16 up to which the extend kernel splits the keys itself.
        with Engine(model=model, device="cpu", dtype="float32", chunked_prefill_size=24, enable_mixed_chunk=True,
                    **launch) as engine:
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            results.append([o.token_ids for o in outs])
        assert bool(split_steps) == split
    assert results[1] == results[0] and results[2] == results[0]


def test_triton_rope_matches_torch_rope():
    from kestrel.layers.rope_triton import rope_triton
    from kestrel.layers.rotary import RotaryEmbedding
    from kestrel.layers.rotary import RopeConfig

    rope = RotaryEmbedding(32, 64, RopeConfig(rope_type="default", theta=10000.0))
    positions = torch.tensor([0, 5, 63, 7])
    q, k = torch.randn(4, 3 * 32), torch.randn(4, 2 * 32)
    qk = torch.cat([q, k], dim=-1)
    torch.testing.assert_close(rope_triton(qk, positions, rope.cos_sin_cache, 32), rope(positions, qk))


# ---- routing and resolution (no weights needed) ------------------------------------------------------
def config(model_dir: str, **fields) -> EngineConfig:
    return resolve_config(EngineConfig.from_flat(model=model_dir, device="cpu", **fields))


ROUTING_CASES = {  # launch → expected (prefill half, decode half)
    "base only": ({"attention_backend": "triton"}, ("triton", "triton")),
    "prefill only": ({"prefill_attention_backend": "triton"}, ("triton", "torch_native")),
    "decode only": ({"decode_attention_backend": "triton"}, ("torch_native", "triton")),
    "both": ({"prefill_attention_backend": "triton", "decode_attention_backend": "sdpa"},
             ("triton", "sdpa")),
    "base + decode override": ({"attention_backend": "triton", "decode_attention_backend": "torch_native"},
                               ("triton", "torch_native")),
}


class Stub:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize("case", ROUTING_CASES)
@pytest.mark.parametrize("spec_mode", ["prefill", "decode"])
def test_routing_table_for_every_forward_mode(tiny_model, case, spec_mode):
    launch, (prefill, decode) = ROUTING_CASES[case]
    pair = registry.attention_backends(config(tiny_model("llama"), speculative_attention_mode=spec_mode, **launch))
    assert (pair.prefill, pair.decode) == (prefill, decode)
    hybrid = HybridBackend(Stub(pair.prefill + "#p"), Stub(pair.decode + "#d"), spec_mode)
    expected = {
        ForwardMode.EXTEND: "#p", ForwardMode.MIXED: "#p", ForwardMode.DRAFT_EXTEND: "#p",
        ForwardMode.DECODE: "#d",
        ForwardMode.TARGET_VERIFY: "#d" if spec_mode == "decode" else "#p",
    }
    assert set(expected) == set(ForwardMode)
    for mode, suffix in expected.items():
        assert hybrid.backend_for(mode).name.endswith(suffix), mode
        assert serving_half(mode, spec_mode) == ("prefill" if suffix == "#p" else "decode")


def test_engine_builds_hybrid_only_for_different_halves_and_stamps_everything(tiny_model):
    model = tiny_model("llama")
    with Engine(model=model, device="cpu", attention_backend="sdpa") as engine:
        backend = engine.runner.attn_backend
        assert (backend.name, backend.fallback.name) == ("sdpa", "torch_native")  # each keeps its own stamp
    with Engine(model=model, device="cpu", decode_attention_backend="triton") as engine:
        backend = engine.runner.attn_backend
        assert isinstance(backend, HybridBackend)
        assert backend.name == "hybrid(prefill=torch_native,decode=triton)"
        assert (backend.prefill_backend.name, backend.decode_backend.name) == ("torch_native", "triton")


def test_every_factory_stamps_a_canonical_name(tiny_model):
    """Each form too: a backend serving MLA builds its MLA form over a latent layout, stamped alike."""
    from kestrel.cache.kv_layout import KVLayout
    from kestrel.cache.kv_memory import KVPools

    cfg = config(tiny_model("llama"))
    per_head = KVPools(KVLayout.full_attention(1, 1, 8, torch.float32), 8, 2, "cpu")
    latent = KVPools(KVLayout.latent_attention(1, 16, 8, torch.float32), 8, 2, "cpu")
    for name, entry in registry.REGISTRY.items():
        for pools in [per_head] + ([latent] if "mla" in entry.attention_kinds else []):
            effective, backend = entry.factory(pools, None, cfg)
            assert effective == backend.name and effective in registry.REGISTRY and effective not in registry.ALIASES


def test_draft_resolution_uses_override_for_both_halves(tiny_model):
    model = tiny_model("llama")
    pair = registry.draft_attention_backends(config(model, prefill_attention_backend="triton"))
    assert (pair.prefill, pair.decode) == ("triton", "torch_native")
    pair = registry.draft_attention_backends(config(model, prefill_attention_backend="triton",
                                                    speculative_draft_attention_backend="sdpa"))
    assert (pair.prefill, pair.decode) == ("sdpa", "sdpa")


def test_unknown_or_unavailable_backends_fail_at_start_up(tiny_model, monkeypatch):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="valid choices: dsv4, sdpa, torch_native, triton"):
        config(model, decode_attention_backend="flash")
    monkeypatch.setattr("kestrel.envs._TRITON_INTERPRET", False)  # as if unset when kestrel was imported
    with pytest.raises(ValueError, match="'triton' \\(from prefill_attention_backend\\) cannot run here: .*CUDA"):
        Engine(model=model, device="cpu", prefill_attention_backend="triton")


# ---- decisions ------------------------------------------------------------------------------------
@pytest.fixture
def no_prefix_backend():
    """A registered backend that cannot extend after a cached prefix and runs no Triton kernels."""
    registry.register("noprefix", unavailable=lambda c: None, extend_prefix=False)(
        lambda kv, r2t, c: ("noprefix", Stub("noprefix")))
    yield "noprefix"
    del registry.REGISTRY["noprefix"]


def test_each_decision_reads_its_half_under_split_only_configs(tiny_model, no_prefix_backend):
    model = tiny_model("llama")
    # Prefill-half decisions: only the prefill field is set, the base is unset.
    assert decisions.extend_prefix_reuse(config(model, prefill_attention_backend=no_prefix_backend)) is False
    assert decisions.extend_prefix_reuse(config(model, decode_attention_backend=no_prefix_backend)) is True
    resolved = config(model, prefill_attention_backend=no_prefix_backend)
    assert resolved.cache.disable_radix_cache and resolved.scheduler.chunked_prefill_size == -1
    # Both-phase kernel: needs support from both halves; an unset field never answers "yes".
    assert decisions.shared_triton_kernel(config(model, attention_backend="triton")) is True
    assert decisions.shared_triton_kernel(config(model, prefill_attention_backend="triton")) is False
    assert decisions.shared_triton_kernel(config(model, decode_attention_backend="triton")) is False
    # Library floors: any half that names the library.
    assert decisions.library_requirements(config(model, decode_attention_backend="triton")) == {"triton": "3.1"}
    assert decisions.library_requirements(config(model, prefill_attention_backend="triton")) == {"triton": "3.1"}
    assert decisions.library_requirements(config(model)) == {}
    # CUDA graphs capture the decode half (+ the prefill half only when it serves verify).
    assert decisions.cuda_graph_backends(config(model, decode_attention_backend="triton")) == ["triton"]
    assert decisions.cuda_graph_backends(config(model, prefill_attention_backend="triton")) == ["torch_native"]
    spec = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": model,
            "prefill_attention_backend": "triton"}
    assert decisions.cuda_graph_backends(config(model, **spec)) == ["torch_native", "triton"]
    assert decisions.cuda_graph_backends(config(model, speculative_attention_mode="decode", **spec)) == \
        ["torch_native"]
    # Piecewise graphs serve EXTEND / MIXED: the prefill half decides.
    assert decisions.piecewise_graph_prefill(config(model, prefill_attention_backend="triton")) is True
    assert decisions.piecewise_graph_prefill(config(model, decode_attention_backend="triton")) is False
    assert {d.name for d in decisions.DECISIONS} == {
        "extend_prefix_reuse", "shared_triton_kernel", "library_requirements", "cuda_graph_backends",
        "piecewise_graph_prefill"}


def test_only_the_resolver_reads_the_base_attention_field():
    """Static guard: `x.attention_backend` or `getattr(x, "attention_backend")` anywhere in kestrel/
    but registry.resolve_sources fails."""
    root = pathlib.Path(__file__).resolve().parents[2] / "kestrel"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        allowed: set[int] = set()
        if path == root / "attention" / "registry.py":
            resolver = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "resolve_sources")
            allowed = {id(n) for n in ast.walk(resolver)}
        for node in ast.walk(tree):
            is_read = isinstance(node, ast.Attribute) and node.attr == "attention_backend"
            is_read |= (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"
                        and len(node.args) > 1 and getattr(node.args[1], "value", None) == "attention_backend")
            if is_read and id(node) not in allowed:
                offenders.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert not offenders, f"base attention field read outside the resolver: {offenders}"


def test_explain_prints_the_plan_without_loading_weights(tiny_model, capsys, tmp_path):
    from kestrel.cli import main

    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(pathlib.Path(tiny_model("llama"), "config.json").read_text())
    assert main(["explain", "--model", str(folder), "--device", "cpu", "--prefill-attention-backend", "sdpa",
                 "--decode-attention-backend", "triton", "--speculative-attention-mode", "decode"]) == 0
    out = capsys.readouterr().out
    assert "prefill  sdpa           from --prefill-attention-backend 'sdpa'" in out
    assert "DECODE         -> decode half: triton" in out
    assert "TARGET_VERIFY  -> decode half: triton" in out
    assert "EXTEND         -> prefill half: sdpa" in out
    assert "cuda-graph capture set: triton" in out
    for d in decisions.DECISIONS:
        assert d.name in out


@pytest.mark.parametrize("page_size", [1, 4])
def test_sdpa_prefill_gives_torch_native_greedy_tokens(tiny_model, monkeypatch, page_size):
    """Prompts in one batch, then radix hits and chunks (extends after a cached prefix), page sizes 1 and 4."""
    from kestrel.attention import sdpa

    fast_calls = []
    attend = sdpa.causal_attention
    monkeypatch.setattr(sdpa, "causal_attention", lambda *args: fast_calls.append(args[3]) or attend(*args))
    model = tiny_model("llama")
    prompts = prompts_with_shared_prefixes(4, seed=3)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    results = []
    for backend in ("torch_native", "sdpa"):
        with Engine(model=model, device="cpu", dtype="float32", chunked_prefill_size=16, page_size=page_size,
                    prefill_attention_backend=backend) as engine:
            first = engine.generate(prompt_token_ids=prompts[:2], sampling_params=params)
            second = engine.generate(prompt_token_ids=prompts[2:], sampling_params=params)  # radix hits
            results.append([o.token_ids for o in first + second])
            assert_pool_full(engine)
    assert results[0] == results[1]
    assert 0 in fast_calls and any(prefix > 0 for prefix in fast_calls)  # the fast path ran, with and without prefix
