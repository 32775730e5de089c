"""Tiny random gpt-oss checkpoints: float, or with the experts quantised to MXFP4 by a naive quantiser."""
from __future__ import annotations

from pathlib import Path

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
WINDOW = 5
CONFIG = dict(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, vocab_size=96, hidden_size=32,
              intermediate_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
              sliding_window=WINDOW, max_position_embeddings=512, swiglu_limit=1.5, eos_token_id=None,
              layer_types=["sliding_attention", "full_attention"] * 2,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 1000.0})


def make_gpt_oss(path: Path, seed: int = 0, **overrides) -> Path:
    """Every weight random and clearly non-zero (norms around 1, biases and sinks too)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.7, 1.3)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.5)
            else:
                param.normal_(0.0, 0.25 if param.dim() > 1 else 0.3)
    model.save_pretrained(path)
    return path


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] float -> (blocks uint8 [..., rows, cols/32, 16], scales uint8 [..., rows, cols/32]):
    per 32 values the exponent that maps their largest magnitude into e2m1's range, each value rounded
    to the nearest code."""
    groups = weight.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / 2.0 ** exponent
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    packed = code.unflatten(-1, (16, 2))
    blocks = (packed[..., 0] | (packed[..., 1] << 4)).to(torch.uint8)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def to_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of `src` whose experts' weights are MXFP4 (stored [E, out, in], as gpt-oss ships them),
    and a float copy whose experts hold exactly the dequantised values (the reference)."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    quantized, reference = {}, dict(tensors)
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2).contiguous())
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            from kestrel.quant.mxfp4 import dequantize_mxfp4
            reference[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
        else:
            quantized[name] = t
    config = json.loads((src / "config.json").read_text())
    for folder, state, cfg in ((dst / "mxfp4", quantized, {**config, "quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}}),
            (dst / "reference", reference, config)):
        folder.mkdir(parents=True)
        save_file(state, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(cfg))
    return dst
