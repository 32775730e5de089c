"""Speculative flags: SGLang's auto-choice of (steps, topk, draft tokens), draft paths, refusals, CLI."""
from __future__ import annotations

import json
import logging

import pytest

from kestrel.cli import add_engine_flags, config_from_args
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config


def _folder(path, **config):
    path.mkdir()
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 512, "max_position_embeddings": 128}
    (path / "config.json").write_text(json.dumps({**base, **config}))
    return str(path)


def v4_config() -> dict:
    """A whole DeepSeek-V4 config (resolution reads its KV layout for the page size), with one MTP layer."""
    from tests.model.dsv4_reference import RefConfig

    return {**RefConfig().native_config(), "architectures": ["DeepseekV4ForCausalLM"], "num_nextn_predict_layers": 1}


@pytest.fixture
def dirs(tmp_path):
    return {
        "target": _folder(tmp_path / "target"),
        "eagle": _folder(tmp_path / "eagle", num_hidden_layers=1),  # config only: the variant comes from it
        "eagle3": _folder(tmp_path / "eagle3", architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=100),
        "draft": _folder(tmp_path / "draft", hidden_size=32),
        "other_vocab": _folder(tmp_path / "other_vocab", vocab_size=1000),
        "mtp": _folder(tmp_path / "mtp", **v4_config()),
        "v3_mtp": _folder(tmp_path / "v3_mtp", architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=1),
        "llama_mtp": _folder(tmp_path / "llama_mtp", num_nextn_predict_layers=1),
    }


def spec(dirs, model="target", **kw):
    return resolve_config(EngineConfig.from_flat(model=dirs[model], device="cpu", **kw)).speculative


def shape(s) -> tuple[int, int, int]:
    return s.speculative_num_steps, s.speculative_eagle_topk, s.speculative_num_draft_tokens


@pytest.mark.parametrize("algorithm, draft, model, expected", [
    ("EAGLE", "eagle", "target", (5, 4, 8)),  # a tree on Llama-like targets
    ("EAGLE3", "eagle3", "target", (5, 4, 8)),
    ("STANDALONE", "draft", "target", (3, 1, 4)),  # chains for draft models and MTP layers
    ("NEXTN", None, "mtp", (3, 1, 4)),
    ("NEXTN", None, "v3_mtp", (3, 1, 4)),  # DeepSeek-V3 / R1 / V3.1 / Kimi-K2 with an MTP layer
    ("NGRAM", None, "target", (11, 10, 12)),  # SGLang's 12 tokens, breadth up to 10
])
def test_auto_choice_when_none_of_the_three_is_set(dirs, algorithm, draft, model, expected):
    s = spec(dirs, model=model, speculative_algorithm=algorithm,
             **({"speculative_draft_model_path": dirs[draft]} if draft else {}))
    assert shape(s) == expected


def test_an_eagle_head_on_a_target_outside_the_llama_family_gets_a_chain(dirs, tmp_path):
    other = _folder(tmp_path / "other", architectures=["DeepseekV3ForCausalLM"])
    s = resolve_config(EngineConfig.from_flat(model=other, device="cpu", speculative_algorithm="EAGLE",
                                              speculative_draft_model_path=dirs["eagle"])).speculative
    assert shape(s) == (3, 1, 4)


def test_all_three_set_are_kept_and_topk_1_forces_a_chain(dirs, caplog):
    eagle = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=dirs["eagle"])
    assert shape(spec(dirs, **eagle, speculative_num_steps=3, speculative_eagle_topk=2,
                      speculative_num_draft_tokens=6)) == (3, 2, 6)
    with caplog.at_level(logging.WARNING):
        assert shape(spec(dirs, **eagle, speculative_num_steps=4, speculative_eagle_topk=1,
                          speculative_num_draft_tokens=9)) == (4, 1, 5)
    assert "speculative_num_draft_tokens=9 is set to speculative_num_steps + 1 = 5" in caplog.text


@pytest.mark.parametrize("given", [dict(speculative_num_steps=3), dict(speculative_eagle_topk=2),
                                   dict(speculative_num_steps=3, speculative_num_draft_tokens=4)])
def test_setting_only_some_of_the_three_is_refused(dirs, given):
    with pytest.raises(ValueError, match="set all of speculative_num_steps, speculative_eagle_topk, "
                                         "speculative_num_draft_tokens or none"):
        spec(dirs, speculative_algorithm="EAGLE", speculative_draft_model_path=dirs["eagle"], **given)


@pytest.mark.parametrize("bad, message", [
    (dict(speculative_num_steps=0, speculative_eagle_topk=1, speculative_num_draft_tokens=1),
     "speculative_num_steps must be >= 1, got 0"),
    (dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=8),
     "speculative_num_draft_tokens=8 is more than the root plus the 6 nodes"),
    (dict(speculative_disable_batch_size=0), "speculative_disable_batch_size must be >= 1"),
])
def test_bad_shapes_name_the_field(dirs, bad, message):
    with pytest.raises(ValueError, match=message):
        spec(dirs, speculative_algorithm="EAGLE", speculative_draft_model_path=dirs["eagle"], **bad)


def test_algorithm_names_are_sglangs(dirs):
    with pytest.raises(ValueError, match="must be one of EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM .*got 'eagle'"):
        spec(dirs, speculative_algorithm="eagle")


def test_draft_paths(dirs):
    for algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
        with pytest.raises(ValueError, match=f"speculative_algorithm={algorithm} needs speculative_draft_model_path"):
            spec(dirs, speculative_algorithm=algorithm)
    assert spec(dirs, model="mtp", speculative_algorithm="NEXTN").speculative_draft_model_path == dirs["mtp"]
    with pytest.raises(ValueError, match="NEXTN drafts with the MTP layers of the checkpoint at .*which has none"):
        spec(dirs, speculative_algorithm="NEXTN")
    with pytest.raises(ValueError, match="NGRAM drafts from the request's own tokens .*unset speculative_draft_model_path"):
        spec(dirs, speculative_algorithm="NGRAM", speculative_draft_model_path=dirs["draft"])
    with pytest.raises(ValueError, match="has vocab_size 1000 but the target has 512"):
        spec(dirs, speculative_algorithm="STANDALONE", speculative_draft_model_path=dirs["other_vocab"])
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        spec(dirs, speculative_algorithm="STANDALONE", speculative_draft_model_path=dirs["target"] + "-missing")
    bundled = resolve_config(EngineConfig.from_flat(model="demo", device="cpu", speculative_algorithm="STANDALONE",
                                                    speculative_draft_model_path="demo-draft")).speculative
    assert bundled.speculative_draft_model_path.endswith("assets/demo-draft")  # a bundled name, resolved


def test_ngram_knobs_are_each_settable(dirs):
    assert shape(spec(dirs, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)) == (7, 10, 8)
    assert shape(spec(dirs, speculative_algorithm="NGRAM", speculative_eagle_topk=1)) == (11, 1, 12)
    assert shape(spec(dirs, speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_eagle_topk=1)) == (3, 1, 4)


def test_speculative_knobs_without_an_algorithm_are_refused(dirs):
    with pytest.raises(ValueError, match="speculative_num_steps only apply to speculative decoding"):
        spec(dirs, speculative_num_steps=3)
    assert spec(dirs).speculative_num_steps is None  # nothing is filled in when speculation is off


def test_cli_flags_reach_the_config(dirs):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--model", dirs["target"], "--device", "cpu", "--speculative-algorithm", "EAGLE",
                              "--speculative-draft-model-path", dirs["eagle"], "--speculative-num-steps", "3",
                              "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5",
                              "--speculative-disable-batch-size", "8"])
    s = resolve_config(config_from_args(args)).speculative
    assert (s.speculative_algorithm, s.speculative_draft_model_path) == ("EAGLE", dirs["eagle"])
    assert shape(s) == (3, 2, 5) and s.speculative_disable_batch_size == 8


def test_engine_refuses_nextn_without_mtp_layers(dirs, tmp_path):
    from kestrel import Engine

    with pytest.raises(ValueError, match="which has none .num_nextn_predict_layers is unset.; use EAGLE/EAGLE3"):
        Engine(model=dirs["target"], device="cpu", speculative_algorithm="NEXTN")


def test_nextn_on_deepseek_v4_takes_chains_and_the_targets_own_mtp_layer(dirs, tmp_path):
    from tests.model.dsv4_reference import RefConfig

    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps(RefConfig().native_config()))  # DeepSeek's n_mtp_layers spelling
    cfg = dict(model=str(v4), device="cpu", speculative_algorithm="NEXTN")
    s = resolve_config(EngineConfig.from_flat(**cfg)).speculative
    assert shape(s) == (3, 1, 4) and s.speculative_draft_model_path == str(v4)
    tree = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match="speculative_eagle_topk=2: a DeepSeek-V4 target verifies chains only"):
        resolve_config(EngineConfig.from_flat(**cfg, **tree))
    with pytest.raises(ValueError, match="NGRAM is not supported on DeepSeek-V4 targets"):
        resolve_config(EngineConfig.from_flat(**{**cfg, "speculative_algorithm": "NGRAM"}))
    with pytest.raises(ValueError, match="NEXTN drafts with the target's own MTP layers: speculative_draft_model_path "
                                         "must be the target's folder"):
        resolve_config(EngineConfig.from_flat(**cfg, speculative_draft_model_path=dirs["mtp"]))


def test_nextn_is_refused_on_a_target_that_is_not_deepseek_v3_or_v4(dirs):
    with pytest.raises(ValueError, match=r"NEXTN drafts with the MTP layer of a DeepSeek-V3 / V4 target .*; "
                                         r"\['LlamaForCausalLM'\] has none"):
        spec(dirs, model="llama_mtp", speculative_algorithm="NEXTN")


def test_nextn_on_deepseek_v3_may_draft_trees(dirs):
    """MLA keeps no per-request state, so a V3 target verifies trees (unlike V4)."""
    tree = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    assert shape(spec(dirs, model="v3_mtp", speculative_algorithm="NEXTN", **tree)) == (3, 2, 6)
