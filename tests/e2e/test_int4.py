"""AWQ and GPTQ checkpoints end to end on CPU: kestrel serves the greedy tokens of transformers running the
same weights dequantised; dummy 4-bit weights for benchmarks; what resolution refuses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.layers.int4_linear import Int4Linear
from kestrel.models.loader import load_model
from tests.e2e.test_engine import prompts_with_shared_prefixes
from tests.int4_checkpoint import Int4Case, write_int4_checkpoint
from tests.tiny_models import make_tiny_model

NEW_TOKENS = 8
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def transformers_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=2)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            outs.append(model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("case", [Int4Case("awq", 128), Int4Case("gptq", 32, act_order=True),
                                  Int4Case("gptq", 64, sym=True)], ids=str)
def test_int4_checkpoint_serves_the_greedy_tokens_of_its_dequantised_weights(tmp_path, case):
    quant_dir, twin_dir = write_int4_checkpoint(tmp_path, case)
    prompts = prompts_with_shared_prefixes(4, seed=6)
    with Engine(model=str(quant_dir), device="cpu", dtype="float32", disable_overlap_schedule=True) as engine:
        assert engine.config.model.quantization == case.method
        layer = engine.runner.model.model.layers[1]
        assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
        assert (layer.self_attn.qkv_proj.perm is not None) == case.act_order
        assert not isinstance(engine.runner.model.lm_head, Int4Linear)
        got = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert got == transformers_greedy(twin_dir, prompts)


def test_dummy_weights_under_an_int4_config_are_random_packed_layers(tmp_path):
    model = make_tiny_model("llama", tmp_path, hidden_size=128, intermediate_size=256)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = Int4Case("gptq", 64).quantization_config
    (model / "config.json").write_text(json.dumps(config))
    lm = load_model(model, torch.float32, "cpu", load_format="dummy", hf_config=config, quantization="gptq")
    down = lm.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear) and down.qweight.shape == (256 // 8, 128) and down.zeros.dtype == torch.uint8
    w = down(torch.eye(256))  # the dequantised weight, transposed
    assert 0.01 < w.std().item() < 0.04


def _with_quantization_config(path: Path, qc: dict, arch: str = "llama") -> str:
    model = make_tiny_model(arch, path, hidden_size=128, intermediate_size=256)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return str(model)


def test_int4_resolution_refuses_what_kestrel_cannot_serve(tmp_path):
    def resolve(model: str, **options):
        return resolve_config(EngineConfig.from_flat(model=model, device="cpu", **options))

    bad_bits = _with_quantization_config(tmp_path / "bits", {"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(ValueError, match="bits=3; kestrel loads 4-bit gptq weights only"):
        resolve(bad_bits)
    bad_group = _with_quantization_config(tmp_path / "group", {**Int4Case("awq", 128).quantization_config,
                                                               "group_size": 256})
    with pytest.raises(ValueError, match="group_size=256"):
        resolve(bad_group)
    awq = _with_quantization_config(tmp_path / "awq", Int4Case("awq", 128).quantization_config)
    with pytest.raises(ValueError, match="'gptq' does not match the checkpoint's 'awq'"):
        resolve(awq, quantization="gptq")
    with pytest.raises(ValueError, match="'fp8' does not match the checkpoint's 'awq'"):
        resolve(awq, quantization="fp8")
    with pytest.raises(ValueError, match="tensor parallelism"):
        resolve(awq, tp_size=2)
    with pytest.raises(ValueError, match="needs an awq checkpoint.*does not quantize float weights to 4 bits"):
        resolve(str(make_tiny_model("llama", tmp_path / "float")), quantization="awq")
    moe = _with_quantization_config(tmp_path / "moe", Int4Case("gptq", 64).quantization_config, arch="qwen3_moe")
    with pytest.raises(ValueError, match="dense models only.*routed experts of"):
        resolve(moe)
