"""Programmatic dependent launch (kestrel/pdl.py) on the GPU: on where the GPU and Triton allow it, and a chain
of taking-part kernels, each reading what the one before wrote, gives under CUDA graph replays exactly what it
gives launched one by one without PDL (a kernel that read before its wait would see stale values)."""
from __future__ import annotations

import pytest
import torch

from kestrel import pdl
from kestrel.layers.fp8_gemm_triton import GemvConfig, gemv
from kestrel.layers.fused_triton import add_rmsnorm, silu_and_mul
from kestrel.sampling.argmax_triton import argmax_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_pdl_is_on_from_hopper_on(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    cuda = torch.device("cuda")
    assert pdl.on(cuda) == (torch.cuda.get_device_capability()[0] >= 9)


def _chain(x, residual, norm_w, w_up, w_down, layers):
    for _ in range(layers):
        h = add_rmsnorm(x, residual, norm_w, 1e-6)
        act = silu_and_mul(gemv(h, w_up, config=GemvConfig(8, 512, 1, defer_reduce=True)))
        # K split in 4: the split partials' sum is a kernel of its own, reading the GEMV's partials.
        x = gemv(act, w_down, config=GemvConfig(8, 512, 4))
    return x, argmax_rows(x.float())


def test_a_graphed_pdl_chain_equals_the_plain_one(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    d, inter, layers = 1024, 2048, 6

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) * scale

    norm_w, w_up, w_down = rand(d), rand(2 * inter, d, scale=0.03), rand(d, inter, scale=0.03)
    inputs = [(rand(1, d), rand(1, d)) for _ in range(5)]

    monkeypatch.setattr(pdl, "ENABLED", False)
    want = []
    for x, r in inputs:
        res = r.clone()
        out, best = _chain(x.clone(), res, norm_w, w_up, w_down, layers)
        want.append((out.clone(), best.clone(), res.clone()))

    monkeypatch.setattr(pdl, "ENABLED", True)
    x_in, res_in = torch.zeros(1, d, device="cuda", dtype=torch.bfloat16), torch.zeros(1, d, device="cuda",
                                                                                       dtype=torch.bfloat16)
    _chain(x_in.clone(), res_in.clone(), norm_w, w_up, w_down, layers)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, best = _chain(x_in, res_in, norm_w, w_up, w_down, layers)
    for (x, r), (want_out, want_best, want_res) in zip(inputs, want):
        x_in.copy_(x)
        res_in.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want_out)
        assert torch.equal(best, want_best)
        assert torch.equal(res_in, want_res)


def test_the_int4_one_row_gemv_with_pdl_equals_it_without(monkeypatch):
    from kestrel.layers.int4_gemm_triton import default_config, int4_gemm

    gen = torch.Generator(device="cuda").manual_seed(1)
    k, n, group = 4096, 6144, 128
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, device="cuda", dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen, device="cuda", dtype=torch.uint8)
    scales = torch.rand(k // group, n, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.01
    x = torch.randn(1, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    cfg = default_config(1, n, k, x.device, group)
    assert cfg.half2
    monkeypatch.setattr(pdl, "ENABLED", False)
    want = int4_gemm(x, qweight, zeros, scales, None, group, config=cfg)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert torch.equal(int4_gemm(x, qweight, zeros, scales, None, group, config=cfg), want)
