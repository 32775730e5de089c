"""The one-row GEMV compiled for the GPU at Llama-3.1-8B's projection and head shapes, bf16, against F.linear
(cuBLAS) on the same inputs; and a routed decoder layer's output against the unrouted one's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kestrel.layers.one_row_gemv import route_one_row_linears

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)])
def test_the_one_row_gemv_equals_f_linear(k, n):
    gen = torch.Generator(device="cuda").manual_seed(n)
    layer = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer.weight.data = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float())
    assert route_one_row_linears(layer) == 1
    with torch.no_grad():
        got = layer(x).float()
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_gated_down_equals_the_activation_kernel_then_the_down_gemv(fp8, monkeypatch):
    """Llama-3.1-8B's down projection at one row with the activation inside the GEMV, bit for bit."""
    from kestrel.layers import one_row_gemv
    from kestrel.layers.fp8_linear import Fp8Linear
    from kestrel.layers.fused_triton import silu_and_mul
    from kestrel.layers.one_row_gemv import gated_down

    monkeypatch.setattr(one_row_gemv, "GATED_DOWN", True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    layer = nn.Linear(14336, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    layer.weight.data = torch.randn(4096, 14336, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    if fp8:
        layer = Fp8Linear.from_linear(layer, use_triton=True)
    else:
        assert route_one_row_linears(layer) == 1
    h = torch.randn(1, 2 * 14336, generator=gen, device="cuda", dtype=torch.bfloat16) * 2
    with torch.no_grad():
        want = layer(silu_and_mul(h))
        got = gated_down(layer, h)
    assert torch.equal(got, want)
