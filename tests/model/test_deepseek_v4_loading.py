"""DeepSeek-V4 checkpoint loading on tiny tensors: native and transformers names, FP8 (128 x 128 blocks,
fp32 or ue8m0 scales) and FP4 e2m1 (32-input blocks, e8m0 scales), dequantised at load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kestrel.models.deepseek_v4.loading import dequantize
from kestrel.models.loader import load_model
from tests.model import dsv4_reference as ref

CFG = ref.RefConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
                    q_lora_rank=32, o_lora_rank=16, index_n_heads=2, index_head_dim=16, n_routed_experts=4,
                    moe_intermediate_size=64)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def fp8_quantize(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale per 128 x 128 block, the value they stand for), block by block."""
    rows, cols = w.shape
    nb_r, nb_c = -(-rows // 128), -(-cols // 128)
    scale = torch.empty(nb_r, nb_c)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    value = torch.empty(rows, cols)
    for i in range(nb_r):
        for j in range(nb_c):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = blk.abs().max() / 448
            if ue8m0:
                s = 2.0 ** torch.ceil(torch.log2(s))
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s).to(torch.float8_e4m3fn)
            value[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float() * s
    stored = scale.to(torch.float8_e8m0fnu) if ue8m0 else scale
    return q, stored, value


def fp4_pack(shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int8 [o, i/2], e8m0 scales [o, i/32], the values): random codes, element 2k in the low nibble."""
    rows, cols = shape
    codes = torch.randint(0, 16, shape, generator=gen)
    exps = torch.randint(120, 130, (rows, cols // 32), generator=gen)
    value = torch.empty(shape)
    for r in range(rows):
        for c in range(cols):
            magnitude = E2M1[int(codes[r, c]) & 7]
            value[r, c] = (-magnitude if codes[r, c] & 8 else magnitude) * 2.0 ** (int(exps[r, c // 32]) - 127)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, exps.to(torch.uint8).view(torch.float8_e8m0fnu), value


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_block_dequant(ue8m0: bool) -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    q, scale, value = fp8_quantize(w, ue8m0)
    got = dequantize(q, scale, w.shape)
    torch.testing.assert_close(got, value, atol=0, rtol=0)
    assert (got - w).abs().max() < 0.13 * w.abs().max()  # and it is an FP8 approximation of w


def test_fp4_dequant() -> None:
    packed, scale, value = fp4_pack((6, 64), torch.Generator().manual_seed(1))
    torch.testing.assert_close(dequantize(packed, scale, value.shape), value, atol=0, rtol=0)


def _folder(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(CFG.native_config()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _quantised_checkpoint(w: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The native checkpoint with FP8 attention / shared-expert weights (alternating fp32 and ue8m0 scales)
    and FP4 routed experts, and the weights it stands for."""
    gen = torch.Generator().manual_seed(2)
    stored, meaning = {}, dict(w)
    for k, (name, t) in enumerate(sorted(w.items())):
        fp8 = any(f".attn.{p}.weight" in name for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")) \
            or ".shared_experts." in name
        if fp8:
            q, scale, value = fp8_quantize(t, ue8m0=k % 2 == 0)
            stored[name], stored[name.removesuffix("weight") + "scale"], meaning[name] = q, scale, value
        elif ".ffn.experts." in name:
            packed, scale, value = fp4_pack(tuple(t.shape), gen)
            stored[name], stored[name.removesuffix("weight") + "scale"], meaning[name] = packed, scale, value
        else:
            stored[name] = t
    return stored, meaning


def test_native_quantised_folder_loads_dequantised(tmp_path: Path) -> None:
    w = ref.random_weights(CFG, seed=3)
    stored, meaning = _quantised_checkpoint(w)
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    assert any(t.dtype == torch.int8 for t in stored.values())
    model = load_model(_folder(tmp_path, stored), torch.float32, "cpu")
    plain = load_model(_folder(tmp_path / "plain", meaning), torch.float32, "cpu")
    got, expected = model.state_dict(), plain.state_dict()
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name
    # and the stacked experts hold the FP4 values of the checkpoint's expert 2 of layer 1
    assert torch.equal(got["layers.1.ffn.experts.w13"][2, CFG.moe_intermediate_size:],
                       meaning["layers.1.ffn.experts.2.w3.weight"])


def test_hf_names_with_weight_scale_inv_and_scale_first(tmp_path: Path) -> None:
    """transformers' names for a few tensors (FP8 with `weight_scale_inv`, stored before the weight)."""
    w = ref.random_weights(CFG, seed=4)
    plain = load_model(_folder(tmp_path / "plain", w), torch.float32, "cpu")
    hf = dict(w)
    q, scale, value = fp8_quantize(hf.pop("layers.0.attn.wq_a.weight"), ue8m0=True)
    hf["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = scale
    hf["model.layers.0.self_attn.q_a_proj.weight"] = q
    hf["model.layers.1.self_attn.compressor.indexer.position_bias"] = hf.pop("layers.1.attn.indexer.compressor.ape")
    hf["model.layers.0.mlp.gate.tid2eid"] = hf.pop("layers.0.ffn.gate.tid2eid")
    hf["model.layers.2.mlp.experts.down_proj"] = torch.stack(
        [hf.pop(f"layers.2.ffn.experts.{e}.w2.weight") for e in range(CFG.n_routed_experts)])
    hf["lm_head.weight"] = hf.pop("head.weight")
    model = load_model(_folder(tmp_path / "hf", hf), torch.float32, "cpu")
    got, expected = model.state_dict(), plain.state_dict()
    assert torch.equal(got["layers.0.attn.wq_a.weight"], value)
    for name in got:
        if name != "layers.0.attn.wq_a.weight":
            assert torch.equal(got[name], expected[name]), name


def test_missing_and_unexpected_tensors_are_listed(tmp_path: Path) -> None:
    w = ref.random_weights(CFG, seed=5)
    del w["layers.1.attn.indexer.wq_b.weight"]
    w["layers.1.attn.bogus"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"missing \['layers.1.attn.indexer.wq_b.weight'\], "
                                         r"unexpected \['layers.1.attn.bogus'\]"):
        load_model(_folder(tmp_path, w), torch.float32, "cpu")


def test_quantised_weight_without_scale_is_an_error(tmp_path: Path) -> None:
    w = ref.random_weights(CFG, seed=6)
    w["layers.0.attn.wq_a.weight"] = w["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"layers.0.attn.wq_a.weight \(quantised, no scale\)"):
        load_model(_folder(tmp_path, w), torch.float32, "cpu")


def test_dummy_load_format(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CFG.native_config()))
    a = load_model(tmp_path, torch.float32, "cpu", load_format="dummy")
    b = load_model(tmp_path, torch.float32, "cpu", load_format="dummy")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.layers[0].ffn.gate.tid2eid.max() < CFG.n_routed_experts and len(a.mtp) == 1
    assert a.layers[0].attn.wq_a.weight.std() > 0.01
