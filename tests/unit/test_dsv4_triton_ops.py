"""V4's rope and head norm as Triton kernels (interpreter on CPU) == their torch forms, at V4's widths and
shapes: q [T, heads, 512] and kv [T, 512] with 64 rope dims, the inverse rope on the attention output, the
compressor's float32 entries; the head norm's rounding in bf16 where CUDA is present."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from kestrel import envs  # noqa: E402
from kestrel.models.deepseek_v4.config import YarnConfig  # noqa: E402
from kestrel.models.deepseek_v4.rope import V4Rope  # noqa: E402
from kestrel.models.deepseek_v4.triton_ops import head_rms_scale  # noqa: E402

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
def test_head_rms_scale_equals_the_torch_form(dtype):
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(3, 4, 96, generator=gen) * torch.linspace(0.1, 10, 4)[None, :, None]).to(DEVICE, dtype)
    eps = 1e-6
    want = q * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + eps).to(q.dtype)
    got = head_rms_scale(q, eps)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, want)
