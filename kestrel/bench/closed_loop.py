"""The serving workload without HTTP: an in-process `Engine` kept at a fixed number of requests in flight.

    python -m kestrel.bench.closed_loop --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
        --num-prompts 320 --max-concurrency 64 --random-input-len 1000 --random-output-len 500 \
        --random-range-ratio 0.2

The same prompts as `kestrel.bench.serving` with the same seed, driven the way the server's engine process
drives the engine (`step_deltas`, a new request as soon as one finishes). A token's time is when the step
that produced it returns, so TTFT and ITL here are the engine's own share of what a client sees: set
against the HTTP benchmark, they tell stalls in the engine from stalls on the way to the client. Every
step is recorded, and the slowest steps are listed with what they held, which names what an ITL tail is
made of, and where its wall time went on the host (`STEP_PHASES`: a long `launch` is the host's own work, a
long `resolve` waiting for the device). `--cost-trace FILE` writes every step the step-cost model observes
(its shape, its measured time, what the model predicted before seeing it), the final fit, with or without
an ITL target, and every step's phases in order: the data to judge the model's features by, and to tell
a slow device from a slow host.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from kestrel.bench.common import (add_random_dataset_flags, engine_from_args, median, percentile, random_dataset,
                                  report, warm_up_workload)
from kestrel.bench.profile import add_profile_flag, profiled
from kestrel.cli import add_engine_flags
from kestrel.core.outputs import STEP_PHASES
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.step_cost import FEATURES


TOKEN_BUCKETS = (1, 128, 512, 1024, 2048, 4096, 8192, 1 << 30)


def bucket(tokens_per_request: float, tokens: int) -> str:
    if tokens_per_request == 1:
        return "1/request"
    return f"<={next(b for b in TOKEN_BUCKETS if tokens <= b)}"


def run(engine, prompts: list[list[int]], out_lens: list[int], concurrency: int) -> dict:
    # end time, mode, requests, new tokens, s, forwards, host phases (STEP_PHASES)
    steps: list[tuple[float, str, int, int, float, int, tuple[float, ...]]] = []
    runner = engine.runner
    if runner.device.type == "cuda":  # the forwards' own GPU time, whatever overlap scheduling hides
        runner.forward_events = []
    engine.add_step_hook(lambda info: steps.append((time.perf_counter(), info.mode.upper(), info.num_reqs,
                                                     info.num_tokens, info.seconds,
                                                     len(runner.forward_events or ()), info.phases)))
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    next_prompt, touched = 0, []
    start = time.perf_counter()
    while next_prompt < len(prompts) or engine.has_work():
        while next_prompt < len(prompts) and len(sent) < concurrency:
            params = SamplingParams(max_new_tokens=out_lens[next_prompt], temperature=0.0, ignore_eos=True)
            rid = engine.add_request(prompt_token_ids=prompts[next_prompt], sampling_params=params)
            sent[rid] = time.perf_counter()
            touched.append(rid)
            next_prompt += 1
        news = engine.step_deltas(touched)
        touched = []
        now = time.perf_counter()
        for req, begin in news:
            new = len(req.output_ids) - begin
            if new and req.rid not in last:
                ttft.append(now - sent[req.rid])
            elif new:  # a delta carrying k tokens counts k gaps of equal share, as the HTTP benchmark does
                itl += [(now - last[req.rid]) / new] * new
            last[req.rid] = now
            if req.finished:
                del sent[req.rid], last[req.rid]
    elapsed = time.perf_counter() - start
    ms = 1e3
    by_kind: dict[str, list[float]] = {}
    step_gpu: list[float | None] = [None] * len(steps)  # each step's forwards' GPU ms
    if runner.forward_events is not None:
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) for s, e in runner.forward_events]
        runner.forward_events = None
        for i, ((_, mode, reqs, tokens, _, upto, _), (*_, since, _)) in enumerate(zip(steps, [(0,) * 7] + steps)):
            kind = f"{mode} {bucket(tokens / reqs, tokens)} new tokens"
            step_gpu[i] = sum(gpu[since:upto])
            by_kind.setdefault(kind, []).append(step_gpu[i])
    pieces = runner.piecewise_graphs
    replays = {m.value: c for m, c in pieces.replays.items()} if pieces is not None else {}
    slow = sorted(range(len(steps)), key=lambda i: -steps[i][4])[:max(1, len(steps) // 100)]  # step indices
    gaps = [b[0] - b[4] - a[0] for a, b in zip(steps, steps[1:])]  # host time between two steps
    return {
        "elapsed_s": elapsed, "output_tok_per_s": sum(out_lens) / elapsed,
        "ttft_median_ms": median(ttft) * ms, "ttft_p99_ms": percentile(ttft, 99) * ms,
        "ttft_steady_p99_ms": percentile(ttft[concurrency:], 99) * ms if len(ttft) > concurrency else None,
        "itl_median_ms": median(itl) * ms, "itl_p99_ms": percentile(itl, 99) * ms,
        "requests_timed": len(ttft), "gaps_timed": len(itl),
        "steps": len(steps), "step_median_ms": median(s[4] for s in steps) * ms,
        "step_p99_ms": percentile([s[4] for s in steps], 99) * ms,
        "between_steps_p99_ms": percentile(gaps, 99) * ms if gaps else 0.0,
        "slowest_1pct_by_mode": dict(Counter(steps[i][1] for i in slow)),
        "piecewise_graph_replays": replays,  # forwards piecewise CUDA graphs served, by mode (warm-up run included)
        "gpu_forward_ms_by_kind": {k: {"steps": len(v), "median": round(median(v), 2), "max": round(max(v), 2)}
                                   for k, v in sorted(by_kind.items())},
        "slowest_1pct": [{"step": i, "mode": steps[i][1], "requests": steps[i][2], "new_tokens": steps[i][3],
                          "ms": round(steps[i][4] * ms, 2), "gpu_ms": rounded(step_gpu[i]),
                          "host_ms": phases_ms(steps[i][6])} for i in slow[:20]],
        # Every step in order, for the traces: mode, requests, new tokens, ms, its phases' ms and GPU ms.
        "step_timeline": [[s[1], s[2], s[3], round(s[4] * ms, 3), phases_ms(s[6]), rounded(g)]
                          for s, g in zip(steps, step_gpu)],
    }


def rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def phases_ms(phases: tuple[float, ...]) -> dict[str, float]:
    return {name: round(t * 1e3, 3) for name, t in zip(STEP_PHASES, phases)}


def trace_step_costs(engine) -> list[dict]:
    """Record each step the engine's step-cost model observes from now on (the model fitted too)."""
    cost, records = engine.scheduler.cost, []
    observe = cost.observe

    def traced(shape, seconds: float) -> None:
        records.append({"decodes": shape.decodes, "context": shape.context_tokens, "prefill": shape.prefill_tokens,
                        "pairs": shape.prefill_pairs, "prefill_requests": shape.prefill_requests,
                        "seconds": seconds, "predicted": cost.predict(shape) if cost.fitted else None,
                        "overrun": cost.overrun})
        observe(shape, seconds)

    cost.observe = traced
    engine.loop.timed = True
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    add_random_dataset_flags(parser, num_prompts=320, input_len=1000, output_len=500, range_ratio=0.2)
    parser.add_argument("--max-concurrency", type=int, default=64, help="requests kept in flight (default 64)")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--cost-trace", default=None, help="write every step the step-cost model observes here (JSON)")
    add_profile_flag(parser)
    args = parser.parse_args(argv)
    engine = engine_from_args(args)
    prompts, out_lens = random_dataset(args, engine.vocab_size)
    run(engine, *warm_up_workload(args.num_prompts, engine.vocab_size, args.seed), args.max_concurrency)
    trace = trace_step_costs(engine) if args.cost_trace else None
    with profiled(args.profile, engine):
        result = run(engine, prompts, out_lens, args.max_concurrency)
    if trace is not None:
        cost = engine.scheduler.cost
        with open(args.cost_trace, "w") as f:
            json.dump({"steps": trace, "features": list(FEATURES), "coef": cost.coef.tolist(),
                       "overrun": cost.overrun, "model": cost.describe(),
                       "step_timeline": result["step_timeline"]}, f)
    result.pop("step_timeline")  # in the trace file only: thousands of rows
    rows = [(k, v) for k, v in result.items() if not isinstance(v, (list, dict))]
    rows.append(("slowest 1 % of steps, by mode", result["slowest_1pct_by_mode"]))
    rows.append(("piecewise CUDA graph replays, by mode", result["piecewise_graph_replays"]))
    rows += [(f"GPU forward, {kind}", v) for kind, v in result["gpu_forward_ms_by_kind"].items()]
    rows += [(f"slow step {i}", s) for i, s in enumerate(result["slowest_1pct"][:8])]
    report(f"closed loop in process, concurrency {args.max_concurrency}", rows,
           {"workload": vars(args), "kestrel": result}, args.json)
    engine.shutdown()


if __name__ == "__main__":
    main()
