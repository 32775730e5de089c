"""Kernel profile of small prefills on the Llama-3.1-8B shape (issue 16, item 4): where the 15-20 ms of a
300-600-token prefill step go. Prints each prefill's forward time (CUDA events) and the top kernels by GPU
time: their sum against the forward's time shows how much of it the GPU sits idle waiting for launches.

    PYTHONPATH=. python scripts/profile_prefill_step.py
"""
from __future__ import annotations

import cProfile
import pstats
import random

import torch
from torch.profiler import ProfilerActivity, profile

from kestrel.bench.common import random_prompts
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.engine import Engine


def main() -> None:
    rng = random.Random(0)
    engine = Engine(model="kestrel/assets/configs/llama-3.1-8b", load_format="dummy")
    for n in (400, 400, 1000):  # the first pays for compiling the kernels' variants
        prompt = random_prompts([n], engine.vocab_size, rng)[0]
        rid = engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_new_tokens=1))
        engine.runner.forward_events = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while not engine.request(rid).finished:
                engine.step()
            torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) for s, e in engine.runner.forward_events]
        engine.runner.forward_events = None
        while engine.has_work():
            engine.step()
        print(f"\n=== prompt {n}, forwards (ms): {[round(g, 2) for g in gpu]}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    # The host side of the same prefill: which Python calls the launch time goes to.
    prompt = random_prompts([400], engine.vocab_size, rng)[0]
    rid = engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_new_tokens=1))
    host = cProfile.Profile()
    host.enable()
    while not engine.request(rid).finished:
        engine.step()
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(25)
    engine.shutdown()


if __name__ == "__main__":
    main()
