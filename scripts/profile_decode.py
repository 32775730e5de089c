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
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    print(f"bs={args.batch_size} context={args.context}: {args.steps} eager decode steps")
    print(table)


if __name__ == "__main__":
    main()
