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
