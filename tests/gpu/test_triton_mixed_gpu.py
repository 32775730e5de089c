"""A MIXED step's decodes through the decode kernel on CUDA (bf16, the Llama-3.1-8B attention shape):
the same output as the extend kernel serving the whole batch and as torch_native, and the same stored K/V."""
from __future__ import annotations

import pytest
import torch

from kestrel.attention import triton_backend
from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.attention import AttentionLayer
from tests.unit.test_sdpa_backend import paged_batch, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_decodes_through_the_decode_kernel_on_cuda(page_size, monkeypatch):
    gen = torch.Generator().manual_seed(page_size)
    prefixes, extends = [0, 700] + [300 + 37 * i for i in range(40)], [512, 200] + [1] * 40
    shape = (32, 8, 128)
    layer = AttentionLayer(0, 32, 8, 128, scaling=128 ** -0.5)
    pools, req_to_token, batch, qkv = paged_batch(prefixes, extends, page_size, gen, mode=ForwardMode.MIXED,
                                                  shape=shape, device="cuda", dtype=torch.bfloat16)
    split_pools, whole_pools = pools.clone(), pools.clone()
    monkeypatch.setattr(triton_backend, "DECODE_KERNEL_FOR_MIXED_DECODES", True)
    split = run(triton_backend.TritonBackend, split_pools, req_to_token, batch, qkv, layer, upcast=False)
    assert batch.attn_backend._decode_tail == 40
    monkeypatch.setattr(triton_backend, "DECODE_KERNEL_FOR_MIXED_DECODES", False)
    whole = run(triton_backend.TritonBackend, whole_pools, req_to_token, batch, qkv, layer, upcast=False)
    assert batch.attn_backend._decode_tail == 0
    want = run(TorchNativeBackend, pools, req_to_token, batch, qkv, layer)
    assert torch.equal(split_pools.kv.k, pools.kv.k) and torch.equal(split_pools.kv.v, pools.kv.v)
    torch.testing.assert_close(split, whole, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(split.float(), want.float(), atol=2e-2, rtol=2e-2)
