"""Piecewise CUDA graphs on the GPU: the same greedy tokens as eager prefills, graphs captured and
replayed for EXTEND and MIXED steps, a replay's logits == the eager forward's."""
from __future__ import annotations

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.forward_output import ForwardOutput
from tests.e2e.test_engine import prompts_with_shared_prefixes
from tests.tiny_models import make_tiny_model

# Chunks of 48 while others decode: MIXED steps; buckets 64, 128 for max tokens 128.
FLAGS = dict(device="cuda", attention_backend="triton", max_total_tokens=8192, chunked_prefill_size=48,
             enable_mixed_chunk=True, piecewise_cuda_graph_max_tokens=128)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_piecewise_graphs_give_the_same_greedy_tokens(tmp_path, arch):
    model = str(make_tiny_model(arch, tmp_path, with_tokenizer=True))
    prompts = prompts_with_shared_prefixes(16, seed=11)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for piecewise in (False, True):
        with Engine(model=model, dtype="float32", enable_piecewise_cuda_graph=piecewise, **FLAGS) as e:
            pieces = e.runner.piecewise_graphs
            assert (pieces is not None) == piecewise
            # First half at once, the rest while those decode (MIXED), then radix hits.
            first = e.generate(prompt_token_ids=prompts[:8], sampling_params=params)
            rids = [e.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts[8:]]
            for _ in range(3):
                e.step()
            rids += [e.add_request(prompt_token_ids=p[:20] + [5, 6], sampling_params=params) for p in prompts[:4]]
            while e.has_work():
                e.step()
            outs.append([o.token_ids for o in first] + [e.request(r).output_ids for r in rids])
            if piecewise:
                assert len(pieces.graphs) == len(pieces.buckets) * pieces.num_segments == 2 * 3
                assert pieces.replays[ForwardMode.EXTEND] > 0 and pieces.replays[ForwardMode.MIXED] > 0, \
                    pieces.replays
                print(f"{arch}: piecewise graphs {pieces.graph_memory / 2**20:.1f} MiB, replays {dict(pieces.replays)}")
    assert outs[0] == outs[1]


def test_replay_equals_eager_logits_bf16(tmp_path):
    model = str(make_tiny_model("qwen3", tmp_path, with_tokenizer=True, hidden_size=256, intermediate_size=512,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=32))
    with Engine(model=model, dtype="bfloat16", enable_piecewise_cuda_graph=True, **FLAGS) as e:
        runner = e.runner
        checked = 0

        def eager(fb):
            fb.attn_backend.init_forward_metadata(fb)
            token_hidden = runner.model(fb.input_ids, fb.positions, fb)
            hidden = token_hidden[fb.logits_indices]
            return ForwardOutput(runner.model.compute_logits(hidden), hidden, None, token_hidden)

        def both(fb):
            nonlocal checked
            want = eager(fb)  # writes the KV; a replay writes the same values again
            if not runner.piecewise_graphs.can_run(fb):
                return want
            got = runner.piecewise_graphs.replay(fb)
            # The graphs run the padded bucket, so cuBLAS may pick other GEMM kernels: a few bf16 ulps.
            torch.testing.assert_close(got.logits, want.logits, atol=6e-2, rtol=0)
            assert (got.logits.argmax(-1) == want.logits.argmax(-1)).all()
            checked += 1
            return got

        runner._execute = both
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        e.generate(prompt_token_ids=prompts_with_shared_prefixes(10, seed=12), sampling_params=params)
        assert checked >= 2
