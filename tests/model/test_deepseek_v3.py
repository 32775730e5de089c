"""DeepSeek-V3's math against transformers' DeepseekV3ForCausalLM on tiny configs (fp32 logits at every
position; attention through a dense MLA reference, so the projections, interleaved YaRN rope with its
mscale, routing and loading are what is checked), its FP8 checkpoints, and checkpoints that do not match."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.layers.fp8_linear import Fp8Linear
from kestrel.models.loader import load_model
from tests.e2e.test_fp8 import quantize_like_qwen3_fp8
from tests.model.dsv3_tiny import dense_logits, hf_logits, make_dsv3

TOKENS = [5, 17, 99, 3, 64, 2, 120, 45, 7, 7, 31, 88, 11, 0, 54, 23, 76, 101, 9, 60]


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "q_proj"])
def test_logits_match_transformers(tmp_path, q_lora_rank):
    path = make_dsv3(tmp_path, q_lora_rank)
    model = load_model(path, torch.float32, "cpu")
    torch.testing.assert_close(dense_logits(model, TOKENS), hf_logits(path, TOKENS), atol=2e-5, rtol=1e-4)


def test_neox_rope_and_default_rope_match_transformers(tmp_path):
    path = make_dsv3(tmp_path, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                     n_group=1, topk_group=1, norm_topk_prob=False)
    model = load_model(path, torch.float32, "cpu")
    torch.testing.assert_close(dense_logits(model, TOKENS), hf_logits(path, TOKENS), atol=2e-5, rtol=1e-4)


def test_block_fp8_checkpoint_is_close_to_its_dequantized_twin(tmp_path):
    """Linears, experts and kv_b_proj stored as e4m3 with 128 x 128 scales (DeepSeek's layout; kv_b_proj
    spans 2 x 2 blocks, the second column block partial). kv_b_proj is dequantised at load (it equals the
    twin's exactly), the other linears stay FP8: only their activation rounding separates the two."""
    src = make_dsv3(tmp_path / "float", hidden_size=128, moe_intermediate_size=128, intermediate_size=128,
                    qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=144)
    fp8, twin = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if t.dim() == 2 and ".layers." in name and "norm" not in name and not name.endswith("mlp.gate.weight"):
            q, scale_inv = quantize_like_qwen3_fp8(t)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, scale_inv
            full = scale_inv.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
            twin[name] = q.float() * full
        else:
            fp8[name] = twin[name] = t
    assert fp8["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape == (2, 2)
    config = json.loads((src / "config.json").read_text())
    for name, tensors, qc in (("fp8", fp8, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}), ("twin", twin, None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, "quantization_config": qc} if qc else config))
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    quantized = load_model(tmp_path / "fp8", torch.float32, "cpu")
    attn = quantized.model.layers[1].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, Fp8Linear) and isinstance(attn.q_b_proj, Fp8Linear)
    assert attn.attn.kv_b_proj.dtype == torch.float32
    torch.testing.assert_close(attn.attn.kv_b_proj, twin["model.layers.1.self_attn.kv_b_proj.weight"], atol=0, rtol=0)
    a, b = dense_logits(quantized, TOKENS), dense_logits(load_model(tmp_path / "twin", torch.float32, "cpu"), TOKENS)
    assert 0 < ((a - b).pow(2).mean().sqrt() / b.std()).item() < 0.13


def test_fp8_kv_b_proj_without_its_scale_is_refused(tmp_path):
    path = make_dsv3(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.attn\.kv_b_proj\.weight \(without its scale\)"):
        load_model(path, torch.float32, "cpu")


def test_mtp_tensors_are_skipped_and_a_mismatched_checkpoint_is_refused_naming_the_tensor(tmp_path):
    path = make_dsv3(tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer: a draft's, not the target's
    save_file(tensors, str(path / "model.safetensors"))
    load_model(path, torch.float32, "cpu")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(24, 8)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.kv_a_proj_with_mqa.weight"):
        load_model(bad, torch.float32, "cpu")
