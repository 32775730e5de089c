"""Admission/retraction policy on a simulated clock: the real Scheduler, no model.

    python scripts/simulate_admission.py --num-prompts 500 --input-len 4096 --output-len 2048 --range-ratio 1

Drives `Scheduler` with the real allocator, radix cache and req_to_token table (all on the host) in the
engine's synchronous loop (schedule -> commit -> resolve), feeding made-up tokens. Each step is charged
by a cost model of an 8B model on one H200, so that policies can be compared on throughput, not only
on retraction counts, in seconds instead of a GPU-hour.

Cost model (fitted to measured H200 decode steps of Llama-3.1-8B, bf16 KV, page size 1:
batch 64 x ~600 context 6.3 ms, 170 x ~2,700 25 ms, 1,000 x ~640 47 ms):
  prefill step = new tokens / PREFILL_TOK_S
  decode step  = fixed + batch x per_request + KV tokens read x per_kv_token   (DECODE_COST)
per_kv_token = 4e-8 s is ~128 KiB of KV per token at ~3.3 TB/s, the attention kernel's share of
the H200's bandwidth; the fixed part is the 16 GB weight read.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kestrel.bench.common import workload  # noqa: E402
from kestrel.cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from kestrel.cache.radix import RadixCache  # noqa: E402
from kestrel.cache.req_to_token import ReqToTokenPool  # noqa: E402
from kestrel.config import SchedulerConfig  # noqa: E402
from kestrel.core.forward_mode import ForwardMode  # noqa: E402
from kestrel.core.request import Request  # noqa: E402
from kestrel.core.sampling_params import SamplingParams  # noqa: E402
from kestrel.engine.scheduler import Scheduler  # noqa: E402

PREFILL_TOK_S = 46_000
DECODE_COST = (0.0036, 0.000018, 4.0e-8)  # seconds: per step, per request, per KV token read
VOCAB = 128_256  # Llama-3's; only the range of the random prompt ids depends on it
STOP_TOKEN = 1  # ends a request at its output length when max_new_tokens is larger (EOS-like runs)


def simulate(prompts: list[list[int]], out_lens: list[int], config: SchedulerConfig, pool_tokens: int,
             page_size: int = 1, decode_cost: tuple[float, float, float] = DECODE_COST,
             max_new_tokens: int | None = None) -> dict:
    """Run every request to its output length; returns the simulated time and the scheduler's behaviour.

    By default a request's max_new_tokens is its output length (ignore_eos benchmarks: the scheduler
    knows every length). With `max_new_tokens`, that is every request's budget and the request stops
    at its output length on a stop token, as with EOS: the scheduler has to guess the lengths.
    """
    allocator = TokenToKVPoolAllocator(pool_tokens, page_size, "cpu")
    radix = RadixCache(allocator, page_size)
    # Never the limit: the output length ends every request.
    context = max(map(len, prompts)) + max(max_new_tokens or 0, max(out_lens)) + 1
    req_to_token = ReqToTokenPool(config.max_running_requests, context + 1, "cpu")
    scheduler = Scheduler(config, allocator, radix, req_to_token, eos_token_ids=set(), context_length=context)
    if max_new_tokens is not None and max_new_tokens < max(out_lens):
        raise ValueError(f"max_new_tokens {max_new_tokens} is below the longest output ({max(out_lens)})")
    reqs = [Request(rid=str(i), prompt_ids=p, arrival=i, seed=i, params=SamplingParams(
                max_new_tokens=max_new_tokens or m, ignore_eos=True,
                stop_token_ids=[STOP_TOKEN] if max_new_tokens else None))
            for i, (p, m) in enumerate(zip(prompts, out_lens))]
    target = {id(r): m for r, m in zip(reqs, out_lens)}
    for req in reqs:
        scheduler.add(req)

    fixed, per_req, per_kv = decode_cost
    clock = prefill_s = prefill_tokens = decode_steps = decode_reqs = 0
    next_future = 0
    host = {"schedule": 0.0, "commit+resolve": 0.0}
    while scheduler.has_work():
        t0 = time.perf_counter()
        batch = scheduler.schedule()
        host["schedule"] += time.perf_counter() - t0
        assert batch is not None, "work left but nothing scheduled"
        prefill = sum(r.extend_len for r in batch.reqs[:batch.num_prefill])
        decodes = batch.reqs[batch.num_prefill:]
        clock += prefill / PREFILL_TOK_S
        prefill_s += prefill / PREFILL_TOK_S
        prefill_tokens += prefill
        if decodes:
            kv_read = sum(r.kv_len + 1 for r in decodes)
            clock += fixed + len(decodes) * per_req + kv_read * per_kv
            decode_steps += batch.mode is ForwardMode.DECODE
            decode_reqs += len(decodes) if batch.mode is ForwardMode.DECODE else 0
        t0 = time.perf_counter()
        sampled = [batch.reqs[i] for i in scheduler.sampling_rows(batch)]
        futures = list(range(next_future, next_future + len(sampled)))
        next_future += len(sampled)
        scheduler.commit(batch, sampled, [[f] for f in futures])
        # Any token works; one derived from the future index keeps the sequences distinct.
        tokens = [STOP_TOKEN if max_new_tokens and r.num_generated == target[id(r)] else 100 + f % 1000
                  for r, f in zip(sampled, futures)]
        scheduler.resolve(sampled, [[t] for t in tokens], [[f] for f in futures])
        host["commit+resolve"] += time.perf_counter() - t0
    assert all(len(r.output_ids) == m for r, m in zip(reqs, out_lens)), "a request stopped short"
    output = sum(out_lens)
    return {"elapsed_s": clock, "prefill_s": prefill_s, "output_tok_s": output / clock,
            "retractions": scheduler.num_retractions, "prefill_tokens": prefill_tokens,
            "prompt_tokens": sum(map(len, prompts)),
            "decode_steps": decode_steps, "mean_decode_batch": decode_reqs / max(1, decode_steps),
            "host_s": host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=2048)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--pool-tokens", type=int, default=845_453)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--max-running", type=int, default=1024)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192, help="the GPU default")
    parser.add_argument("--schedule-conservativeness", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="every request's budget; requests stop at their drawn output length, as with EOS "
                             "(default: the budget is the output length, as with ignore_eos)")
    parser.add_argument("--decode-cost", type=float, nargs=3, default=DECODE_COST,
                        metavar=("FIXED", "PER_REQ", "PER_KV"),
                        help="decode step cost in seconds: per step, per request, per KV token read")
    args = parser.parse_args()
    prompts, out_lens = workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, VOCAB,
                                 random.Random(args.seed))
    config = SchedulerConfig(max_running_requests=args.max_running,
                             chunked_prefill_size=args.chunked_prefill_size,
                             schedule_conservativeness=args.schedule_conservativeness)
    start = time.perf_counter()
    r = simulate(prompts, out_lens, config, args.pool_tokens, args.page_size, tuple(args.decode_cost),
                 args.max_new_tokens)
    wall = time.perf_counter() - start
    print(f"simulated elapsed   {r['elapsed_s']:10.1f} s  (prefill {r['prefill_s']:.1f} s)")
    print(f"output tok/s        {r['output_tok_s']:10.0f}")
    print(f"retractions         {r['retractions']:10d}")
    print(f"prefill tokens      {r['prefill_tokens']:10,d}  (prompt tokens {r['prompt_tokens']:,d}, "
          f"x{r['prefill_tokens'] / r['prompt_tokens']:.3f})")
    print(f"mean decode batch   {r['mean_decode_batch']:10.1f}  over {r['decode_steps']:,d} decode steps")
    print(f"host wall time      {wall:10.1f} s  (" + ", ".join(f"{k} {v:.1f} s" for k, v in r["host_s"].items()) + ")")


if __name__ == "__main__":
    main()
