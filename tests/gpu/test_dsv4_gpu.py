"""The dsv4 backend's products on CUDA: logits of half inputs come back in float32 and unrounded (the
out_dtype path of torch.mm / bmm) at the decode and prefill-tile layouts `attend` uses; the packed FP8
KV entries encode and decode on CUDA to the same bytes and values as on the CPU (the CPU tests' oracle);
decode steps captured in CUDA graphs (static-sizes plan, every-expert MoE) = eager decode, through the
engine; the sparse-attention Triton kernel = the backend's torch path at Flash widths (H 64, D 512,
bf16 and packed FP8) and in the engine (prefill and graph-replayed decode logits); the grouped-GEMM MoE =
the hit-expert loop in bf16, eagerly and replayed from a CUDA graph over new routing."""
from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kestrel import Engine, SamplingParams
from kestrel.attention.dsv4 import DSV4Backend, WindowKeys, _fp32_out, logits_f32
from kestrel.attention.dsv4_plan import StepPlan, V4Span
from kestrel.core.forward_mode import ForwardMode
from kestrel.distributed.parallel_state import ParallelState
from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.layers.moe import MoE
from kestrel.models.deepseek_v4.moe import v4_moe
from kestrel.quant.kv_entries import RopeEntryFP8, ScaledKeyFP8
from tests.e2e.test_spec_nextn import checkpoint, prompts, weights  # noqa: F401 - fixtures
from tests.model import dsv4_reference as ref


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


# ---- the sparse-attention kernel ---------------------------------------------------------------------
def flash_width_case(ratio: int, fp8: bool, decode: bool, device: str = "cuda"):
    """(kernel backend, torch backend, attend args) at Flash widths: 64 heads, D 512, window 128, 512
    picks; 3 requests at 2k-3k context (decode: one token each, static-sizes plan; else a 300-token
    chunk each)."""
    dev, dtype, H, D, W = torch.device(device), torch.bfloat16, 64, 512, 128
    gen = torch.Generator(dev).manual_seed(ratio + 10 * fp8 + 100 * decode)
    width, rows = 4096, torch.tensor([2, 0, 3], device=dev)
    table = torch.arange(5, device=dev)[:, None] * width + torch.arange(width, device=dev)[None, :]
    prefix = torch.tensor([3000, 2047, 2500], device=dev)
    ratios = (ratio,) if ratio else ()
    if decode:
        plan = StepPlan.decode(rows, prefix, table, ratios, 4, width)
    else:
        plan = StepPlan([V4Span(r, p, 300, 300 * i) for i, (r, p) in enumerate(zip(rows.tolist(), prefix.tolist()))],
                        table, ratios, 4)
    T = plan.num_tokens
    codec = RopeEntryFP8(D, 64) if fp8 else None
    entries = None
    if ratio:
        values = torch.randn(5 * width // ratio, D, generator=gen, device=dev).to(dtype)
        entries = codec.encode(values) if fp8 else values
    layer = SimpleNamespace(ckv=entries, ckv_codec=codec)
    pools = SimpleNamespace(layer=lambda layer_id: layer)
    pair = []
    for kernel in (True, False):
        backend = DSV4Backend(pools, None, sparse_kernel=kernel)
        backend.plan = plan
        pair.append(backend)
    index, valid = plan.window(W)
    valid = valid & (torch.rand(valid.shape, generator=gen, device=dev) > 0.1)
    window = WindowKeys(torch.randn(3 * (W - 1) + T, D, generator=gen, device=dev).to(dtype), index, valid)
    q = torch.randn(T, H, D, generator=gen, device=dev).to(dtype)
    sink = torch.randn(H, generator=gen, device=dev)
    selected = None
    if ratio == 4:
        visible = plan.blocks(4)[1]
        selected = (torch.rand(T, 512, generator=gen, device=dev) * visible[:, None]).long()
        selected = selected.masked_fill(torch.rand(T, 512, generator=gen, device=dev) < 0.1, -1)
    return (*pair, (q, window, sink, D ** -0.5, ratio, selected))


@pytest.mark.parametrize("ratio, fp8", [(0, False), (4, False), (128, False), (4, True), (128, True)])
@pytest.mark.parametrize("decode", [True, False])
def test_sparse_kernel_equals_torch_path_at_flash_widths(ratio: int, fp8: bool, decode: bool) -> None:
    """bf16: both round the probabilities to bf16 before the value product and return bf16, so they
    differ by bf16 steps of the outputs (~4e-3 of them); against the torch path in fp32 over the same
    values, the kernel is no further off than the bf16 torch path (+ one bf16 step)."""
    kernel, torch_path, (q, window, sink, scale, ratio, selected) = flash_width_case(ratio, fp8, decode)
    got = kernel.attend(0, q, window, sink, scale, ratio, selected)
    want = torch_path.attend(0, q, window, sink, scale, ratio, selected)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    # fp32 oracle: the same keys and q upcast (the packed entries decode to float32 in the torch path).
    if not fp8 and ratio:
        layer = torch_path.pools.layer(0)
        layer.ckv = layer.ckv.float()
    w32 = WindowKeys(window.source.float(), window.index, window.valid)
    exact = torch_path.attend(0, q.float(), w32, sink, scale, ratio, selected)
    err_kernel = (got.float() - exact).abs().max().item()
    err_torch = (want.float() - exact).abs().max().item()
    assert err_kernel <= 1.5 * err_torch + 4e-3, (err_kernel, err_torch)


def test_engine_logits_with_the_sparse_kernel_equal_the_torch_path(checkpoint) -> None:
    """The tier-A config through the engine (fp32): a prefill of three requests (200, 5 and 137 tokens:
    ratio-128 blocks visible) run with the kernel and with the torch path over the same state (the
    forward rewrites the same entries), then a decode step replayed from its CUDA graph (the kernel
    captured with the static-sizes plan) = the eager torch path."""
    with Engine(model=checkpoint, disable_overlap_schedule=True, **GRAPH_ENGINE) as engine:
        runner, backend = engine.runner, engine.runner.attn_backend
        assert backend.sparse_kernel is None and backend._use_kernel(torch.device("cuda"))
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        gen = torch.Generator().manual_seed(3)
        for n in (200, 5, 137):
            engine.add_request(prompt_token_ids=torch.randint(2, 500, (n,), generator=gen).tolist(),
                               sampling_params=params)
        batch = engine.scheduler.schedule()
        assert batch.mode is ForwardMode.EXTEND and len(batch.reqs) == 3
        fb = runner.build_batch(batch)
        logits = []
        with torch.inference_mode():
            for kernel in (True, False):
                backend.sparse_kernel = kernel
                backend.init_forward_metadata(fb)
                logits.append(runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb)))
        backend.sparse_kernel = None
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=0)  # at every prompt position
        _finish(engine, batch, logits[1][fb.logits_indices].argmax(-1))
        batch = engine.scheduler.schedule()
        assert batch.mode is ForwardMode.DECODE and len(batch.reqs) == 3
        fb = runner.build_batch(batch)
        graphs = runner.cuda_graphs[(ForwardMode.DECODE, 1)]
        assert graphs.can_run(fb)
        graph_logits = graphs.replay(fb).logits.clone()
        backend.sparse_kernel = False
        backend.init_forward_metadata(fb)
        with torch.inference_mode():
            eager = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb))
        backend.sparse_kernel = None
        torch.testing.assert_close(graph_logits, eager, atol=2e-3, rtol=0)
        _finish(engine, batch, graph_logits.argmax(-1))


def _finish(engine, batch, tokens: torch.Tensor) -> None:
    """Commit a hand-run step as the engine would, so its bookkeeping stays whole."""
    futures = [[f] for f in engine.runner.future_tokens.put(tokens)]
    engine.scheduler.commit(batch, batch.reqs, futures)
    engine.scheduler.resolve(batch.reqs, [[t] for t in tokens.tolist()], futures)


# ---- the grouped-GEMM MoE (kestrel/layers/moe/fused_moe.py) ------------------------------------------
def bf16_moe(experts: int, parallel: ParallelState, device: str = "cuda") -> MoE:
    """A V4 MoE of `experts` routed experts (6 per token), widths 1024 / 384, random weights, bf16 as the
    model loads it (the gate stays float32); clamp 1.5, so it fires."""
    cfg = dataclasses.replace(parse_v4_config(ref.RefConfig().native_config()), hidden_size=1024,
                              moe_intermediate_size=384, n_routed_experts=experts, num_experts_per_tok=6,
                              swiglu_limit=1.5)
    layer = v4_moe(cfg, hash_routing=False, parallel=parallel).to(device)
    gen = torch.Generator(device).manual_seed(experts)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * p.shape[-1] ** -0.5)
    layer.experts.bfloat16()
    layer.shared_experts.bfloat16()
    return layer


@pytest.mark.parametrize("T", [1, 37, 300, 1000])
def test_fused_moe_equals_the_loop_in_bf16(T: int) -> None:
    """Rank 1 of 2 (32 of 64 experts: about half of each token's are another rank's), tile heights 16, 32
    and 64. Both round to bf16 (the loop each product, the fused path only the activations), so against
    the float32 loop over the same bf16 weights the fused path is no further off than the loop (1.5x + 1e-3),
    and the two are within 3e-2 of each other (outputs of size ~1)."""
    layer = bf16_moe(64, ParallelState(1, 2, ep_size=2))
    gen = torch.Generator("cuda").manual_seed(T)
    x = torch.randn(T, 1024, generator=gen, device="cuda").bfloat16()
    ids = torch.rand(T, 64, generator=gen, device="cuda").argsort(-1)[:, :6]
    routing = torch.rand(T, 6, generator=gen, device="cuda")
    exact = copy.deepcopy(layer).float()
    loop, fused, oracle = (torch.zeros(T, 1024, device="cuda") for _ in range(3))
    with torch.no_grad():
        layer.add_routed(x, ids, routing, loop, "loop")
        layer.add_routed(x, ids, routing, fused, "fused")
        exact.add_routed(x.float(), ids, routing, oracle, "loop")
    assert oracle.abs().amax() > 0.1
    torch.testing.assert_close(fused, loop, atol=3e-2, rtol=3e-2)
    err_fused, err_loop = ((y - oracle).abs().max().item() for y in (fused, loop))
    assert err_fused <= 1.5 * err_loop + 1e-3, (err_fused, err_loop)


def test_fused_moe_captured_in_a_cuda_graph_follows_the_routing(monkeypatch) -> None:
    """32 local experts (above EVERY_EXPERT_MAX): a forward of 8 tokens captured with the fused path and
    replayed on new inputs (other experts hit each time) = the eager loop's forward on them."""
    layer = bf16_moe(32, ParallelState())
    x = torch.zeros(8, 1024, device="cuda", dtype=torch.bfloat16)
    input_ids = torch.arange(8, device="cuda")
    assert layer.routed_path(x) == "fused"
    paths, choose = [], layer.routed_path
    monkeypatch.setattr(layer, "routed_path", lambda x: paths.append(choose(x)) or paths[-1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        layer(x, input_ids)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = layer(x, input_ids)
    assert paths == ["fused", "fused"]
    gen = torch.Generator("cuda").manual_seed(1)
    routings = []
    for _ in range(3):
        x.copy_(torch.randn(8, 1024, generator=gen, device="cuda"))
        graph.replay()
        monkeypatch.setattr(layer, "routed_path", lambda x: "loop")
        with torch.no_grad():
            want = layer(x, input_ids)
            routings.append(layer.gate(x, input_ids)[0].sort(-1).values)
        torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
    assert not any(torch.equal(routings[i], routings[j]) for i, j in ((0, 1), (1, 2), (0, 2)))
