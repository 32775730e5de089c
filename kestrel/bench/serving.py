"""Online serving benchmark: an HTTP load generator against a running `kestrel serve`.

    kestrel serve --model MODEL &
    python -m kestrel.bench.serving --base-url http://127.0.0.1:30000 --num-prompts 512 \
        --max-concurrency 64 --random-input-len 1000 --random-output-len 500 --random-range-ratio 0.2

Requests go to the native `/generate` endpoint as token ids (no tokenizer needed), streamed, greedy,
ignore_eos. Random ids are drawn below the server's vocabulary size, read from its `/server_info`
(`--vocab-size` instead, for a server without one). Reports throughput, TTFT, inter-token latency
(ITL) and end-to-end latency (median, p99). Several `--max-concurrency` values run one after the other;
`--plot PATH` draws throughput against concurrency and the latency distributions as a PNG.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from kestrel.bench.common import add_random_dataset_flags, median, percentile, report, workload
from kestrel.bench.plot import check_plot_available, plot_sweep


async def one_request(client, url: str, prompt: list[int], output_len: int, headers: dict) -> dict:
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}
    start = time.perf_counter()
    ttft, last, tokens, gaps = None, start, 0, []
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            done = event["meta_info"]["completion_tokens"]
            if done > tokens:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:  # an event carrying k tokens counts k gaps of equal share
                    gaps += [(now - last) / (done - tokens)] * (done - tokens)
                last, tokens = now, done
    return {"ttft": ttft, "itl": gaps, "e2e": time.perf_counter() - start, "output_tokens": tokens,
            "input_tokens": len(prompt)}


async def server_vocab_size(client, base_url: str, headers: dict) -> int:
    """The vocabulary size the server reports at /server_info; ValueError saying what to pass instead."""
    url = base_url + "/server_info"
    try:
        response = await client.get(url, headers=headers)
        vocab_size = response.json()["vocab_size"] if response.status_code == 200 else None
    except (OSError, ValueError, KeyError) as e:  # httpx's transport errors are OSErrors; bad JSON a ValueError
        raise ValueError(f"could not read the vocabulary size from {url} ({type(e).__name__}: {e}); "
                         "pass --vocab-size") from None
    if not isinstance(vocab_size, int):
        raise ValueError(f"could not read the vocabulary size from {url} (HTTP {response.status_code}: "
                         f"{response.text[:200]}); pass --vocab-size, or --api-key if the server has one")
    return vocab_size


async def run(args: argparse.Namespace, concurrency: int | None, seed: int) -> tuple[dict, dict[str, list[float]]]:
    """One run at `concurrency` (None: every request at once) of prompts drawn with `seed`: the summary,
    and the raw TTFT, ITL and end-to-end latencies (seconds)."""
    import httpx

    base_url = args.base_url.rstrip("/")
    url = base_url + "/generate"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(concurrency or args.num_prompts)
    timeout = httpx.Timeout(None, connect=10.0)

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        vocab_size = args.vocab_size or await server_vocab_size(client, base_url, headers)
        rng = random.Random(seed)
        prompts, out_lens = workload(args.num_prompts, args.random_input_len, args.random_output_len,
                                     args.random_range_ratio, vocab_size, rng)
        in_tokens = sum(map(len, prompts))

        async def limited(i: int) -> dict:
            async with limit:
                return await one_request(client, url, prompts[i], out_lens[i], headers)

        await one_request(client, url, prompts[0][:16], 4, headers)  # warm-up
        start = time.perf_counter()
        tasks = []
        for i in range(args.num_prompts):
            tasks.append(asyncio.create_task(limited(i)))
            if args.request_rate != float("inf"):  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    itl = [g for r in results for g in r["itl"]]
    ttft = [r["ttft"] for r in results]
    # With every slot free at the start, the first `concurrency` requests arrive together and queue behind
    # each other's prefills; the rest arrive one by one as slots free up. Their TTFTs are split so a burst
    # at the start and the steady state can be told apart.
    first_wave = (concurrency or len(results)) if args.request_rate == float("inf") else 0
    waves = {"first_wave": ttft[:first_wave], "steady": ttft[first_wave:]}
    e2e = [r["e2e"] for r in results]
    out_tokens = sum(r["output_tokens"] for r in results)
    assert out_tokens == sum(out_lens), "every request must produce its full output (ignore_eos)"
    ms = 1e3
    return {
        "num_prompts": args.num_prompts, "max_concurrency": concurrency, "request_rate": args.request_rate,
        "elapsed_s": elapsed, "output_tok_per_s": out_tokens / elapsed,
        "total_tok_per_s": (out_tokens + in_tokens) / elapsed, "request_per_s": args.num_prompts / elapsed,
        "ttft_median_ms": median(ttft) * ms, "ttft_p99_ms": percentile(ttft, 99) * ms,
        **{f"ttft_{name}_{stat}_ms": fn(values) * ms for name, values in waves.items() if values
           for stat, fn in (("median", median), ("p99", lambda v: percentile(v, 99)), ("max", max))},
        "itl_median_ms": median(itl) * ms, "itl_p99_ms": percentile(itl, 99) * ms,
        "e2e_median_ms": median(e2e) * ms, "e2e_p99_ms": percentile(e2e, 99) * ms,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
    }, {"ttft": ttft, "itl": itl, "e2e": e2e}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000",
                        help="the server to measure (default http://127.0.0.1:30000)")
    parser.add_argument("--api-key", default=None, help="the key the server asks for, sent as a Bearer token")
    parser.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                        help="requests in flight at most (default: all at once); several values run in turn")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    add_random_dataset_flags(parser, num_prompts=200, input_len=1000, output_len=500, range_ratio=0.2)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="random token ids are drawn below this (default: the server's, from /server_info)")
    parser.add_argument("--json", default=None, help="write the result here (a list under 'runs' for several "
                                                     "concurrencies)")
    parser.add_argument("--plot", default=None, help="draw throughput and latency distributions per concurrency "
                                                     "as a PNG here")
    args = parser.parse_args(argv)
    check_plot_available(args.plot)
    # Each concurrency draws its own prompts, so that none finds the previous run's in the radix cache.
    runs = [asyncio.run(run(args, c, args.seed + i)) for i, c in enumerate(args.max_concurrency)]
    results = [result for result, _ in runs]
    for i, result in enumerate(results):
        rows = [("prompts / concurrency", f"{args.num_prompts} / {result['max_concurrency'] or 'unlimited'}"),
                ("output tok/s", result["output_tok_per_s"]), ("requests/s", result["request_per_s"])]
        rows += [(f"{k.replace('_', ' ')}", result[k]) for k in
                 ("ttft_median_ms", "ttft_p99_ms", "ttft_first_wave_max_ms", "ttft_steady_p99_ms",
                  "itl_median_ms", "itl_p99_ms", "e2e_median_ms", "e2e_p99_ms") if k in result]
        report("serving", rows, result if len(results) == 1 else {"runs": results},
               args.json if i == len(results) - 1 else None)
    if args.plot:
        loads = [c or args.num_prompts for c in args.max_concurrency]  # unlimited: every request at once
        plot_sweep(args.plot, f"serving {args.base_url}: {args.num_prompts} prompts, input {args.random_input_len}, "
                              f"output {args.random_output_len}", "max concurrency", loads,
                   {"output": [r["output_tok_per_s"] for r in results],
                    "total": [r["total_tok_per_s"] for r in results]},
                   {name: [[t * 1e3 for t in raw[key]] for _, raw in runs]
                    for name, key in (("TTFT", "ttft"), ("inter-token latency", "itl"), ("end to end", "e2e"))})


if __name__ == "__main__":
    main()
