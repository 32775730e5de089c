"""Piecewise CUDA graphs on CPU: the segmented forward, padded to its token bucket through the static
buffers (what a replay computes, run eagerly), == the eager forward; and the fallback list."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.config import EngineConfig
from kestrel.config_resolve import resolve_config
from kestrel.core.forward_mode import ForwardMode
from kestrel.models.base import ForwardModel
from kestrel.runner.piecewise_graph import (PiecewiseGraphRunner, batch_fallback, piecewise_unavailable,
                                            token_buckets)
from tests.e2e.conftest import assert_pool_full

MAX_TOKENS = 96  # buckets 64, 96: every step here is padded; a 100-token chunk falls back


def kv_state(engine) -> list[torch.Tensor]:
    return [t.clone() for t in engine.kv_memory.pools[0].token_buffers()]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_segmented_forward_equals_eager(tiny_model, arch):
    """Each EXTEND / MIXED forward of a real schedule runs twice: eagerly, then through the segments with
    the KV its new tokens wrote poisoned; the logits, the hidden states and the whole KV pool must come
    out the same (so padded rows wrote nothing). The schedule has chunked prefills after a prefix, radix
    hits, a batch of several prompts, MIXED steps (decodes + a chunk), a prompt-logprobs request (logits
    at every position) and a step too large for the buckets (eager fallback)."""
    with Engine(model=tiny_model(arch), device="cpu", dtype="float32", chunked_prefill_size=100,
                enable_mixed_chunk=True, max_running_requests=8) as engine:
        runner = engine.runner
        pieces = PiecewiseGraphRunner(runner.model, MAX_TOKENS, runner.device, capture=False)
        assert pieces.buckets == [64, 96]
        eager_execute = runner._execute
        seen = []

        def checked_execute(fb):
            out = eager_execute(fb)
            reason = batch_fallback(fb, MAX_TOKENS)
            seen.append((fb.forward_mode, fb.batch_size, max(fb.prefix_lens_cpu), fb.input_ids.shape[0],
                         fb.logits_indices.shape[0], reason))
            if reason is not None:
                return out
            want = kv_state(engine)
            for buf in engine.kv_memory.pools[0].token_buffers():
                buf[fb.out_cache_loc] = float("nan")
            got = pieces.run_uncaptured(fb)
            torch.testing.assert_close(got.logits, out.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.token_hidden, out.token_hidden, rtol=1e-5, atol=1e-5)
            for a, b in zip(kv_state(engine), want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            return out

        runner._execute = checked_execute
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (30, 12, 20, 9, 17)]
        long_prompt = [rng.randrange(3, 512) for _ in range(150)]  # chunks of 100 (over the buckets: eager) + 50
        first = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts[:3]]
        engine.step()  # one EXTEND of three prompts, 62 tokens
        # Arriving while the first ones decode: MIXED steps.
        engine.add_request(prompt_token_ids=long_prompt, sampling_params=params)
        for p in prompts[3:]:
            engine.add_request(prompt_token_ids=p, sampling_params=params)
        engine.add_request(prompt_token_ids=prompts[1] + [7, 8, 9],
                           sampling_params=dataclasses.replace(params, prompt_logprobs=1))
        while engine.has_work():
            engine.step()
        # Alone: two radix hits in one EXTEND, then a chunked prompt's second chunk, all after a prefix.
        engine.add_request(prompt_token_ids=prompts[0] + [11, 12], sampling_params=params)
        engine.add_request(prompt_token_ids=prompts[2] + [13], sampling_params=params)
        engine.step()
        engine.add_request(prompt_token_ids=long_prompt[::-1], sampling_params=params)
        while engine.has_work():
            engine.step()
        # Alone, so that the step stays within the buckets whatever order the scheduler picked above.
        engine.add_request(prompt_token_ids=prompts[3] + [5, 6], sampling_params=dataclasses.replace(params,
                                                                                                   prompt_logprobs=1))
        while engine.has_work():
            engine.step()
        assert all(engine.request(r).finished for r in first)
        assert_pool_full(engine)
    served = [s for s in seen if s[-1] is None]
    assert any(mode is ForwardMode.EXTEND and prefix > 0 for mode, _, prefix, *_ in served)
    assert any(mode is ForwardMode.EXTEND and bs > 1 for mode, bs, *_ in served)
    assert any(mode is ForwardMode.MIXED for mode, *_ in served)
    assert any(rows > bs for _, bs, _, _, rows, _ in served)  # prompt logprobs: logits at every position
    assert any(s[-1] is not None and s[0] in (ForwardMode.EXTEND, ForwardMode.MIXED) for s in seen)


def test_engine_through_the_segments_gives_eager_greedy_tokens(tiny_model):
    """The runner's dispatch: with piecewise graphs in place (replaying = running the segments uncaptured,
    as on CPU nothing is captured), EXTEND / MIXED steps take them and the greedy tokens stay the eager
    engine's."""
    model = tiny_model("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (40, 7, 25, 60, 13, 33)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs, served = [], []
    for piecewise in (False, True):
        with Engine(model=model, device="cpu", dtype="float32", chunked_prefill_size=32,
                    enable_mixed_chunk=True) as engine:
            if piecewise:
                pieces = PiecewiseGraphRunner(engine.runner.model, MAX_TOKENS, engine.runner.device, capture=False)
                pieces.replay = lambda fb: served.append(fb.forward_mode) or pieces.run_uncaptured(fb)
                engine.runner.piecewise_graphs = pieces
            first = engine.generate(prompt_token_ids=prompts[:3], sampling_params=params)
            rids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts[3:]]
            engine.step()
            rids.append(engine.add_request(prompt_token_ids=prompts[0][:30] + [9], sampling_params=params))
            while engine.has_work():
                engine.step()
            outs.append([o.token_ids for o in first] + [engine.request(r).output_ids for r in rids])
            assert_pool_full(engine)
    assert outs[0] == outs[1]
    assert ForwardMode.EXTEND in served and ForwardMode.MIXED in served


def test_token_buckets():
    assert token_buckets(2048) == list(range(64, 1025, 64)) + list(range(1152, 2049, 128))
    assert token_buckets(1000)[-2:] == [960, 1000]
    assert token_buckets(100) == [64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(5000)[-3:] == [4096, 4608, 5000]


def test_fallbacks(tiny_model):
    """What the segmented path does not serve runs eagerly: batches (other modes, too many tokens, inner
    hidden states for EAGLE-3, a draft head's features, a verify tree) and whole engines (no CUDA,
    --disable-cuda-graph, a prefill backend other than triton, tensor parallelism, non-Llama models)."""
    model = tiny_model("llama")
    with Engine(model=model, device="cpu", dtype="float32") as engine:
        runner = engine.runner
        llama = runner.model  # the shut-down engine lets go of it
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        batches = []
        build = runner.build_batch

        def keep(batch, inputs=None):
            batches.append(build(batch, inputs))
            return batches[-1]

        runner.build_batch = keep
        engine.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=params)
        fb = batches[0]
        assert fb.forward_mode is ForwardMode.EXTEND and batch_fallback(fb, 64) is None
        assert "max-tokens" in batch_fallback(fb, 3)
        assert "EAGLE-3" in batch_fallback(dataclasses.replace(fb, capture_hidden=(0, 1)), 64)
        assert "feature" in batch_fallback(dataclasses.replace(fb, spec_features=torch.zeros(4, 8)), 64)
        assert "tree" in batch_fallback(dataclasses.replace(fb, tree_mask=torch.ones(16, dtype=torch.bool)), 64)
        for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
            assert "EXTEND and MIXED only" in batch_fallback(dataclasses.replace(fb, forward_mode=mode), 64)
        # No CUDA device here: the engine built none, whatever was asked.
        assert runner.piecewise_graphs is None

    cuda = torch.device("cuda")

    def config(**kw):
        return resolve_config(EngineConfig.from_flat(model=model, device="cpu", dtype="float32",
                                                     enable_piecewise_cuda_graph=True, **kw))

    assert piecewise_unavailable(config(attention_backend="triton"), llama, cuda) is None
    assert "CUDA" in piecewise_unavailable(config(attention_backend="triton"), llama, torch.device("cpu"))
    assert "disable-cuda-graph" in piecewise_unavailable(config(attention_backend="triton", disable_cuda_graph=True),
                                                         llama, cuda)
    assert "prefill attention backend" in piecewise_unavailable(config(), llama, cuda)  # torch_native
    assert "prefill attention backend" in piecewise_unavailable(
        config(prefill_attention_backend="torch_native", decode_attention_backend="triton"), llama, cuda)
    assert piecewise_unavailable(
        config(prefill_attention_backend="triton", decode_attention_backend="torch_native"), llama, cuda) is None
    tp = dataclasses.replace(config(attention_backend="triton"),
                             parallel=dataclasses.replace(EngineConfig().parallel, tp_size=2))
    assert "tensor parallelism" in piecewise_unavailable(tp, llama, cuda)
    assert "Llama family" in piecewise_unavailable(config(attention_backend="triton"), Unsegmented(), cuda)


class Unsegmented(ForwardModel):
    """A model that declares no segmented decoder (the default)."""

    def forward(self, input_ids, positions, batch):
        raise NotImplementedError

    def compute_logits(self, hidden):
        raise NotImplementedError
