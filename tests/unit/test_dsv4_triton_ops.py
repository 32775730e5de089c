"""V4's rope, and its norms followed by the rope, as Triton kernels (interpreter on CPU) == their torch forms,
at V4's shapes: q [T, heads, D] and kv [T, D] with a rope part, the inverse rope on the attention output;
bf16 rounding too where CUDA is present."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from kestrel import envs  # noqa: E402
from kestrel.models.deepseek_v4.config import YarnConfig  # noqa: E402
from kestrel.models.deepseek_v4.rope import V4Rope  # noqa: E402
from kestrel.layers.norm import RMSNorm  # noqa: E402
from kestrel.models.deepseek_v4.triton_ops import norm_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not envs.triton_interpret(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 4, 96), (5, 96), (1, 2, 40)], ids=["q", "kv", "small"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("yarn", [None, YarnConfig(16.0, 64, 32.0, 1.0)], ids=["plain", "yarn"])
def test_triton_rope_equals_the_torch_rope(dtype, shape, inverse, yarn):
    gen = torch.Generator().manual_seed(sum(shape))
    rope_dim = 32 if shape[-1] > 40 else 16
    torch_rope = V4Rope(rope_dim, 10000.0, yarn).to(DEVICE)
    triton_rope = V4Rope(rope_dim, 10000.0, yarn).to(DEVICE)
    triton_rope.triton = True
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 7, 1000, 65537, 3][:shape[0]], device=DEVICE)
    got, want = triton_rope(x, positions, inverse), torch_rope(x, positions, inverse)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)
    assert torch.equal(got[..., :-rope_dim], x[..., :-rope_dim])
    back = triton_rope(got, positions, not inverse)
    torch.testing.assert_close(back, x, atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True], ids=["head-norm", "rmsnorm"])
def test_norm_then_rope_in_one_kernel_equals_the_torch_forms(dtype, weighted):
    gen = torch.Generator().manual_seed(0)
    shape = (3, 96) if weighted else (3, 4, 96)
    x = (torch.randn(shape, generator=gen) * torch.linspace(0.1, 10, shape[-2])[:, None]).to(DEVICE, dtype)
    positions = torch.tensor([5, 70000, 1], device=DEVICE)
    rope = V4Rope(32, 10000.0, YarnConfig(16.0, 64, 32.0, 1.0)).to(DEVICE)
    eps = 1e-6
    if weighted:
        norm = RMSNorm(96, eps).to(DEVICE, dtype)
        norm.weight.data = torch.rand(96, generator=gen).to(DEVICE, dtype) + 0.5
        want, weight = rope(norm(x), positions), norm.weight
    else:
        want, weight = rope(x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype), positions), None
    got = norm_rope(x, weight, eps, positions, rope.omega, 32)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)
