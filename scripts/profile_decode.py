"""Kernel-level profile of eager decode steps of a dummy model (where the step time goes).

    python scripts/profile_decode.py --model kestrel/assets/configs/llama-3.1-8b --batch-size 1
"""
from __future__ import annotations

import argparse
import random

import torch
from torch.profiler import ProfilerActivity, profile

from kestrel import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="kestrel/assets/configs/llama-3.1-8b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    engine = Engine(model=args.model, load_format="dummy", attention_backend="triton", disable_cuda_graph=True,
                    max_total_tokens=args.batch_size * (args.context + 64) + 1024)
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for _ in range(args.batch_size):
        engine.add_request(prompt_token_ids=[rng.randrange(100, 100000) for _ in range(args.context)],
                           sampling_params=params)
    for _ in range(4):  # prefill + warm decode steps (Triton compiles)
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    # Per decode step: GPU time and launches of each kernel, largest first (a compact table).
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total > 0:
            rows.append((total / args.steps / 1e3, e.count / args.steps, e.key))
    rows.sort(reverse=True)
    print(f"bs={args.batch_size} context={args.context}: per eager decode step (mean of {args.steps})")
    print(f"{'ms/step':>8} {'calls':>6}  kernel")
    for ms, calls, name in rows[:22]:
        print(f"{ms:8.3f} {calls:6.0f}  {name[:90]}")
    print(f"{sum(r[0] for r in rows):8.3f} {sum(r[1] for r in rows):6.0f}  all kernels")

if __name__ == "__main__":
    main()
