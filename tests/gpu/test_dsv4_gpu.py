"""The dsv4 backend's products on CUDA: logits of half inputs come back in float32 and unrounded (the
out_dtype path of torch.mm / bmm) at the decode and prefill-tile layouts `attend` uses; the packed FP8
KV entries encode and decode on CUDA to the same bytes and values as on the CPU (the CPU tests' oracle);
decode steps captured in CUDA graphs (static-sizes plan, every-expert MoE) = eager decode, through the
engine."""
from __future__ import annotations

import torch

from kestrel import Engine, SamplingParams
from kestrel.attention.dsv4 import _fp32_out, logits_f32
from kestrel.core.forward_mode import ForwardMode
from kestrel.quant.kv_entries import RopeEntryFP8, ScaledKeyFP8
from tests.e2e.test_spec_nextn import checkpoint, prompts, weights  # noqa: F401 - fixtures


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


# ---- CUDA graphs of V4 decode steps ------------------------------------------------------------------
# The tier-A tiny config and its checkpoint folder (tests/e2e/test_spec_nextn.py's fixtures), in fp32.
GRAPH_ENGINE = dict(device="cuda", dtype="float32", page_size=128, max_total_tokens=4096, cuda_graph_max_bs=4)


def count_replays(engine) -> list[int]:
    """Wrap the decode graph runner's `replay` to count the steps it served."""
    graphs, calls = engine.runner.cuda_graphs[(ForwardMode.DECODE, 1)], []
    replay = graphs.replay

    def counting(batch):
        calls.append(batch.batch_size)
        return replay(batch)

    graphs.replay = counting
    return calls


def test_v4_decode_graphs_give_the_eager_tokens(checkpoint) -> None:
    """Greedy through the engine with decode graphs (buckets 1, 2, 4: four requests, then fewer as they
    finish) = with --disable-cuda-graph; decode crosses ratio-4 blocks, the window and position 127."""
    lengths = (24, 20, 12, 6)
    outs = []
    for disable in (False, True):
        with Engine(model=checkpoint, disable_cuda_graph=disable, **GRAPH_ENGINE) as engine:
            runner = engine.runner
            assert (not runner.cuda_graphs) == disable
            if not disable:
                graphs = runner.cuda_graphs[(ForwardMode.DECODE, 1)]
                assert list(runner.cuda_graphs) == [(ForwardMode.DECODE, 1)]  # verify / extend stay eager
                assert sorted(graphs.graphs) == [1, 2, 4]
                calls = count_replays(engine)
            params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
            outs.append([o.token_ids for o in engine.generate(prompt_token_ids=prompts(), sampling_params=params)])
            if not disable:
                # Every decode token came from a replay (the first token of each is the prefill's);
                # 3 requests ran padded to the bucket of 4.
                assert sum(calls) >= sum(lengths) - len(lengths) and {4, 3, 2, 1} <= set(calls), calls
    assert [len(o) for o in outs[0]] == list(lengths)
    assert outs[0] == outs[1]


def test_v4_decode_graph_replay_equals_eager_logits(checkpoint) -> None:
    """One decode step of three requests (a bucket of 4, one padding row) replayed from the graph and run
    eagerly (host-length plan, hit-expert MoE) over the same state: the same logits. The step's writes
    are at its own positions, which neither run reads, so running it twice changes nothing it reads."""
    with Engine(model=checkpoint, disable_overlap_schedule=True, **GRAPH_ENGINE) as engine:
        runner = engine.runner
        graphs = runner.cuda_graphs[(ForwardMode.DECODE, 1)]
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        for p in prompts()[:3]:
            engine.add_request(prompt_token_ids=p, sampling_params=params)
        engine.step()  # the prefill
        batch = engine.scheduler.schedule()
        assert batch.mode is ForwardMode.DECODE and len(batch.reqs) == 3
        fb = runner.build_batch(batch)
        assert graphs.can_run(fb)
        graph_logits = graphs.replay(fb).logits.clone()
        runner.attn_backend.init_forward_metadata(fb)
        assert runner.attn_backend.plan.spans is not None  # the eager plan, from the host lengths
        with torch.inference_mode():
            eager = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb))
        torch.testing.assert_close(graph_logits, eager, atol=2e-3, rtol=0)
        assert (graph_logits.argmax(-1) == eager.argmax(-1)).all()
        tokens = graph_logits.argmax(-1)  # finish the step as the engine would: its bookkeeping stays whole
        futures = [[f] for f in runner.future_tokens.put(tokens)]
        engine.scheduler.commit(batch, batch.reqs, futures)
        engine.scheduler.resolve(batch.reqs, [[t] for t in tokens.tolist()], futures)
