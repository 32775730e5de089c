"""Host time of one decode step's parts (schedule, build_batch, sampler, process) on a tiny model, CPU.

    python scripts/bench_host_step.py --running 64
The forward itself is skipped (zero logits), so what is left is the Python/host work per step.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kestrel import Engine, SamplingParams  # noqa: E402
from kestrel.sampling.sampler import SamplingBatch  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(model=str(make_tiny_model("llama", tmp)), device="cpu", dtype="float32",
                        max_running_requests=max(args.running, 1), disable_overlap_schedule=True)
        rng = random.Random(0)
        params = SamplingParams(max_new_tokens=args.steps + 10, temperature=0.0, ignore_eos=True)
        rids = [engine.add_request(prompt_token_ids=[rng.randrange(3, 500) for _ in range(64)], sampling_params=params)
                for _ in range(args.running)]
        while any(not engine.request(rid).output_ids for rid in rids):
            engine.step()
        parts: dict[str, list[float]] = {"schedule": [], "build_batch": [], "sampler": [], "commit+resolve": []}
        for _ in range(args.steps):
            t0 = time.perf_counter()
            batch = engine.scheduler.schedule()
            t1 = time.perf_counter()
            engine.runner.build_batch(batch)
            t2 = time.perf_counter()
            sampling = SamplingBatch.from_requests(batch.reqs, engine.vocab_size, engine.eos_token_ids, "cpu")
            out = engine.sampler(torch.zeros(len(batch.reqs), engine.vocab_size), sampling)
            t3 = time.perf_counter()
            futures = [[f] for f in range(len(batch.reqs))]
            engine.scheduler.commit(batch, batch.reqs, futures)
            engine.scheduler.resolve(batch.reqs, [[t] for t in out.token_ids], futures)
            t4 = time.perf_counter()
            for key, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[key].append(value)
    line = "  ".join(f"{k} {sorted(v)[len(v) // 2] * 1e3:.3f} ms" for k, v in parts.items())
    print(f"{args.running} running requests, median of {args.steps} decode steps: {line}")


if __name__ == "__main__":
    main()
