"""MoE checkpoints into the shared MoE layer's stacked experts: per-expert and stacked layouts, FP8
128 x 128 block-scaled experts (dequantised at load), each rank's share under expert and tensor
parallelism (another rank's experts never read), refusals naming the tensor and what is supported, and the
config-only folders of the real shapes built on the meta device."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.distributed.parallel_state import ParallelState
from kestrel.hf_config import read_hf_config
from kestrel.models import loader
from kestrel.models.loader import load_model
from kestrel.models.registry import model_class
from kestrel.quant.fp8 import dequantize_blocks, quantize_blocks
from tests.tiny_models import make_tiny_model

CONFIGS = Path(__file__).resolve().parents[2] / "kestrel/assets/configs"
EXPERT = "model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    """8 experts of width 48, 2 layers, hidden 64 (tests/tiny_models.py)."""
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    dst.mkdir(exist_ok=True)
    hf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**hf, **config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    return dst


def _stacked(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}


def test_stacked_and_fp8_expert_checkpoints_load_as_per_expert(qwen3_moe, tmp_path):
    want = _stacked(load_model(qwen3_moe, torch.float32, "cpu"))
    tensors = load_file(qwen3_moe / "model.safetensors")
    stacked = dict(tensors)
    for layer in range(2):
        per = {p: torch.stack([stacked.pop(EXPERT.format(layer=layer, e=e, proj=p)) for e in range(8)]) for p in PROJS}
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([per["gate_proj"], per["up_proj"]], 1)
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = per["down_proj"]
    got = _stacked(load_model(_rewrite(qwen3_moe, tmp_path / "stacked", stacked), torch.float32, "cpu"))
    assert all(torch.equal(got[n], want[n]) for n in want)

    fp8, meaning = dict(tensors), {}
    for name in [n for n in tensors if ".experts." in n]:
        fp8[name], fp8[name + "_scale_inv"] = quantize_blocks(tensors[name])
        meaning[name] = dequantize_blocks(fp8[name], fp8[name + "_scale_inv"])
    qc = dict(quant_method="fp8", weight_block_size=[128, 128], activation_scheme="dynamic")
    model = load_model(_rewrite(qwen3_moe, tmp_path / "fp8", fp8, quantization_config=qc), torch.float32, "cpu")
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(experts.w13[5, 48:], meaning[EXPERT.format(layer=1, e=5, proj="up_proj")])
    assert torch.equal(experts.w2[2], meaning[EXPERT.format(layer=1, e=2, proj="down_proj")])
    assert not torch.equal(experts.w2[2], tensors[EXPERT.format(layer=1, e=2, proj="down_proj")])


@pytest.mark.parametrize("ep_size", [1, 2])
def test_each_rank_loads_its_experts_and_slices_only(qwen3_moe, ep_size, monkeypatch):
    """tp_size 2: ep_size 2 gives each rank 4 whole experts (the others' tensors are never read); ep_size 1
    gives each rank every expert at half its width."""
    whole = _stacked(load_model(qwen3_moe, torch.float32, "cpu"))
    read: list[str] = []
    real_read = loader._read
    monkeypatch.setattr(loader, "_read", lambda f, name, part: read.append(name) or real_read(f, name, part))
    for rank in range(2):
        read.clear()
        model = load_model(qwen3_moe, torch.float32, "cpu", parallel=ParallelState(rank, 2, ep_size=ep_size))
        got = _stacked(model)["model.layers.0.mlp.experts.w13"]
        w = whole["model.layers.0.mlp.experts.w13"]
        if ep_size == 2:
            assert torch.equal(got, w[4 * rank:4 * rank + 4])
            read_experts = {int(n.split(".")[5]) for n in read if ".experts." in n}
            assert read_experts == set(range(4 * rank, 4 * rank + 4))
        else:
            gate, up = w.chunk(2, dim=1)
            half = slice(24 * rank, 24 * rank + 24)
            assert torch.equal(got, torch.cat([gate[:, half], up[:, half]], 1))


def test_unknown_expert_tensors_and_quantisation_are_refused_naming_them(qwen3_moe, tmp_path):
    tensors = load_file(qwen3_moe / "model.safetensors")
    qweight = {**tensors, "model.layers.0.mlp.experts.3.gate_proj.qweight": torch.zeros(4, 4, dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.3\.gate_proj\.qweight: not a tensor "
                                         r"Qwen3MoeForCausalLM knows .*supported: per expert \{e\}\.gate_proj"):
        load_model(_rewrite(qwen3_moe, tmp_path / "qweight", qweight), torch.float32, "cpu")
    five = {**tensors, "model.layers.1.mlp.experts.down_proj": torch.zeros(5, 64, 48)}
    with pytest.raises(ValueError, match=r"experts\.down_proj: 5 experts stacked, the model has 8"):
        load_model(_rewrite(qwen3_moe, tmp_path / "five", five), torch.float32, "cpu")
    missing = {k: v for k, v in tensors.items() if k != EXPERT.format(layer=1, e=6, proj="down_proj")}
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.mlp\.experts\.e6\.down'\]"):
        load_model(_rewrite(qwen3_moe, tmp_path / "missing", missing), torch.float32, "cpu")
    gptq = dict(quant_method="gptq", bits=4, group_size=128)
    with pytest.raises(ValueError, match=r"gptq checkpoints load into dense models only.*Qwen3MoeForCausalLM"):
        load_model(_rewrite(qwen3_moe, tmp_path / "gptq", tensors, quantization_config=gptq), torch.float32, "cpu")


@pytest.mark.parametrize("folder, billions, expert_shape", [
    ("qwen3-30b-a3b", 30.5, (128, 2 * 768, 2048)), ("mixtral-8x7b", 46.7, (8, 2 * 14336, 4096))])
def test_config_only_folders_build_their_real_shapes_on_the_meta_device(folder, billions, expert_shape):
    config = read_hf_config(str(CONFIGS / folder))
    cls = model_class(config["architectures"])
    with torch.device("meta"):
        model = cls(cls.parse_config(config))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.1)
    assert all(layer.mlp.experts.w13.shape == expert_shape for layer in model.model.layers)
    layout = model.kv_layout(torch.bfloat16)
    assert layout is not None
