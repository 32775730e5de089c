"""The dsv4 backend's products on CUDA: logits of half inputs come back in float32 and unrounded (the
out_dtype path of torch.mm / bmm) at the decode and prefill-tile layouts `attend` uses; the packed FP8
KV entries encode and decode on CUDA to the same bytes and values as on the CPU (the CPU tests' oracle)."""
from __future__ import annotations

import torch

from kestrel.attention.dsv4 import _fp32_out, logits_f32
from kestrel.quant.kv_entries import RopeEntryFP8, ScaledKeyFP8


def test_logits_are_float32_and_not_rounded_to_bf16() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    q = torch.randn(32, 64, 512, generator=gen, device=dev).bfloat16()
    keys = torch.randn(32, 640, 512, generator=gen, device=dev).bfloat16()
    assert _fp32_out(dev), "torch.bmm(..., out_dtype=float32) unavailable: logits are rounded to bf16"
    cases = [(logits_f32(q, keys.transpose(1, 2)), q.float() @ keys.float().transpose(1, 2)),
             (logits_f32(q.flatten(0, 1), keys[0].T), q.flatten(0, 1).float() @ keys[0].float().T)]
    for got, want in cases:
        assert got.dtype == torch.float32
        # bf16 rounding of logits of size ~20 would be ~0.06; fp32 accumulation differs by ~1e-4.
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)


def test_fp8_entries_are_the_same_bytes_on_cuda_as_on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 512, generator=gen) * torch.exp2(torch.randint(-10, 10, (64, 1), generator=gen))).bfloat16()
    for codec, values in ((RopeEntryFP8(512, 64), x), (ScaledKeyFP8(128), x[:, :128])):
        on_cpu, on_cuda = codec.encode(values), codec.encode(values.cuda())
        differ = (on_cuda.cpu() != on_cpu).nonzero()
        assert differ.numel() == 0, (f"{type(codec).__name__}: {differ.shape[0]} bytes differ, first at "
                                     f"{differ[:5].tolist()}: cuda {on_cuda.cpu()[tuple(differ[:5].T)].tolist()} "
                                     f"cpu {on_cpu[tuple(differ[:5].T)].tolist()}")
        assert torch.equal(codec.decode(on_cuda, torch.bfloat16).cpu(), codec.decode(on_cpu, torch.bfloat16))
