"""The CPU serving benchmark: batch-1 streamed decode, then 8 requests in flight, against any
OpenAI-compatible server (kestrel, vLLM's CPU build), so their figures come from the same client.

    kestrel serve --model SmolLM2-135M-Instruct.Q4_1.gguf --device cpu --dtype float32 &
    kestrel bench cpu-serving --base-url http://127.0.0.1:30000 --vocab-size 49152

Both phases send random token ids (the same ones for every server, from `--seed`) to `/v1/completions`,
streamed, greedy, ignore_eos, through `kestrel.bench.serving`: batch 1 runs `--batch1-requests` requests
one after the other (its figure is the median time between two tokens of a lone request); concurrency 8
runs `--num-prompts` requests of `--random-input-len` prompt / `--random-output-len` output tokens with
8 in flight (its figure is output tokens per second).
"""
from __future__ import annotations

import argparse
import asyncio
import copy

from kestrel.bench.common import report
from kestrel.bench.serving import add_api_flags, run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000",
                        help="the server to measure (default http://127.0.0.1:30000)")
    parser.add_argument("--api-key", default=None, help="the key the server asks for, sent as a Bearer token")
    add_api_flags(parser)
    parser.set_defaults(api="openai")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="random token ids are drawn below this (default: the server's /server_info; "
                             "needed for servers without one, e.g. 49152 for SmolLM2)")
    parser.add_argument("--batch1-requests", type=int, default=4,
                        help="lone requests timed one after the other (default 4)")
    parser.add_argument("--max-concurrency", type=int, default=8,
                        help="requests in flight in the loaded phase (default 8)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests of the loaded phase (default 32)")
    parser.add_argument("--random-input-len", type=int, default=200,
                        help="prompt tokens per request (default 200)")
    parser.add_argument("--random-output-len", type=int, default=128,
                        help="output tokens per request, EOS ignored (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    parser.add_argument("--json", default=None, help="write both phases' figures here")
    args = parser.parse_args(argv)
    args.random_range_ratio = 1.0  # exact lengths: every server does the same work
    args.request_rate = float("inf")
    batch1_args = copy.copy(args)
    batch1_args.num_prompts = args.batch1_requests
    batch1, _ = asyncio.run(run(batch1_args, 1, args.seed))
    loaded, _ = asyncio.run(run(args, args.max_concurrency, args.seed + 1))
    rows = [("batch 1: inter-token median ms", batch1["itl_median_ms"]),
            ("batch 1: inter-token p99 ms", batch1["itl_p99_ms"]),
            ("batch 1: output tok/s", batch1["output_tok_per_s"]),
            (f"concurrency {args.max_concurrency}: output tok/s", loaded["output_tok_per_s"]),
            (f"concurrency {args.max_concurrency}: TTFT median ms", loaded["ttft_median_ms"]),
            (f"concurrency {args.max_concurrency}: inter-token median ms", loaded["itl_median_ms"]),
            (f"concurrency {args.max_concurrency}: inter-token p99 ms", loaded["itl_p99_ms"])]
    report(f"CPU serving {args.base_url} ({args.api} API)", rows,
           {"batch1": batch1, f"concurrency_{args.max_concurrency}": loaded}, args.json)


if __name__ == "__main__":
    main()
