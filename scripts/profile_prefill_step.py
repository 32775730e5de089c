"""Kernel profile of small prefills on the Llama-3.1-8B shape (issue 16, item 4): where the 15-20 ms of a
300-600-token prefill step go. Prints each prefill's forward time (CUDA events) and the top kernels by GPU
time: their sum against the forward's time shows how much of it the GPU sits idle waiting for launches.

    PYTHONPATH=. python scripts/profile_prefill_step.py [engine flags, e.g. --enable-piecewise-cuda-graph]

`--compare` instead times lone 400- and 1000-token prefill forwards with and without piecewise CUDA graphs
(one engine each; JSON in $OUT/prefill_piecewise.json when $OUT is set):

    PYTHONPATH=. python scripts/profile_prefill_step.py --compare
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from kestrel.bench.common import random_prompts
from kestrel.cli import add_engine_flags, config_from_args
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.engine import Engine

MODEL = dict(model="kestrel/assets/configs/llama-3.1-8b", load_format="dummy")


def prefill_ms(engine: Engine, n: int, rng: random.Random) -> list[float]:
    """The GPU time (CUDA events) of each forward of one n-token prompt's prefill."""
    prompt = random_prompts([n], engine.vocab_size, rng)[0]
    rid = engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_new_tokens=1))
    engine.runner.forward_events = []
    while not engine.request(rid).finished:
        engine.step()
    torch.cuda.synchronize()
    gpu = [s.elapsed_time(e) for s, e in engine.runner.forward_events]
    engine.runner.forward_events = None
    while engine.has_work():
        engine.step()
    return gpu


def compare(repeats: int = 5) -> None:
    results = {}
    for piecewise in (False, True):
        engine = Engine(**MODEL, enable_piecewise_cuda_graph=piecewise)
        rng = random.Random(0)
        row = {}
        for n in (400, 1000):
            prefill_ms(engine, n, rng)  # compiles the eager path's kernel variants
            times = [prefill_ms(engine, n, rng)[0] for _ in range(repeats)]
            row[n] = {"median_ms": round(statistics.median(times), 2), "all_ms": [round(t, 2) for t in times]}
        pieces = engine.runner.piecewise_graphs
        if pieces is not None:
            row["replays"] = {m.value: c for m, c in pieces.replays.items()}
            row["graph_memory_gib"] = round(pieces.graph_memory / 2**30, 3)
        results["piecewise" if piecewise else "eager"] = row
        engine.shutdown()
        del engine, pieces
        gc.collect()  # the next engine sizes its KV pool from the free GPU memory
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))
    for n in (400, 1000):
        eager, pw = results["eager"][n]["median_ms"], results["piecewise"][n]["median_ms"]
        print(f"prefill {n:5d} tokens: eager {eager:6.2f} ms, piecewise graphs {pw:6.2f} ms ({eager / pw:.2f}x)")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prefill_piecewise.json"), "w") as f:
            json.dump(results, f, indent=1)


def kernel_profile(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    config = config_from_args(args)
    engine = Engine(config=config)
    for n in (400, 400, 1000):  # the first pays for compiling the kernels' variants
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            gpu = prefill_ms(engine, n, rng)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", action="store_true", help="time prefills with and without piecewise graphs")
    add_engine_flags(parser)
    parser.set_defaults(**MODEL)
    args = parser.parse_args()
    if args.compare:
        compare()
    else:
        kernel_profile(args)


if __name__ == "__main__":
    main()
