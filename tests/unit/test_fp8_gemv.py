"""The small-M GEMV path of the Triton FP8 GEMM (interpreter): against the torch reference of the same numerics
and against the tl.dot path, at M in {1, 3, 8}, shapes that no tile divides, split K on and off."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kestrel.layers.fp8_linear import fp8_linear_reference
from kestrel.quant.fp8 import dequantize_blocks, dequantize_token_groups, quantize_blocks, quantize_token_groups

pytest.importorskip("triton")
from kestrel.layers import fp8_gemm_triton  # noqa: E402 - after the skip: triton is optional
from kestrel.layers.fp8_gemm_triton import GemmConfig, GemvConfig, fp8_gemm, gemv  # noqa: E402

CASES = [  # (M, K, N, GemvConfig fields, x dtype, bias): K, N multiples of neither 128 nor the tiles
    (1, 300, 200, dict(block_n=16, block_k=256), torch.float32, False),
    (1, 1000, 72, dict(block_n=8, block_k=128, split_k=3), torch.bfloat16, True),
    (3, 700, 130, dict(block_n=32, block_k=256, split_k=2), torch.float32, True),
    (3, 300, 200, dict(block_n=16, block_k=512, fused_quant=False), torch.bfloat16, False),
    (8, 1000, 72, dict(block_n=8, block_k=256, split_k=2, fused_quant=False), torch.float32, False),
    (8, 260, 100, dict(block_n=64, block_k=128), torch.bfloat16, True),
    (2, 600, 90, None, torch.float32, True),  # default_gemv_config
    (1, 1000, 72, dict(block_n=8, block_k=128, split_k=3, defer_reduce=True), torch.bfloat16, True),
    (1, 300, 200, dict(block_n=32, block_k=256, defer_reduce=True, fused_quant=False), torch.float32, False),
]


def operands(m: int, k: int, n: int, dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k)
    if dtype == torch.bfloat16:
        # bf16 activations (8 significant bits) often land exactly on an FP8 tie, and the reference's torch
        # computes 448 / amax as amax.reciprocal() * 448, an ulp off the kernels' division now and then,
        # which picks the other neighbour. A power-of-two amax per group makes both exact.
        x[:, ::128] = 64.0
    x = x.to(dtype)
    w, w_scale = quantize_blocks(torch.randn(n, k, generator=gen) * 0.1)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, w_scale, b


def summation_bound(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Per output, 1e-5 x the sum of |products|: two float32 sums of the same K products in different
    orders differ by at most (K - 1) x 2**-24 of that (here K <= 1000, so 6e-5; typically far less)."""
    q, s = quantize_token_groups(x.float())
    return 1e-5 * dequantize_token_groups(q, s).abs() @ dequantize_blocks(w, w_scale).abs().t() + 1e-6


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """float32: within `bound`; bfloat16: also one bf16 step of the result (the interpreter's float32 ->
    bf16 store does not round to nearest, so the two roundings may land on neighbouring values)."""
    assert got.dtype == want.dtype
    if got.dtype == torch.bfloat16:
        bound = bound + want.float().abs() * 2.0 ** -7
    err = (got.float() - want.float()).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, {(err > bound).sum().item()} outputs over"


@pytest.mark.parametrize("m, k, n, cfg, dtype, bias", CASES)
def test_gemv_matches_the_torch_reference_and_the_dot_path(m, k, n, cfg, dtype, bias):
    x, w, w_scale, b = operands(m, k, n, dtype, bias)
    config = GemvConfig(**cfg) if cfg else replace(fp8_gemm_triton.default_gemv_config(m, n, k, x.device),
                                                   quantize_x=True)  # the default's rule, with fp8_gemm's numerics
    got = fp8_gemm(x, w, w_scale, b, config)
    bound = summation_bound(x, w, w_scale)
    assert_within(got, fp8_linear_reference(x, w, w_scale, b), bound)
    assert_within(got, fp8_gemm(x, w, w_scale, b, GemmConfig(block_m=16, block_n=32)), bound)


def test_gemv_without_scales_is_a_float_matmul():
    """SCALED off (bf16 decode, bench only): the weight is used as it is, no activation quantization."""
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(3, 300, generator=gen), torch.randn(90, 300, generator=gen), torch.randn(90, generator=gen)
    got = gemv(x, w, None, b, GemvConfig(block_n=32, block_k=64, split_k=2))
    torch.testing.assert_close(got, x @ w.t() + b, atol=1e-4, rtol=1e-5)
    got = gemv(x[:1], w, None, b, GemvConfig(block_n=32, block_k=64, split_k=2, defer_reduce=True))
    torch.testing.assert_close(got, x[:1] @ w.t() + b, atol=1e-4, rtol=1e-5)


def test_gemv_refuses_what_it_cannot_do():
    x, w, w_scale, _ = operands(9, 256, 64, torch.float32, False)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(x, w, w_scale)
    with pytest.raises(ValueError, match="multiple of it"):
        gemv(x[:1], w, w_scale, config=GemvConfig(block_k=64))
    with pytest.raises(ValueError, match="powers of two"):
        gemv(x[:1], w, w_scale, config=GemvConfig(block_n=24))
    with pytest.raises(ValueError, match="one row of x"):
        gemv(x[:2], w, w_scale, config=GemvConfig(defer_reduce=True))


def test_default_config_hands_m_up_to_gemv_max_m_to_the_gemv(monkeypatch):
    """Moving the threshold is one constant; measured: the GEMV at M = 1 (batch-1 decode), tl.dot above."""
    cpu = torch.device("cpu")
    assert isinstance(fp8_gemm_triton.default_config(1, 4096, 4096, cpu), GemvConfig)
    assert isinstance(fp8_gemm_triton.default_config(2, 4096, 4096, cpu), GemmConfig)
    monkeypatch.setattr(fp8_gemm_triton, "GEMV_MAX_M", 4)
    assert isinstance(fp8_gemm_triton.default_config(4, 4096, 4096, cpu), GemvConfig)
    assert isinstance(fp8_gemm_triton.default_config(5, 4096, 4096, cpu), GemmConfig)


@pytest.mark.parametrize("cfg", [dict(block_n=16, block_k=256), dict(block_n=8, block_k=128, split_k=3, defer_reduce=True)])
def test_gemv_without_quantizing_x_is_x_times_the_dequantized_weight(cfg):
    """quantize_x False (W8A16): x as it is against the block-scaled weight, not x rounded to e4m3."""
    x, w, w_scale, b = operands(1, 1000, 72, torch.float32, True)
    got = gemv(x, w, w_scale, b, GemvConfig(**cfg, quantize_x=False))
    want = x @ dequantize_blocks(w, w_scale).t() + b
    bound = 1e-5 * x.abs() @ dequantize_blocks(w, w_scale).abs().t() + 1e-6
    assert_within(got, want, bound)
    quantized = gemv(x, w, w_scale, b, GemvConfig(**cfg))  # the default rounds x: a different (coarser) product
    assert not (quantized - want).abs().le(bound).all()


def test_the_default_at_one_row_is_w8a16_and_takes_the_tuned_shapes_on_cuda(monkeypatch):
    monkeypatch.setattr(fp8_gemm_triton, "sm_count", lambda device: 132)  # no GPU here: the H100's count
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not fp8_gemm_triton.default_gemv_config(1, 4096, 4096, cpu).quantize_x
    tuned = replace(fp8_gemm_triton.ONE_ROW_TUNED[4096, 4096], quantize_x=False)
    assert fp8_gemm_triton.default_gemv_config(1, 4096, 4096, cuda) == tuned
    assert fp8_gemm_triton.default_gemv_config(1, 4096, 4096, cpu) != tuned
    assert fp8_gemm_triton.default_gemv_config(2, 4096, 4096, cuda) != tuned
