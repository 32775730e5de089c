"""Shared pieces of the benchmarks: the engine they run, workloads, the physical floor, timing, reporting."""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch


def engine_from_args(args: argparse.Namespace, **overrides: Any):
    """The Engine that a bench verb's engine flags (`kestrel.cli.add_engine_flags`) ask for, logging set up
    at --log-level first; `overrides` replace flags by config field name (a variant of the same run)."""
    from kestrel.cli import config_from_args, configure_logging
    from kestrel.engine.engine import Engine

    configure_logging(args.log_level)
    return Engine(config=config_from_args(argparse.Namespace(**{**vars(args), **overrides})))


def random_lengths(n: int, length: int, range_ratio: float, rng: random.Random) -> list[int]:
    """SGLang's `random` dataset: each length uniform in [max(1, range_ratio * length), length]."""
    if not 0 <= range_ratio <= 1:
        raise ValueError(f"random_range_ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(range_ratio * length))
    return [rng.randint(low, length) for _ in range(n)]


def random_prompts(lengths: list[int], vocab_size: int, rng: random.Random) -> list[list[int]]:
    # Token ids below 100 are often special tokens; stay clear of them.
    return [[rng.randrange(100, vocab_size) for _ in range(n)] for n in lengths]


def workload(n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
             rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """n random-token prompts and their output lengths, drawn in that order from rng."""
    in_lens = random_lengths(n, input_len, range_ratio, rng)
    out_lens = random_lengths(n, output_len, range_ratio, rng)
    return random_prompts(in_lens, vocab_size, rng), out_lens


def add_random_dataset_flags(parser, num_prompts: int, input_len: int, output_len: int, range_ratio: float) -> None:
    """SGLang's `random` dataset flags and `--seed`, with this benchmark's defaults."""
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help=f"requests sent (default {num_prompts})")
    parser.add_argument("--random-input-len", type=int, default=input_len,
                        help=f"longest prompt, in random tokens (default {input_len})")
    parser.add_argument("--random-output-len", type=int, default=output_len,
                        help=f"longest output, in tokens (default {output_len})")
    parser.add_argument("--random-range-ratio", type=float, default=range_ratio,
                        help="each length is drawn uniformly from [ratio x longest, longest]; 1: all the longest "
                             f"(default {range_ratio})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths drawn (default 0)")


def random_dataset(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """The prompts and output lengths that `add_random_dataset_flags`' flags ask for."""
    return workload(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                    vocab_size, random.Random(args.seed))


def warm_up_workload(num_prompts: int, vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """A few short prompts to run before the timed ones (kernels compile, the allocator settles)."""
    return workload(min(8, num_prompts), 64, 8, 1.0, vocab_size, random.Random(seed + 1))


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float | None:
    """Measured device-to-device copy bandwidth in bytes/s (read + written), median of 10; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_read_bytes(model: torch.nn.Module, batch_size: int = 1) -> int:
    """The weight bytes a decode step of `batch_size` tokens must read: every weight but an input-embedding
    table that is not also the logits' weight, of which a step gathers one row per token (Llama-3.1-8B's
    untied table is 1.05 of its 16.06 GB), and of each MoE layer's routed experts only those the step is
    expected to hit (`expected_hit_experts`). weight_bytes counts everything whole: the convention of
    the earlier figures and of the goals stated against them."""
    from kestrel.layers.moe.layer import MoE
    from kestrel.layers.vocab_parallel import VocabParallelEmbedding

    # A Llama-family model without an lm_head computes its logits with the embedding table (tied).
    tied = getattr(model, "lm_head", False) is None
    unread = 0 if tied else sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                                if isinstance(m, (torch.nn.Embedding, VocabParallelEmbedding)))
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        # A rank holds an equal share of the experts, so it expects the same fraction of its own hit.
        hit = expected_hit_experts(moe.experts.num_experts, moe.cfg.router.top_k, batch_size)
        unread += weight_bytes(moe.experts) * (1 - hit / moe.experts.num_experts)
    return int(weight_bytes(model) - unread)


def expected_hit_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens hit when each picks `top_k` of `num_experts` uniformly and
    independently: E * (1 - (1 - k/E)^T). Real routers are skewed, so a real step hits fewer (the floor
    drawn from this is a little high for trained weights, about right for the benchmarks' random ones)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def kv_read_bytes(engine, context_tokens: int) -> int:
    """The KV bytes a decode step reads when its requests hold `context_tokens` tokens in all (every
    layout's bytes per token: the target's and a draft's)."""
    return engine.kv_memory.bytes_per_token * context_tokens


def timed_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 1,
             before: Callable[[], object] | None = None) -> list[float]:
    """fn's times in ms after `warmup` untimed calls: CUDA events on the GPU (from an idle device, so
    host launch gaps count), the wall clock on CPU. `before` runs untimed before every call."""
    times = []
    for i in range(warmup + iters):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            times.append(elapsed)
    return times


def graph_ms(fn: Callable[[], object], device: torch.device, iters: int) -> list[float]:
    """fn captured once in a CUDA graph (after two eager warm-up calls), its replays timed as `timed_ms`."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed_ms(graph.replay, device, iters)


def run_budgeted(cases: dict[str, Any], label: str, fn: Callable[[], Any], started: float, budget_s: float) -> None:
    """cases[label] = fn(), or why not: skipped once `budget_s` seconds have passed since `started`
    (time.monotonic()), or the error it raised, so that one failing case (an OOM, a kernel that does not
    compile) leaves the others' results; prints the case's line."""
    if time.monotonic() - started > budget_s:
        cases[label] = f"skipped: past the {budget_s:.0f} s budget"
        return
    t = time.monotonic()
    try:
        cases[label] = fn()
    except Exception as e:  # noqa: BLE001 - report it, keep the other cases
        cases[label] = f"failed: {type(e).__name__}: {e}"[:300]
    print(f"[{label}: {time.monotonic() - t:.1f} s] {json.dumps(cases[label])}", flush=True)


def write_result(result: dict[str, Any], name: str) -> Path:
    """`result` as $OUT/`name` (OUT defaults to ./out); its path."""
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(result, indent=1))
    return path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


class StepRecorder:
    """Records every engine step (mode, requests, new tokens, wall time) to show where a run's time went,
    through the engine's step hook; a step's wall time includes its host work."""

    def __init__(self, engine) -> None:
        self.steps: list[tuple[str, int, int, float]] = []
        self._engine = engine
        engine.add_step_hook(self._record)

    def _record(self, info) -> None:
        self.steps.append((info.mode.upper(), info.num_reqs, info.num_tokens, info.seconds))

    def detach(self) -> None:
        """Stop recording (the hook would keep this recorder, and the engine's hooks list, growing)."""
        self._engine.remove_step_hook(self._record)
        self._engine = None

    def summary(self) -> dict[str, dict[str, float]]:
        """Per forward mode: steps, seconds, new tokens, mean requests per step, median step time."""
        out: dict[str, dict[str, float]] = {}
        for mode in sorted({s[0] for s in self.steps}):
            rows = [s for s in self.steps if s[0] == mode]
            seconds = sum(s[3] for s in rows)
            out[mode] = {"steps": len(rows), "seconds": seconds, "tokens": sum(s[2] for s in rows),
                         "mean_requests": sum(s[1] for s in rows) / len(rows),
                         "median_step_ms": 1e3 * median(s[3] for s in rows)}
        return out


def report(title: str, rows: list[tuple[str, Any]], result: dict[str, Any], json_path: str | None) -> None:
    """Print a two-column table, then write the result as JSON if asked."""
    print(f"\n== {title} ==")
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        shown = f"{value:,.2f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {shown}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))


def require_interpreter() -> None:
    """A kernel benchmark's --smoke runs its Triton kernels on the CPU through Triton's interpreter, which
    kestrel chooses once, when it is first imported (kestrel.envs): so it must be set before the command."""
    from kestrel.envs import triton_interpret

    if not triton_interpret():
        raise SystemExit("--smoke runs the Triton kernels on the CPU through Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before the command (kestrel reads it once, when first imported)")
