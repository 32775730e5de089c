"""4-bit AWQ / GPTQ weights: the published layouts (written by the tests' own packing code) read into
kestrel's layout, the W4A16 Triton GEMM (interpreter) and the layer against the dequantised weights in
torch, and the configs kestrel refuses."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.int4_linear import Int4Linear
from kestrel.quant.int4 import Int4Config, dequantize, from_checkpoint, int4_config
from tests.int4_checkpoint import Int4Case, pack_layer

CASES = [Int4Case("awq", 32), Int4Case("awq", 128), Int4Case("gptq", 64), Int4Case("gptq", 32, act_order=True),
         Int4Case("gptq", 128, act_order=True, sym=True)]


def packed_weight(case: Int4Case, n: int, k: int, seed: int):
    """(kestrel's Int4Weight read from the published layout, the float weight it must stand for)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1
    order = torch.randperm(k, generator=gen) if case.act_order else None
    tensors, deq = pack_layer(w, case, order)
    cfg = int4_config(case.quantization_config)
    return from_checkpoint(cfg, tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx")), deq


@pytest.mark.parametrize("case", CASES, ids=str)
def test_published_layouts_dequantise_to_the_weights_they_were_packed_from(case):
    w, deq = packed_weight(case, 72, 256, seed=1)
    assert (w.perm is not None) == case.act_order
    assert torch.equal(dequantize(w), deq)


GEMM_CONFIGS = [  # (M, config): defaults (GEMV at M = 1), tl.dot with split K, tiles across group boundaries
    (1, None),
    (5, None),
    (3, dict(block_m=16, block_n=32, block_k=16, split_k=3)),
    (20, dict(block_m=16, block_n=64, block_k=128, split_k=2)),
    (4, dict(block_m=4, block_n=16, block_k=64, split_k=2, dot=False)),
    (1, dict(block_m=1, block_n=16, block_k=64, split_k=2, dot=False)),  # 2 tiles a group at 128
    (3, dict(block_m=4, block_n=32, block_k=128, dot=False)),  # 2, 4 groups a tile at 64, 32
    (1, dict(block_m=1, block_n=16, block_k=32, split_k=3, dot=False, nibbles=True)),  # act-order: x through perm
    (1, dict(block_m=1, block_n=64, block_k=16, dot=False, nibbles=True)),  # N = 40: a masked tile
]


@pytest.mark.parametrize("case", CASES[1:4], ids=str)
@pytest.mark.parametrize("m, cfg", GEMM_CONFIGS)
def test_triton_int4_gemm_equals_the_dequantised_weight_in_torch(case, m, cfg):
    pytest.importorskip("triton")
    from kestrel.layers.int4_gemm_triton import Int4GemmConfig, int4_gemm

    w, deq = packed_weight(case, 40, 256, seed=m)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, 256, generator=gen)
    bias = torch.randn(40, generator=gen)
    got = int4_gemm(x, w.qweight, w.zeros, w.scales, w.perm, w.group_size, bias,
                    Int4GemmConfig(**cfg) if cfg else None)
    torch.testing.assert_close(got, x @ deq.t() + bias, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES[1:4], ids=str)
def test_the_default_takes_the_nibble_gemv_at_one_row_when_set(case, monkeypatch):
    pytest.importorskip("triton")
    from kestrel.layers import int4_gemm_triton as g

    monkeypatch.setattr(g, "NIBBLE_TILE", (32, 128, 4))
    cfg = g.default_config(1, 40, 256, torch.device("cpu"), case.group_size)
    assert cfg.nibbles and cfg.block_k == min(128, case.group_size)
    w, deq = packed_weight(case, 40, 256, seed=3)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5))
    got = g.int4_gemm(x, w.qweight, w.zeros, w.scales, w.perm, w.group_size)
    torch.testing.assert_close(got, x @ deq.t(), atol=2e-5, rtol=1e-5)
    assert not g.default_config(2, 40, 256, torch.device("cpu"), case.group_size).nibbles


def test_the_int4_gemm_refuses_options_outside_their_path():
    pytest.importorskip("triton")
    from kestrel.layers.int4_gemm_triton import Int4GemmConfig, int4_gemm

    w, _ = packed_weight(CASES[1], 40, 256, seed=0)
    x = torch.randn(2, 256)
    for rows, cfg in ((2, Int4GemmConfig(2, 16, 64, dot=False, nibbles=True)),
                      (1, Int4GemmConfig(1, 16, 256, dot=False, nibbles=True)),  # a tile across groups of 128
                      (1, Int4GemmConfig(16, 16, 64, nibbles=True))):
        with pytest.raises(ValueError, match="nibbles and half2 are GEMVs of their own at one row"):
            int4_gemm(x[:rows], w.qweight, w.zeros, w.scales, w.perm, w.group_size, config=cfg)


def test_merged_layer_takes_each_projection_s_columns_and_checks_their_act_order():
    cfg = Int4Config("gptq", 32, desc_act=True, zero_offset=1)
    layer = Int4Linear(64, 48, bias=False, cfg=cfg, shard_sizes=[32, 8, 8])
    assert layer.shard(layer.qweight.data, 1).shape == (8, 8) and layer.shard(layer.qzeros.data, 2).shape == (2, 1)
    assert layer.shard(layer.g_idx.data, 2).shape == (64,)
    layer.g_idx.data[0] = torch.arange(64) // 32
    layer.g_idx.data[1:] = torch.arange(64).flip(0) // 32
    with pytest.raises(ValueError, match="different act-order g_idx"):
        layer.finish_loading("qkv_proj")
    awq = Int4Linear(64, 48, bias=True, cfg=Int4Config("awq", 64), shard_sizes=[32, 16])
    assert awq.shard(awq.qweight.data, 1).shape == (64, 2) and awq.shard(awq.scales.data, 1).shape == (1, 16)
    assert awq.shard(awq.bias.data, 0).shape == (32,)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits=3; kestrel loads 4-bit awq weights only"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 96}, "group_size=96; kestrel loads group sizes 32, 64, 128"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size=-1"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
])
def test_unsupported_int4_configs_are_refused_with_what_was_found(qc, message):
    with pytest.raises(ValueError, match=message):
        int4_config(qc)


def test_half2_is_cuda_only_and_the_default_keeps_the_cpu_off_it(monkeypatch):
    """The fp16x2 GEMV is inline PTX: on the CPU it is refused by name, and HALF2 leaves a CPU config alone.
    (tests/gpu/test_int4_gpu.py checks its numbers.)"""
    pytest.importorskip("triton")
    from kestrel.layers import int4_gemm_triton as g

    case = CASES[1]
    w, _ = packed_weight(case, 40, 256, seed=3)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="CUDA only"):
        g.int4_gemm(x, w.qweight, w.zeros, w.scales, w.perm, w.group_size,
                    config=g.Int4GemmConfig(1, 32, min(128, case.group_size), dot=False, half2=True))
    monkeypatch.setattr(g, "HALF2", True)
    cfg = g.default_config(1, 40, 256, torch.device("cpu"), case.group_size)
    assert cfg.nibbles and not cfg.half2
