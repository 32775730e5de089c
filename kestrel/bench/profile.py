"""`--profile PATH` for the bench verbs that run an engine in process: where the measured run's time goes.

The file's suffix picks the form:
- `*.json`: a torch.profiler trace (host operators, and the GPU's kernels on CUDA), for Perfetto or
  chrome://tracing;
- `*.prof`: the host's Python functions by cProfile (`python -m pstats PATH`, or snakeviz), for the
  launch and bookkeeping work around the forwards;
- anything else: a text table of the GPU kernels (on CPU: the operators) by total time, per engine step
  of the profiled run, heaviest first, with their sum.
A profiled run is slower than a plain one: read its figures from a run without `--profile`.
"""
from __future__ import annotations

import argparse
import cProfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

TABLE_ROWS = 30


def add_profile_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", metavar="PATH", default=None,
                        help="profile the measured run into PATH: *.json a torch.profiler trace, *.prof the host's "
                             "Python functions (cProfile), any other name a table of kernels (operators on CPU) "
                             "per engine step (kestrel.bench.profile)")


@contextmanager
def profiled(path: str | None, engine) -> Iterator[None]:
    """Profile the engine steps run inside the block into `path` (nothing when None)."""
    if path is None:
        yield
        return
    steps = []
    hook = steps.append
    engine.add_step_hook(hook)
    cuda = engine.device.type == "cuda"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.endswith(".prof"):
            host = cProfile.Profile()
            host.enable()
            try:
                yield
            finally:
                host.disable()
            host.dump_stats(path)
        else:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                yield
                if cuda:
                    torch.cuda.synchronize(engine.device)
            if path.endswith(".json"):
                prof.export_chrome_trace(path)
            else:
                Path(path).write_text(kernel_table(prof, len(steps), cuda))
    finally:
        engine.remove_step_hook(hook)
    print(f"profile of {len(steps)} engine steps: {path}", flush=True)


def kernel_table(prof, steps: int, cuda: bool) -> str:
    """GPU kernels (CPU: operators, self time) by total time: ms and calls per engine step, heaviest first."""
    per = max(steps, 1)
    rows = []
    for event in prof.key_averages():
        if cuda:
            total = getattr(event, "self_device_time_total", None)
            total = getattr(event, "self_cuda_time_total", 0) if total is None else total
        else:
            total = event.self_cpu_time_total
        if total > 0:
            rows.append((total / per / 1e3, event.count / per, event.key))
    rows.sort(reverse=True)
    what = "GPU kernels and device work" if cuda else "CPU operators, self time"
    lines = [f"{what}, per engine step (mean of {steps} steps)", f"{'ms/step':>9} {'calls':>7}  name"]
    lines += [f"{ms:9.3f} {calls:7.1f}  {name[:100]}" for ms, calls, name in rows[:TABLE_ROWS]]
    lines.append(f"{sum(r[0] for r in rows):9.3f} {sum(r[1] for r in rows):7.1f}  all ({len(rows)} names)")
    return "\n".join(lines) + "\n"
