"""A MIXED step through the Triton backend: its prefill chunks take the extend kernel, its decodes (the
last requests, one new token each) the decode kernel. Against torch_native over the same pool (outputs and
stored K/V), in the interpreter, float32 and FP8 pools, with a sliding window and attention sinks."""
from __future__ import annotations

import pytest
import torch

from kestrel.attention import triton_backend
from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer
from tests.unit.test_fp8_kv import HEAD_DIM, KV_HEADS, _clone, _filled_pools, make_batch

pytest.importorskip("triton")

CASES = [  # prefix lens, extend lens, query heads per KV head, sliding window, sinks, decodes served by the decode kernel
    ([0, 12, 40, 70], [20, 1, 1, 1], 2, None, False, 3),
    ([3, 50, 9, 33, 0], [17, 24, 1, 1, 1], 4, 8, True, 3),
    ([5, 0, 44], [1, 30, 1], 1, None, False, 1),  # a one-token chunk before a long one stays with the extend kernel
    ([7, 30, 61], [5, 1, 1], 2, None, False, 2),  # a chunk short enough for the extend kernel's split variant
    ([0, 19, 52, 8], [1, 1, 1, 1], 2, 16, True, 4),  # every request one token (a one-token chunk among decodes)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("prefix, extend, group, window, sinks, tail", CASES)
def test_mixed_step_decodes_through_the_decode_kernel_match_torch_native(dtype, prefix, extend, group, window,
                                                                         sinks, tail, monkeypatch):
    monkeypatch.setattr(triton_backend, "DECODE_KERNEL_FOR_MIXED_DECODES", True)
    gen = torch.Generator().manual_seed(sum(prefix) + group)
    pools = _filled_pools(dtype, *((1.0, 1.0) if dtype == torch.float32 else (0.75, 0.05)), gen)
    batch, r2t = make_batch(ForwardMode.MIXED, prefix, extend, gen)
    heads = KV_HEADS * group
    layer = AttentionLayer(0, heads, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=window, sinks=sinks)
    if sinks:
        layer.sinks.data = torch.randn(heads, generator=gen)
    tokens = sum(extend)
    q = torch.randn(tokens, heads * HEAD_DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS * HEAD_DIM, generator=gen) * 2
    v = torch.randn(tokens, KV_HEADS * HEAD_DIM, generator=gen)
    native_pools, triton_pools = pools, _clone(pools)
    want = TorchNativeBackend(native_pools, r2t).forward(q, k, v, layer, batch)
    triton = triton_backend.TritonBackend(triton_pools, r2t, upcast=True)
    triton.init_forward_metadata(batch)
    assert triton._decode_tail == tail
    got = triton.forward(q, k, v, layer, batch)
    for name in ("k", "v"):
        stored, expected = getattr(triton_pools.layer(0), name), getattr(native_pools.layer(0), name)
        assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_without_host_lengths_the_extend_kernel_serves_the_whole_batch(monkeypatch):
    """A captured forward has no host lengths: nothing is split (and the switch turns the split off)."""
    monkeypatch.setattr(triton_backend, "DECODE_KERNEL_FOR_MIXED_DECODES", True)
    gen = torch.Generator().manual_seed(0)
    batch, r2t = make_batch(ForwardMode.MIXED, [0, 12, 40], [20, 1, 1], gen)
    pools = _filled_pools(torch.float32, 1.0, 1.0, gen)
    backend = triton_backend.TritonBackend(pools, r2t, upcast=True)
    backend.init_forward_metadata(batch)
    assert backend._decode_tail == 2
    batch.extend_lens_cpu = None
    backend.init_forward_metadata(batch)
    assert backend._decode_tail == 0
    batch.extend_lens_cpu = [20, 1, 1]
    monkeypatch.setattr(triton_backend, "DECODE_KERNEL_FOR_MIXED_DECODES", False)
    backend.init_forward_metadata(batch)
    assert backend._decode_tail == 0
