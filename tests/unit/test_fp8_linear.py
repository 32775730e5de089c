"""FP8 linear layers: block quantization, the layer against a float reference within FP8's error bound,
and the Triton GEMM (interpreter) against the torch reference of the same numerics."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kestrel.layers.fp8_linear import Fp8Linear, fp8_linear_reference
from kestrel.layers.linear import MergedLinear
from kestrel.quant.fp8 import dequantize_blocks, quantize_blocks, quantize_token_groups

E4M3 = torch.finfo(torch.float8_e4m3fn)


def rounding_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest error of rounding x / scale to e4m3 and back: half a step, which is eps/2 of |x| in the
    normal range and half the subnormal step (2**-10 in units of the scale) below it."""
    return torch.maximum(x.abs() * E4M3.eps / 2, scale * 2.0 ** -10)


def test_block_quantization_maps_each_block_amax_to_448_and_round_trips_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 1, 200)  # columns of very different sizes
    q, scale_inv = quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    for i in range(3):
        for j in range(2):
            block = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert scale_inv[i, j] == block.abs().max() / 448
    back = dequantize_blocks(q, scale_inv)
    full_scale = scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - w).abs() <= rounding_bound(w, full_scale) * (1 + 1e-6)).all()


def test_fp8_linear_is_within_the_fp8_error_bound_of_the_float_layer():
    """|y_fp8 - y| <= sum_k |x_k| e_w + e_x |w_k| + e_x e_w, with e the rounding bound of each operand
    (its block or token-group scale): the bound holds per output, whatever the inputs."""
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(300, 260, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(260, 300, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(260, generator=gen))
    x = torch.randn(7, 300, generator=gen) * torch.logspace(-2, 1, 300)
    layer = Fp8Linear.from_linear(linear, use_triton=False)
    got = layer(x)
    want = linear(x)

    w_scale = layer.weight_scale_inv.repeat_interleave(128, 0)[:260].repeat_interleave(128, 1)[:, :300]
    e_w = rounding_bound(linear.weight.detach(), w_scale)
    _, x_scales = quantize_token_groups(x)
    e_x = rounding_bound(x, x_scales.repeat_interleave(128, 1)[:, :300])
    bound = x.abs() @ e_w.t() + e_x @ linear.weight.detach().abs().t() + e_x @ e_w.t()
    err = (got - want).abs()
    assert (err <= bound * 1.001 + 1e-5).all()
    assert err.max() > 0.01 * bound.max()  # the layer really ran in FP8


def test_merged_fp8_layer_takes_its_parts_rows_and_scale_rows_on_block_boundaries():
    layer = Fp8Linear(64, 384, bias=False, shard_sizes=[256, 128])
    assert layer.shard(layer.weight_scale_inv.data, 1).shape == (1, 1)
    assert layer.shard(layer.weight.data, 0).shape == (256, 64)
    unaligned = Fp8Linear(64, 192, bias=False, shard_sizes=[64, 128])
    assert unaligned.shard(unaligned.weight.data, 1).shape == (128, 64)
    with pytest.raises(ValueError, match="128-row boundary"):
        unaligned.shard(unaligned.weight_scale_inv.data, 1)


def test_online_quantization_keeps_merged_shards_and_bias():
    merged = MergedLinear(96, [64, 32, 32], bias=True)
    layer = Fp8Linear.from_linear(merged, use_triton=False)
    assert layer.shard_sizes == [64, 32, 32] and torch.equal(layer.bias, merged.bias.detach())
    assert layer.weight.shape == (128, 96) and layer.weight_scale_inv.shape == (1, 1)


GEMM_CASES = [  # (M, K, N, config): fused activation quantization, split K, the pre-quantizing path
    (3, 300, 200, None),
    (5, 1024, 96, dict(block_m=16, block_n=32, split_k=3)),
    (20, 256, 130, dict(block_m=16, block_n=128, fused_quant=False)),
]


@pytest.mark.parametrize("m, k, n, cfg", GEMM_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_fp8_gemm_matches_the_torch_reference(m, k, n, cfg, bias):
    pytest.importorskip("triton")
    from kestrel.layers.fp8_gemm_triton import GemmConfig, fp8_gemm

    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k)
    w, w_scale = quantize_blocks(torch.randn(n, k, generator=gen) * 0.1)
    b = torch.randn(n, generator=gen) if bias else None
    got = fp8_gemm(x, w, w_scale, b, GemmConfig(**cfg) if cfg else None)
    torch.testing.assert_close(got, fp8_linear_reference(x, w, w_scale, b), atol=1e-4, rtol=1e-5)


def test_triton_activation_quantization_is_bit_exact():
    pytest.importorskip("triton")
    from kestrel.layers.fp8_gemm_triton import quantize_activations

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(19, 300, generator=gen) * torch.logspace(-3, 2, 300)
    q, s = quantize_activations(x)
    q_ref, s_ref = quantize_token_groups(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
