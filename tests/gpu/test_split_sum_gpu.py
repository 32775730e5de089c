"""Split-K partials summed in the kernel (fp8_gemm_triton.SPLITS_SUMMED_IN_KERNEL) on the GPU, where the
programs of a column block really race: the FP8 GEMV and the int4 GEMVs at Llama-3.1-8B shapes, launched
many times eagerly and replayed from a CUDA graph, equal to the bit to the second launch's sum."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kestrel.layers import fp8_gemm_triton
from kestrel.layers.fp8_gemm_triton import GemvConfig, gemv
from kestrel.layers.int4_gemm_triton import Int4GemmConfig, int4_gemm
from kestrel.quant.fp8 import quantize_blocks
from tests.int4_checkpoint import Int4Case
from tests.unit.test_int4 import packed_weight


def _check(call, monkeypatch):
    want = call().clone()
    monkeypatch.setattr(fp8_gemm_triton, "SPLITS_SUMMED_IN_KERNEL", True)
    monkeypatch.setattr(fp8_gemm_triton, "_arrivals", {})
    for _ in range(50):
        assert torch.equal(call(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(50):
        graph.replay()
        assert torch.equal(out, want)
    assert not next(iter(fp8_gemm_triton._arrivals.values())).any()


@pytest.mark.parametrize("split", [2, 4, 8])
def test_fp8_gemv_splits_summed_in_the_kernel(split, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(split)
    x = torch.randn(1, 14336, generator=gen, device="cuda", dtype=torch.bfloat16)
    w, scale = quantize_blocks(torch.randn(4096, 14336, generator=gen, device="cuda") * 0.02)
    bias = torch.randn(4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(32, 512, split, num_warps=8, quantize_x=False)
    _check(lambda: gemv(x, w, scale, bias, cfg), monkeypatch)


@pytest.mark.parametrize("half2", [False, True])
def test_int4_gemv_splits_summed_in_the_kernel(half2, monkeypatch):
    w, _ = packed_weight(Int4Case("awq", 128), 4096, 4096, seed=1)
    w = dataclasses.replace(w, **{f.name: getattr(w, f.name).cuda() for f in dataclasses.fields(w)
                                 if isinstance(getattr(w, f.name), torch.Tensor)})
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    cfg = Int4GemmConfig(1, 64, 128, 8, dot=False, nibbles=not half2, half2=half2)
    _check(lambda: int4_gemm(x, w.qweight, w.zeros, w.scales, w.perm, w.group_size, config=cfg), monkeypatch)
