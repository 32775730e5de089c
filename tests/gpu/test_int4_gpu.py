"""The W4A16 Triton GEMM compiled for the GPU: bf16 activations at decode and prefill row counts against
the dequantised weight in float32 torch (the GEMM rounds x and the tile to bf16 for tl.dot; the GEMV
multiplies in float32)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kestrel.layers.int4_gemm_triton import int4_gemm
from tests.int4_checkpoint import Int4Case
from tests.unit.test_int4 import packed_weight


@pytest.mark.parametrize("case", [Int4Case("awq", 128), Int4Case("gptq", 32, act_order=True)], ids=str)
@pytest.mark.parametrize("m", [1, 4, 16, 64, 300])
def test_int4_gemm_on_cuda_equals_the_dequantised_weight(case, m):
    w, deq = packed_weight(case, 1024, 2048, seed=m)
    w = dataclasses.replace(w, **{f.name: getattr(w, f.name).cuda() for f in dataclasses.fields(w)
                                 if isinstance(getattr(w, f.name), torch.Tensor)})
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, 2048, generator=gen).bfloat16()
    got = int4_gemm(x.cuda(), w.qweight, w.zeros, w.scales, w.perm, w.group_size).float().cpu()
    want = x.float() @ deq.t()
    torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=2e-2)
