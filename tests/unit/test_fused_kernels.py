"""Fused Triton elementwise kernels == the torch path (interpreter on CPU, CUDA when present)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from kestrel.layers.activation import SiluAndMul  # noqa: E402
from kestrel.layers.norm import RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rmsnorm_equals_torch(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    torch_norm, fused = RMSNorm(hidden, 1e-5), RMSNorm(hidden, 1e-5, use_triton=True)
    weight = torch.randn(hidden, generator=gen)
    torch_norm.weight.data, fused.weight.data = weight.clone(), weight.clone()
    torch_norm, fused = torch_norm.to(DEVICE, dtype), fused.to(DEVICE, dtype)
    x = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(fused(x), torch_norm(x))
    out, new_residual = fused(x, residual.clone())
    ref_out, ref_residual = torch_norm(x, residual.clone())
    torch.testing.assert_close(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torch(dtype):
    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    torch.testing.assert_close(SiluAndMul(use_triton=True)(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear(dtype, bias):
    """One-row Linear through the Triton GEMV == torch's GEMM; N and K not multiples of the blocks."""
    from kestrel.layers.linear import Linear

    gen = torch.Generator().manual_seed(1)
    ref = torch.nn.Linear(700, 37, bias=bias)
    fused = Linear(700, 37, bias=bias, use_gemv=True)
    fused.load_state_dict(ref.state_dict())
    ref, fused = ref.to(DEVICE, dtype), fused.to(DEVICE, dtype)
    x = torch.randn(1, 700, generator=gen).to(DEVICE, dtype)
    assert fused.gemv is not None
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {}  # another summation order
    torch.testing.assert_close(fused(x), ref(x), **tol)
    batch = torch.randn(3, 700, generator=gen).to(DEVICE, dtype)  # more rows: torch's GEMM
    torch.testing.assert_close(fused(batch), ref(batch))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_silu_mul_and_float_logits(dtype):
    from kestrel.layers.gemv_triton import gemv

    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(2 * 300, 260, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(2 * 300, generator=gen).to(DEVICE, dtype)
    x = torch.randn(1, 260, generator=gen).to(DEVICE, dtype)
    # The GEMV sums in another order than torch's GEMM: float32 results agree to rounding.
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {}
    fused = gemv(x, weight, bias, silu_mul=True, block_k=128)
    torch.testing.assert_close(fused, SiluAndMul()(torch.nn.functional.linear(x, weight, bias)), **tol)
    logits = gemv(x, weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, torch.nn.functional.linear(x, weight).float(), **tol)
