"""Where a speculative round's time goes (host side): cProfile of 40 rounds of demo + demo-eagle at batch 1.

    PYTHONPATH=. python scripts/profile_spec.py
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch

from kestrel import Engine, SamplingParams

with Engine(model="demo", device="cuda", dtype="bfloat16", max_total_tokens=50_000, cuda_graph_max_bs=8,
            speculative_algorithm="EAGLE", speculative_draft_model_path="demo-eagle") as engine:
    params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt="import os\n\n\ndef main():\n", sampling_params=params)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with cProfile.Profile() as prof:
        for _ in range(40):
            engine.step()
        torch.cuda.synchronize()
    print(f"{(time.perf_counter() - start) / 40 * 1e3:.2f} ms per round (profiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p2:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in p2.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print("GPU kernels per round:", len(events) / 5, "GPU busy ms per round:",
          sum(e.device_time for e in events) / 5 / 1e3)
