"""MLA attention (kestrel.layers.mla) on the torch_native backend against a naive dense reference on
random weights: decode, extend after a cached prefix, mixed lengths, page sizes 1 and 4, FP8 entries,
a tensor-parallel rank's heads; the latent KV layout; the backend fit rules."""
from __future__ import annotations

import pytest
import torch

from kestrel.attention.mla.torch_native import TorchNativeMLABackend
from kestrel.cache.kv_layout import KVLayout
from kestrel.core.forward_mode import ForwardMode
from kestrel.layers.mla import MLAAttention
from tests.unit.mla_cases import HEADS, NOPE, RANK, ROPE, V_DIM, make_case, reference, run

CASES = {
    "decode": ([5, 12, 1], [1, 1, 1]),
    "extend_after_prefix": ([0, 7, 9], [6, 3, 1]),
    "prefill": ([0], [9]),
}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_native_mla_matches_dense_reference(name, page_size):
    prefix, extend = CASES[name]
    case = make_case(prefix, extend, page_size)
    out = run(TorchNativeMLABackend(case.pools, case.req_to_token, name="torch_native"), case)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)
    # The new tokens' entries are in the pool, latent first, then the rope key.
    stored = case.pools.layer(0).latent[case.batch.out_cache_loc]
    torch.testing.assert_close(stored, torch.cat([case.latent, case.k_rope], dim=-1))


def test_fp8_entries_are_what_attention_reads():
    case = make_case([4, 10], [1, 1], page_size=4, pool_dtype=torch.float8_e4m3fn)
    assert case.pools.layer(0).latent.dtype == torch.float8_e4m3fn
    out = run(TorchNativeMLABackend(case.pools, case.req_to_token, name="torch_native"), case)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


def test_verify_tree_mask_is_honoured():
    """A chain-shaped tree is causal: the same answer as a plain extend."""
    case = make_case([6, 3], [3, 2], page_size=1, mode=ForwardMode.TARGET_VERIFY)
    backend = TorchNativeMLABackend(case.pools, case.req_to_token, name="torch_native")
    expected = reference(case)
    case.batch.tree_mask = torch.cat([torch.tril(torch.ones(3, 3, dtype=torch.bool)).flatten(),
                                      torch.tril(torch.ones(2, 2, dtype=torch.bool)).flatten()])
    case.batch.tree_mask_starts = torch.tensor([0, 9])
    torch.testing.assert_close(run(backend, case).double(), expected, atol=1e-5, rtol=1e-5)


def test_a_tensor_parallel_rank_serves_its_heads_over_the_whole_latent():
    case = make_case([3, 8], [2, 1], page_size=1)
    full = reference(case).view(-1, HEADS, V_DIM)
    rank_layer = MLAAttention(0, 2, NOPE, ROPE, V_DIM, RANK, case.layer.scaling, first_head=2)
    # The rank's loader keeps its heads' rows of the whole checkpoint tensor.
    assert rank_layer.tensor_loader().load("kv_b_proj.weight", lambda: case.layer.kv_b_proj.detach()) == ["kv_b_proj"]
    case.batch.attn_backend = TorchNativeMLABackend(case.pools, case.req_to_token, name="torch_native")
    out = rank_layer(case.q_nope[:, 2:], case.q_rope[:, 2:], case.latent, case.k_rope, case.batch)
    torch.testing.assert_close(out.double().view(-1, 2, V_DIM), full[:, 2:], atol=1e-5, rtol=1e-5)


def test_latent_layout_is_one_entry_per_token_per_layer():
    layout = KVLayout.latent_attention(3, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    assert layout.latent and not KVLayout.full_attention(3, 1, 64, torch.bfloat16).latent
    assert layout.bytes_per_token == 3 * (512 + 64) * 2
    fp8 = KVLayout.latent_attention(3, kv_lora_rank=512, rope_dim=64, dtype=torch.float8_e4m3fn)
    assert fp8.bytes_per_token == 3 * (512 + 64)


def test_mla_backend_refuses_a_per_head_layout():
    case = make_case([2], [1], page_size=1)
    with pytest.raises(ValueError, match="needs a latent KV layout"):
        from kestrel.cache.kv_memory import KVPools
        TorchNativeMLABackend(KVPools(KVLayout.full_attention(1, 1, 8, torch.float32), 8, 2, "cpu"),
                              case.req_to_token, name="torch_native")
