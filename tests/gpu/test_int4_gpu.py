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


@pytest.mark.parametrize("case", [Int4Case("awq", 128), Int4Case("gptq", 32, act_order=True)], ids=str)
@pytest.mark.parametrize("block_n, block_k, split", [(64, 128, 8), (128, 32, 1), (32, 64, 4)])
def test_half2_gemv_equals_the_dequantised_weight(case, block_n, block_k, split):
    """The fp16x2 GEMV at one row, with an activation outlier of 3,000 (fp16 products of an unscaled x
    would reach 45,000 and its four-term sums overflow): within 2^-9 of the sum of |products|."""
    from kestrel.layers.int4_gemm_triton import Int4GemmConfig

    w, deq = packed_weight(case, 1000, 2048, seed=block_n + split)
    w = dataclasses.replace(w, **{f.name: getattr(w, f.name).cuda() for f in dataclasses.fields(w)
                                 if isinstance(getattr(w, f.name), torch.Tensor)})
    gen = torch.Generator().manual_seed(block_k)
    x = torch.randn(1, 2048, generator=gen).bfloat16()
    x[0, 77] = 3000.0
    cfg = Int4GemmConfig(1, block_n, min(block_k, case.group_size), split, dot=False, half2=True)
    got = int4_gemm(x.cuda(), w.qweight, w.zeros, w.scales, w.perm, w.group_size, config=cfg).float().cpu()
    want = x.float() @ deq.t()
    bound = 2.0 ** -9 * (x.float().abs() @ deq.abs().t()) + want.abs() * 2.0 ** -8
    err = (got - want).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"
