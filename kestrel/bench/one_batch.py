"""Latency of one static batch: prefill of `batch_size` prompts, then each decode step.

    python -m kestrel.bench.one_batch --model kestrel/assets/configs/llama-3.1-8b --load-format dummy \
        --batch-size 1 --input-len 128 --output-len 128

Several `--batch-size` values run one after the other; `--plot PATH` draws their throughput and decode
step latencies as a PNG. `--profile PATH` (kestrel.bench.profile) profiles the first batch size's decode
steps, or with `--profile-phase prefill` its prefill: e.g. the kernels of eager decode steps,

    kestrel bench one-batch --model kestrel/assets/configs/llama-3.1-8b --load-format dummy --disable-cuda-graph \
        --batch-size 1 --input-len 256 --output-len 8 --profile decode.txt
"""
from __future__ import annotations

import argparse
import random
import time
from contextlib import nullcontext

import torch

from kestrel.bench.common import (copy_bandwidth, decode_read_bytes, engine_from_args, kv_read_bytes, median, now,
                                  random_prompts, report, weight_bytes)
from kestrel.bench.plot import check_plot_available, plot_sweep
from kestrel.bench.profile import add_profile_flag, profiled
from kestrel.cli import add_engine_flags
from kestrel.core.sampling_params import SamplingParams


class ForwardTimer:
    """Times the runner's forwards on the GPU with CUDA events (the rest of a step is CPU work)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        runner.forward_events = [] if runner.device.type == "cuda" else None

    def take_ms(self) -> list[float]:
        events = self.runner.forward_events or []
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
        events.clear()
        return times


def run(engine, batch_size: int, input_len: int, output_len: int, seed: int = 0, profile: str | None = None,
        profile_phase: str = "decode") -> dict:
    """Prefill latency and per-step decode latencies (seconds) of one batch, run to completion; `profile`:
    profile `profile_phase` (prefill or decode) into that path."""
    def phase(name: str):
        return profiled(profile, engine) if name == profile_phase else nullcontext()

    rng = random.Random(seed)
    prompts = random_prompts([input_len] * batch_size, engine.vocab_size, rng)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
    device = engine.device
    start = now(device)
    with phase("prefill"):
        while not all(engine.request(r).output_ids for r in rids):  # prefill (possibly chunked)
            engine.step()
    # The first tokens are on the host now; a device sync here would also wait for the decode step
    # that overlap scheduling has already launched.
    prefill = time.perf_counter() - start
    # No device sync between steps (it would defeat overlap scheduling): a step's time is the interval
    # between consecutive step() returns, i.e. between tokens as the host sees them.
    steps = []
    last = now(device)
    with phase("decode"):
        while engine.has_work():
            engine.step()
            t = time.perf_counter()
            steps.append(t - last)
            last = t
    for rid in rids:
        engine.pop(rid)
    return {"prefill_s": prefill, "decode_steps_s": steps}


def measure(engine, args: argparse.Namespace, batch_size: int, bandwidth: float | None,
            profile: str | None = None) -> tuple[dict, list[float]]:
    """One batch size: the summary (JSON) and its decode step times (seconds); `bandwidth` is the device's
    measured copy bandwidth (None on CPU); `profile`: profile this batch into that path (--profile-phase)."""
    device = engine.device
    timer = ForwardTimer(engine.runner)
    result = run(engine, batch_size, args.input_len, args.output_len, seed=1, profile=profile,
                 profile_phase=args.profile_phase)
    step = median(result["decode_steps_s"])
    forward_ms = timer.take_ms() if device.type == "cuda" else []
    # The first timed forward(s) are the prefill; the decode forwards follow one per step.
    decode_forwards = len(result["decode_steps_s"])
    decode_gpu = median(forward_ms[-decode_forwards:]) / 1e3 if forward_ms else None
    prefill_gpu = sum(forward_ms[:len(forward_ms) - decode_forwards]) / 1e3 if forward_ms else None
    wbytes, read_bytes = weight_bytes(engine.runner.model), decode_read_bytes(engine.runner.model, batch_size)
    # The median decode step's requests hold input_len + output_len / 2 tokens each.
    kv_bytes = kv_read_bytes(engine, batch_size * (args.input_len + args.output_len // 2))
    floor = wbytes / bandwidth if bandwidth else None
    read_floor = read_bytes / bandwidth if bandwidth else None
    kv_floor = (read_bytes + kv_bytes) / bandwidth if bandwidth else None
    summary = {
        "model": engine.config.model.model, "device": str(device), "dtype": engine.config.model.dtype,
        "batch_size": batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "prefill_latency_s": result["prefill_s"],
        "prefill_tok_per_s": batch_size * args.input_len / result["prefill_s"],
        "prefill_forward_gpu_s": prefill_gpu,
        "decode_step_median_s": step, "decode_tok_per_s": batch_size / step,
        "weight_bytes": wbytes, "copy_bandwidth_bytes_per_s": bandwidth, "decode_floor_s": floor,
        "decode_fraction_of_floor": floor / step if floor else None,
        "decode_read_bytes": read_bytes, "decode_read_floor_s": read_floor,
        "decode_fraction_of_read_floor": read_floor / step if read_floor else None,
        "decode_kv_read_bytes": kv_bytes, "decode_weight_kv_floor_s": kv_floor,
        "decode_fraction_of_weight_kv_floor": kv_floor / step if kv_floor else None,
        "decode_forward_gpu_median_s": decode_gpu,
        "decode_cpu_share": 1 - decode_gpu / step if decode_gpu else None,
        "attention_backend": engine.runner.attn_backend.name,
        "cuda_graphs": bool(engine.runner.cuda_graphs),
    }
    return summary, result["decode_steps_s"]


def rows_of(summary: dict) -> list[tuple[str, object]]:
    step, decode_gpu, floor = summary["decode_step_median_s"], summary["decode_forward_gpu_median_s"], \
        summary["decode_floor_s"]
    rows = [("batch size / input / output", f"{summary['batch_size']} / {summary['input_len']} / "
                                             f"{summary['output_len']}"),
            ("prefill latency (ms)", summary["prefill_latency_s"] * 1e3),
            ("prefill throughput (tok/s)", summary["prefill_tok_per_s"]),
            ("decode step, median (ms)", step * 1e3),
            ("decode throughput (tok/s)", summary["decode_tok_per_s"])]
    if summary["prefill_forward_gpu_s"]:
        rows.append(("prefill forwards on GPU (ms)", summary["prefill_forward_gpu_s"] * 1e3))
    if decode_gpu:
        rows += [("decode forward on GPU, median (ms)", decode_gpu * 1e3),
                 ("step time outside the forward", f"{100 * (1 - decode_gpu / step):.1f}%")]
    if floor:
        read_floor = summary["decode_read_floor_s"]
        rows += [("floor: weights / copy bw (ms)", floor * 1e3),
                 ("decode vs floor", f"{100 * floor / step:.1f}% of the floor"),
                 ("floor: weights a step reads / copy bw (ms)", read_floor * 1e3),
                 ("decode vs that floor", f"{100 * read_floor / step:.1f}% of it"),
                 ("floor: those weights + the KV a step reads (ms)", summary["decode_weight_kv_floor_s"] * 1e3),
                 ("decode vs weights + KV floor", f"{100 * summary['decode_weight_kv_floor_s'] / step:.1f}% of it")]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1],
                        help="one or more batch sizes, each run in turn")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--json", default=None, help="write the result here (a list under 'runs' for several batch sizes)")
    parser.add_argument("--plot", default=None, help="draw throughput and decode-step latency per batch size as a PNG here")
    add_profile_flag(parser)
    parser.add_argument("--profile-phase", choices=("decode", "prefill"), default="decode",
                        help="the part of the first batch size's run that --profile covers (default: decode)")
    args = parser.parse_args(argv)
    check_plot_available(args.plot)
    engine = engine_from_args(args)
    run(engine, args.batch_size[0], args.input_len, min(args.output_len, 8))  # warm-up
    bandwidth = copy_bandwidth(engine.device)
    runs = [measure(engine, args, bs, bandwidth, args.profile if i == 0 else None)
            for i, bs in enumerate(args.batch_size)]
    summaries = [summary for summary, _ in runs]
    for i, summary in enumerate(summaries):
        last = i == len(summaries) - 1
        report("one-batch", rows_of(summary), summary if len(summaries) == 1 else {"runs": summaries},
               args.json if last else None)
    if args.plot:
        plot_sweep(args.plot, f"one batch: {summaries[0]['model']} ({summaries[0]['device']}, input "
                              f"{args.input_len}, output {args.output_len})", "batch size", args.batch_size,
                   {"decode": [s["decode_tok_per_s"] for s in summaries],
                    "prefill": [s["prefill_tok_per_s"] for s in summaries]},
                   {"decode step": [[t * 1e3 for t in steps] for _, steps in runs]})
    engine.shutdown()


if __name__ == "__main__":
    main()
