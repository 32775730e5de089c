"""Speculative decoding on the GPU: what it buys, per batch size (issue 14's figures).

    PYTHONPATH=. python scripts/bench_spec.py demo       # demo + demo-eagle / demo-draft: tok/s, accept length
    PYTHONPATH=. python scripts/bench_spec.py llama8b    # Llama-3.1-8B shape, dummy weights, EAGLE-3-shaped head

`demo`: greedy generation of 128 tokens for 1, 8, 32, 64 Python prompts (held-out stdlib files the demo
models never trained on), with and without speculation (speculation forced on at every batch size, so the
table shows where it loses), median of 3 timed runs after a warm-up; tok/s counts output tokens.
`llama8b`: per batch size, the plain decode step and one speculative round (mean wall time of engine steps
run back to back, as they run in service; also the median synchronised step), and inside the round the GPU
time of the draft forwards and of TARGET_VERIFY (CUDA events), for trees of 4, 8 and 16 tokens; from them
the speedup each accept length L would give: L x decode step / round. Random weights accept ~nothing, so
only the timings are measured here. The 5/4/8 tree at batch 1 is also profiled ($OUT/spec_profile.txt).
JSON goes to $OUT/spec_<part>.json; a table is printed last.
"""
from __future__ import annotations

import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kestrel import Engine, SamplingParams

OUT = Path(os.environ.get("OUT", "/tmp/out"))
HELD_OUT = ["textwrap", "heapq", "bisect", "colorsys", "fractions", "graphlib", "shlex", "string", "sched",
            "pprint", "csv", "dataclasses"]


def held_out_prompts(n: int, tokenizer, length: int = 96) -> list[list[int]]:
    ids = []
    for name in HELD_OUT:
        ids += tokenizer.encode(inspect.getsource(__import__(name)))
    step = max(1, (len(ids) - length) // n)
    return [ids[i * step:i * step + length] for i in range(n)]


def timed_generate(engine: Engine, prompts, params, repeats: int = 3) -> tuple[float, list]:
    engine.generate(prompt_token_ids=prompts[:2], sampling_params=params)  # warm-up (Triton, cuBLAS)
    times, outs = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), outs


def demo() -> list[dict]:
    common = dict(model="demo", device="cuda", dtype="bfloat16", max_running_requests=64, cuda_graph_max_bs=64,
                  disable_radix_cache=True, max_total_tokens=100_000)
    variants = [("plain", {}),
                ("EAGLE demo-eagle 5/4/8", dict(speculative_algorithm="EAGLE", speculative_draft_model_path="demo-eagle")),
                ("EAGLE demo-eagle 3/1/4", dict(speculative_algorithm="EAGLE", speculative_draft_model_path="demo-eagle",
                                                speculative_num_steps=3, speculative_eagle_topk=1,
                                                speculative_num_draft_tokens=4)),
                ("STANDALONE demo-draft 3/1/4", dict(speculative_algorithm="STANDALONE",
                                                     speculative_draft_model_path="demo-draft"))]
    params = SamplingParams(max_new_tokens=128, temperature=0.0, ignore_eos=True)
    rows, plain_tps = [], {}
    for name, spec in variants:
        with Engine(**common, **spec, speculative_disable_batch_size=1000 if spec else 32) as engine:
            prompts = held_out_prompts(64, engine.tokenizer)
            for bs in (1, 8, 32, 64):
                seconds, outs = timed_generate(engine, prompts[:bs], params)
                tps = bs * 128 / seconds
                accept = None
                if spec:
                    accept = sum(o.meta["spec_accept_length"] * o.meta["spec_verify_ct"] for o in outs) / \
                        sum(o.meta["spec_verify_ct"] for o in outs)
                else:
                    plain_tps[bs] = tps
                rows.append(dict(variant=name, batch=bs, tok_s=round(tps, 1), seconds=round(seconds, 3),
                                 accept_length=round(accept, 3) if accept else None,
                                 speedup=round(tps / plain_tps[bs], 3)))
                print(rows[-1], flush=True)
        del engine
        free_gpu()
    return rows


def free_gpu() -> None:
    """Give the previous engine's weights, KV pool and graphs back before the next one sizes its pool."""
    gc.collect()
    torch.cuda.empty_cache()


def eagle3_head_folder(root: Path) -> str:
    """A config-only EAGLE-3 head for Llama-3.1-8B, shaped as the public one (32k draft vocabulary)."""
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=4096,
                  intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  num_hidden_layers=1, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, hidden_act="silu")
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def step_times(engine: Engine, bs: int, rounds: int) -> dict:
    """At batch `bs`: the median synchronised wall time of a decode step (or round), the mean step time
    when steps are not synchronised (plain decoding then overlaps host and device), and the CUDA-event
    times of the forwards inside: the target's (verify), the draft phase, the draft extend."""
    params = SamplingParams(max_new_tokens=2 * rounds + 8, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        engine.add_request(prompt_token_ids=[(37 * i + j) % 30000 + 100 for j in range(512)], sampling_params=params)
    while engine.scheduler.waiting or engine.scheduler.chunked:
        engine.step()
    for _ in range(3):
        engine.step()
    worker = engine.spec_worker if engine.spec_worker is not None and engine.spec_worker.has_draft_kv else None
    runners = [engine.runner] + ([worker.runner] if worker else [])
    draft_events: list = []
    if worker:
        draft = worker.lanes.draft

        def timed_draft(*args):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            tree = draft(*args)
            end.record()
            draft_events.append((start, end))
            return tree
        worker.lanes.draft = timed_draft
    for runner in runners:
        runner.forward_events = []
    walls = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    gpu = [[s.elapsed_time(e) for s, e in events] for events in [r.forward_events for r in runners] + [draft_events]]
    for runner in runners:
        runner.forward_events = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        engine.step()
    torch.cuda.synchronize()
    unsynced = (time.perf_counter() - start) / rounds
    if worker:
        worker.lanes.draft = draft
    for rid in list(engine._reqs):
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    return dict(synced_ms=med([w * 1e3 for w in walls]), unsynced_ms=round(unsynced * 1e3, 3), target_gpu_ms=med(gpu[0]),
                extend_gpu_ms=med(gpu[1]) if worker else None, draft_gpu_ms=med(gpu[2]) if worker else None)


def profile_rounds(engine: Engine, rounds: int = 5) -> None:
    """The GPU kernels of a few speculative rounds at batch 1, heaviest first, into $OUT/spec_profile.txt."""
    params = SamplingParams(max_new_tokens=4 * rounds + 8, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt_token_ids=[(7 * j) % 30000 + 100 for j in range(512)], sampling_params=params)
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "spec_profile.txt").write_text(table)
    print("\n".join(table.splitlines()[:18]), flush=True)
    while engine.has_work():
        engine.step()


def llama8b() -> list[dict]:
    target = "kestrel/assets/configs/llama-3.1-8b"
    common = dict(model=target, load_format="dummy", device="cuda", dtype="bfloat16", max_total_tokens=65536,
                  max_running_requests=32, cuda_graph_max_bs=32, disable_radix_cache=True)
    rows = []
    with Engine(**common) as engine:
        plain = {bs: step_times(engine, bs, 20) for bs in (1, 8, 32)}
    del engine
    free_gpu()
    print("plain decode", plain, flush=True)
    head = eagle3_head_folder(Path(tempfile.mkdtemp()))
    for steps, topk, tokens in ((3, 1, 4), (5, 4, 8), (5, 4, 16)):
        shape = dict(speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)
        with Engine(**common, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                    speculative_disable_batch_size=1000, **shape) as engine:
            for bs in (1, 8, 32):
                t = step_times(engine, bs, 20)
                # Against plain decoding as it runs (overlapped), not its synchronised steps.
                decode = plain[bs]["unsynced_ms"]
                row = dict(shape=f"{steps}/{topk}/{tokens}", batch=bs, decode_ms=decode,
                           decode_synced_ms=plain[bs]["synced_ms"], round_ms=t["unsynced_ms"],
                           round_synced_ms=t["synced_ms"],
                           verify_gpu_ms=t["target_gpu_ms"], draft_gpu_ms=t["draft_gpu_ms"],
                           draft_step_gpu_ms=round(t["draft_gpu_ms"] / (steps - 1), 3),
                           draft_extend_gpu_ms=t["extend_gpu_ms"],
                           # A round commits at most steps + 1 tokens. Rounds back to back, as they run.
                           **{f"speedup_at_L{L}": round(L * decode / t["unsynced_ms"], 2) if L <= steps + 1 else None
                              for L in (2, 3, 4, 5)})
                rows.append(row)
                print(row, flush=True)
                if bs == 1 and topk > 1 and tokens == 8:
                    profile_rounds(engine)
        del engine
        free_gpu()
    return rows


def main() -> None:
    part = sys.argv[1] if len(sys.argv) > 1 else "demo"
    rows = {"demo": demo, "llama8b": llama8b}[part]()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"spec_{part}.json").write_text(json.dumps(rows, indent=1))
    keys = list(rows[0])
    print("\n" + " | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))


if __name__ == "__main__":
    main()
