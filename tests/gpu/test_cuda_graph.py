"""CUDA-graph decode == eager decode; fused kernels == reference; dummy 8B greedy across backends."""
from __future__ import annotations

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.core.forward_mode import ForwardMode
from tests.e2e.test_engine import prompts_with_shared_prefixes
from tests.tiny_models import make_tiny_model


def test_graph_replay_equals_eager_logits(tmp_path):
    model = str(make_tiny_model("qwen3", tmp_path, with_tokenizer=True, hidden_size=256, intermediate_size=512,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=32))
    # The synchronous loop, so that after e.step() the prefill's tokens are on the host.
    with Engine(model=model, device="cuda", dtype="bfloat16", attention_backend="triton",
                max_total_tokens=8192, cuda_graph_max_bs=16, disable_overlap_schedule=True) as e:
        runner = e.runner
        graphs = runner.cuda_graphs[(ForwardMode.DECODE, 1)]
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        for p in prompts_with_shared_prefixes(5, seed=9):
            e.add_request(prompt_token_ids=p, sampling_params=params)
        e.step()  # prefill
        batch = e.scheduler.schedule()
        assert batch.mode.name == "DECODE" and len(batch.reqs) == 5  # a bucket of 8 with 3 padding rows
        fb = runner.build_batch(batch)
        graph_logits = graphs.replay(fb).logits.clone()
        runner.attn_backend.init_forward_metadata(fb)
        with torch.inference_mode():
            eager = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb))
        # The graph runs the bucket of 8, so cuBLAS may pick another GEMM kernel than for 5 rows:
        # bf16 rounding differs by a few ulps of the logits, never by more.
        torch.testing.assert_close(graph_logits, eager, atol=6e-2, rtol=0)
        assert (graph_logits.argmax(-1) == eager.argmax(-1)).all()
        # Finish the step by hand as the engine would, so the requests' KV bookkeeping stays whole.
        tokens = graph_logits.argmax(-1)
        futures = [[f] for f in runner.future_tokens.put(tokens)]
        e.scheduler.commit(batch, batch.reqs, futures)
        e.scheduler.resolve(batch.reqs, [[t] for t in tokens.tolist()], futures)


def test_graphs_on_and_off_give_the_same_tokens_fp32(tmp_path):
    model = str(make_tiny_model("llama", tmp_path, with_tokenizer=True))
    prompts = prompts_with_shared_prefixes(12, seed=10)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    outs = []
    for disable in (False, True):
        with Engine(model=model, device="cuda", dtype="float32", attention_backend="triton",
                    max_total_tokens=8192, disable_cuda_graph=disable) as e:
            assert (not e.runner.cuda_graphs) == disable
            outs.append([o.token_ids for o in e.generate(prompt_token_ids=prompts, sampling_params=params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_rope_equals_torch_rope(dtype):
    from kestrel.layers.rope_triton import rope_triton
    from kestrel.layers.rotary import RotaryEmbedding
    from kestrel.layers.rotary import RopeConfig

    rope = RotaryEmbedding(128, 8192, RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0,
                                                  original_max_position_embeddings=8192)).cuda()
    positions = torch.randint(0, 8192, (300,), device="cuda")
    q = torch.randn(300, 32 * 128, device="cuda", dtype=dtype)
    k = torch.randn(300, 8 * 128, device="cuda", dtype=dtype)
    qk = torch.cat([q, k], dim=-1)
    torch.testing.assert_close(rope_triton(qk, positions, rope.cos_sin_cache, 128), rope(positions, qk),
                               atol=1e-2, rtol=1e-2)


def test_dummy_8b_greedy_identical_between_backends():
    # float32: random weights give nearly flat logits, so bf16 rounding alone flips near-ties.
    prompts = [[1000 + 37 * i + j for j in range(64 + 32 * i)] for i in range(4)]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch_native", "triton"):
        with Engine(model="kestrel/assets/configs/llama-3.1-8b", load_format="dummy", dtype="float32",
                    attention_backend=backend, max_total_tokens=4096, cuda_graph_max_bs=8) as e:
            outs[backend] = [o.token_ids for o in e.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert outs["torch_native"] == outs["triton"]


def test_verify_graph_equals_eager(tmp_path):
    """A TARGET_VERIFY batch of 4 tokens per request replays a captured graph with the same logits as
    the eager forward (tree mask included), and eager rows match the one-token decode logits."""
    model = str(make_tiny_model("llama", tmp_path, with_tokenizer=True))
    with Engine(model=model, device="cuda", dtype="float32", attention_backend="triton", max_total_tokens=4096,
                cuda_graph_max_bs=8, disable_overlap_schedule=True) as e:
        params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        for p in prompts_with_shared_prefixes(3, seed=4):
            e.add_request(prompt_token_ids=p, sampling_params=params)
        e.step()
        e.runner.capture_graphs(ForwardMode.TARGET_VERIFY, 4)
        batch = e.scheduler.schedule(decode_tokens=4)
        parents = [-1, 0, 0, 1]
        mask = torch.zeros(4, 4, dtype=torch.bool)
        for node, parent in enumerate(parents):
            mask[node, node] = True
            while parent != -1:
                mask[node, parent] = True
                parent = parents[parent]
        batch.tree_mask = mask.flatten().repeat(3)
        batch.positions = [batch.prefix_lens[i // 4] + d for i, d in enumerate([0, 1, 1, 2] * 3)]
        batch.input_ids = [t if i % 4 == 0 else 100 + i for i, t in enumerate(batch.input_ids)]
        batch.logits_at_all_tokens = True
        graph = e.runner.cuda_graphs[(ForwardMode.TARGET_VERIFY, 4)]
        fb = e.runner.build_batch(batch)
        assert graph.can_run(fb)
        replayed = graph.replay(fb).logits.clone()
        fb.attn_backend.init_forward_metadata(fb)
        with torch.inference_mode():
            eager = e.runner.model.compute_logits(e.runner.model(fb.input_ids, fb.positions, fb))
        torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)
        e.scheduler.commit(batch, [], [])
        for req in batch.reqs:
            e.scheduler.keep_new_slots(req, 4, [0])
        e.scheduler.resolve(batch.reqs, [[int(replayed[4 * i].argmax())] for i in range(3)])
        while e.has_work():
            e.step()
