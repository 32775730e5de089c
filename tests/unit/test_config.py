"""EngineConfig: its options (help, choices, groups, flags), resolution and the attention resolver."""
from __future__ import annotations

import argparse
import json

import pytest

from kestrel.attention import decisions, registry
from kestrel.attention.registry import attention_backends
from kestrel.cli import BENCHES, build_parser, main
from kestrel.config import BackendPair, EngineConfig
from kestrel.config_resolve import resolve_config


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                     "max_position_embeddings": 128}))
    return str(tmp_path)


def resolve(model_dir, **kw) -> EngineConfig:
    return resolve_config(EngineConfig.from_flat(model=model_dir, device="cpu", **kw))


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
        resolve_config(EngineConfig.from_flat(model=model_dir, device="cuda"))


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


def test_resolution_keeps_the_backend_pair_which_everything_after_reads(model_dir, monkeypatch):
    c = resolve(model_dir, prefill_attention_backend="sdpa")
    assert c.attention.backends == BackendPair(prefill="sdpa", decode="torch_native")

    def decide_again(config):
        raise AssertionError("the attention backends were decided again after resolution")

    monkeypatch.setattr(registry, "resolve_sources", decide_again)
    assert resolve_config(c) is c
    assert registry.draft_attention_backends(c) == c.attention.backends
    for decision in decisions.DECISIONS:
        decision.fn(c)


# ---- options and flags --------------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _bench_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `kestrel bench NAME` builds, caught where it parses."""
    seen = []

    def catch(parser, *args, **kwargs):
        seen.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(SystemExit):
        main(["bench", name])
    monkeypatch.undo()
    return seen[0]


def test_every_flag_of_every_verb_has_help(monkeypatch):
    verbs = {**_subparsers(build_parser()), **{f"bench {b}": _bench_parser(b, monkeypatch) for b in BENCHES}}
    missing = [f"kestrel {verb} {'/'.join(action.option_strings or [action.dest])}"
               for verb, parser in verbs.items() for action in parser._actions
               if not (action.help or "").strip()]
    assert not missing, f"flags without help: {missing}"


def test_every_option_declares_help_and_decided_fields_are_no_flags():
    options = EngineConfig.options()
    assert {"model", "page_size", "device", "tool_call_parser"} <= set(options)
    assert all(f.metadata["help"] for _, f in options.values())
    assert not {"hf_config", "backends", "resolved"} & set(options)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hf-config", "{}"])
    with pytest.raises(TypeError, match="unknown engine option 'hf_config'"):
        EngineConfig.from_flat(hf_config={})


def test_help_groups_the_flags_by_section(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    titles = ["model options:", "KV cache options:", "scheduler options:", "attention options:",
              "speculative decoding options:", "CUDA graphs options:", "parallelism options:", "server options:"]
    starts = [out.index(t) for t in titles]
    assert starts == sorted(starts)
    sections = dict(zip(titles, [out[a:b] for a, b in zip(starts, starts[1:] + [len(out)])]))
    for title, flag in [("model options:", "--device"), ("KV cache options:", "--page-size"),
                        ("KV cache options:", "--enable-prefix-caching"),
                        ("attention options:", "--triton-decode-split"),
                        ("server options:", "--served-model-name"), ("parallelism options:", "--tp-size")]:
        assert f"  {flag}" in sections[title], (title, flag)
    assert "--kv-cache-dtype {auto,fp8_e4m3,fp8_e5m2}" in out  # declared choices show as the metavar


def test_declared_choices_are_the_ones_their_subsystems_accept():
    from kestrel.quant.kv import KV_CACHE_DTYPES
    from kestrel.quant.resolve import QUANTIZATIONS
    from kestrel.server.reasoning_parsers import REASONING_PARSERS
    from kestrel.server.tool_parsers import PARSERS
    from kestrel.speculative.resolve import ALGORITHMS

    choices = {name: f.metadata["choices"] for name, (_, f) in EngineConfig.options().items()}
    assert choices["kv_cache_dtype"] == tuple(KV_CACHE_DTYPES)
    assert choices["quantization"] == QUANTIZATIONS
    assert choices["tool_call_parser"] == tuple(PARSERS)
    assert choices["reasoning_parser"] == tuple(REASONING_PARSERS)
    assert choices["speculative_algorithm"] == ALGORITHMS


def test_system_fingerprint_names_the_engine_options_not_the_servers():
    from kestrel.server.launch import system_fingerprint

    base = system_fingerprint(EngineConfig.from_flat(model="demo", dtype="float32"))
    assert base.startswith("kestrel-") and base == system_fingerprint(EngineConfig.from_flat(model="demo",
                                                                                           dtype="float32"))
    assert system_fingerprint(EngineConfig.from_flat(model="demo", dtype="float32", port=9, api_key="k")) == base
    assert system_fingerprint(EngineConfig.from_flat(model="demo", dtype="bfloat16")) != base
