"""Tensor/expert parallelism without processes: the flags' validation and each rank's share."""
from __future__ import annotations

import json

import pytest

from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.distributed.parallel_state import ParallelState
from kestrel.layers.linear import Slice, attention_heads, qkv_slices
from kestrel.models.deepseek_v4.loading import is_remote_expert

LLAMA = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 128, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 64}


def resolve(tmp_path, hf=LLAMA, **kw) -> EngineConfig:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return resolve_config(EngineConfig.from_flat(model=str(tmp_path), device="cpu", **kw))


@pytest.mark.parametrize("flags, message", [
    ({"tp_size": 3}, "must divide the model's num_attention_heads"),
    ({"tp_size": 0}, "tp_size must be >= 1"),
    ({"tp_size": 2, "ep_size": 2}, "this model has none"),
    ({"tp_size": 4, "ep_size": 2}, "ep_size must be 1 or tp_size"),
    ({"tp_size": 2, "nnodes": 2}, "dist_init_addr"),
    ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank must be in"),
    ({"tp_size": 2, "speculative_algorithm": "NGRAM"}, "speculative decoding with tensor parallelism"),
    ({"tp_size": 2, "quantization": "fp8"}, "with tensor parallelism"),
])
def test_parallel_flags_that_do_not_fit_are_refused_at_resolve(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        resolve(tmp_path, **flags)


def test_deepseek_v4_needs_ep_size_equal_to_tp_size(tmp_path):
    from tests.model.dsv4_reference import RefConfig

    # A whole config: resolve() reads the model's KV layout for the page size first.
    hf = {**RefConfig().native_config(), "architectures": ["DeepseekV4ForCausalLM"]}
    with pytest.raises(ValueError, match="set ep_size = tp_size = 2"):
        resolve(tmp_path, hf, tp_size=2, attention_backend="dsv4")


@pytest.mark.parametrize("kv_heads, tp, expected", [
    (8, 2, [(4, 4, 0), (4, 4, 4)]),  # split evenly
    (2, 4, [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]),  # fewer KV heads than ranks: each kept twice
    (1, 2, [(4, 1, 0), (4, 1, 0)]),
])
def test_each_rank_keeps_the_kv_heads_its_query_heads_read(kv_heads, tp, expected):
    shares = [attention_heads(8, kv_heads, ParallelState(rank, tp)) for rank in range(tp)]
    assert shares == expected
    for rank, (heads, kv, first_kv) in enumerate(shares):
        group = 8 // kv_heads  # query heads per KV head
        assert {(rank * heads + h) // group for h in range(heads)} == set(range(first_kv, first_kv + kv))
        q, k, v = qkv_slices(8, kv_heads, 16, ParallelState(rank, tp))
        assert q == Slice(0, rank * heads * 16, heads * 16) and k == v == Slice(0, first_kv * 16, kv * 16)


def test_a_rank_skips_the_experts_another_rank_holds():
    names = [f"layers.0.ffn.experts.{e}.w1.weight" for e in range(8)] + ["layers.0.ffn.experts.5.w2.scale"]
    rank1 = ParallelState(1, 2, ep_size=2)
    assert [is_remote_expert(n, 8, rank1) for n in names] == [True] * 4 + [False] * 4 + [False]
    assert not is_remote_expert("layers.0.ffn.shared_experts.w1.weight", 8, rank1)
    assert not any(is_remote_expert(n, 8, ParallelState()) for n in names)
