"""Online serving benchmark: an HTTP load generator against a running `kestrel serve`.

    kestrel serve --model MODEL &
    python -m kestrel.bench.serving --base-url http://127.0.0.1:30000 --num-prompts 512 \
        --max-concurrency 64 --random-input-len 1000 --random-output-len 500 --random-range-ratio 0.2

Requests go to the native `/generate` endpoint as token ids (no tokenizer needed), streamed, greedy,
ignore_eos; `--api openai` sends the same token ids to `/v1/completions` instead, so the same command
measures any OpenAI-compatible server (vLLM's takes `ignore_eos` too). Random ids are drawn below the
server's vocabulary size, read from its `/server_info` (`--vocab-size` instead, for a server without one). Reports throughput, TTFT, inter-token latency
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
    """One streamed request to the native `/generate`; each event says how many tokens are done."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}
    timer = StreamTimer()
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            timer.tokens_done(event["meta_info"]["completion_tokens"])
    return timer.result(len(prompt))


async def one_openai_request(client, url: str, prompt: list[int], output_len: int, headers: dict,
                             model: str) -> dict:
    """One streamed request to `/v1/completions`. A chunk carries no token count: each chunk with a choice
    counts as one token, and the usage chunk at the end corrects the total (its missing tokens are spread
    over the gaps seen, as the native path spreads an event carrying several)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    timer = StreamTimer()
    seen, usage = 0, None
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("choices"):
                seen += 1
                timer.tokens_done(seen)
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    if usage is None:
        raise RuntimeError(f"{url} sent no usage chunk (stream_options.include_usage)")
    return timer.result(len(prompt), total=usage)


class StreamTimer:
    """TTFT and inter-token gaps of one streamed request, from the running count of tokens done."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.last, self.tokens, self.gaps = self.start, 0, []

    def tokens_done(self, done: int) -> None:
        if done <= self.tokens:
            return
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
        else:  # an event carrying k tokens counts k gaps of equal share
            self.gaps += [(now - self.last) / (done - self.tokens)] * (done - self.tokens)
        self.last, self.tokens = now, done

    def result(self, input_tokens: int, total: int | None = None) -> dict:
        gaps = self.gaps
        if total is not None and total > self.tokens > 1:  # fewer events than tokens: each gap held more
            gaps = [g * (self.tokens - 1) / (total - 1) for g in gaps]
        return {"ttft": self.ttft, "itl": gaps, "e2e": time.perf_counter() - self.start,
                "output_tokens": total if total is not None else self.tokens, "input_tokens": input_tokens}


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


def add_api_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", choices=("native", "openai"), default="native",
                        help="native: kestrel's /generate; openai: /v1/completions of any OpenAI-compatible server")
    parser.add_argument("--model", default=None,
                        help="--api openai: the model name to send (default: the first one /v1/models lists)")


async def request_sender(client, base_url: str, api: str, model: str | None, headers: dict):
    """`send(prompt, output_len) -> result` for the chosen API."""
    if api == "native":
        return lambda prompt, n: one_request(client, base_url + "/generate", prompt, n, headers)
    if model is None:
        response = await client.get(base_url + "/v1/models", headers=headers)
        if response.status_code != 200 or not response.json().get("data"):
            raise ValueError(f"could not read the model name from {base_url}/v1/models (HTTP {response.status_code}: "
                             f"{response.text[:200]}); pass --model")
        model = response.json()["data"][0]["id"]
    return lambda prompt, n: one_openai_request(client, base_url + "/v1/completions", prompt, n, headers, model)


async def run(args: argparse.Namespace, concurrency: int | None, seed: int) -> tuple[dict, dict[str, list[float]]]:
    """One run at `concurrency` (None: every request at once) of prompts drawn with `seed`: the summary,
    and the raw TTFT, ITL and end-to-end latencies (seconds)."""
    import httpx

    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(concurrency or args.num_prompts)
    timeout = httpx.Timeout(None, connect=10.0)

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        vocab_size = args.vocab_size or await server_vocab_size(client, base_url, headers)
        send = await request_sender(client, base_url, args.api, args.model, headers)
        rng = random.Random(seed)
        prompts, out_lens = workload(args.num_prompts, args.random_input_len, args.random_output_len,
                                     args.random_range_ratio, vocab_size, rng)
        in_tokens = sum(map(len, prompts))

        async def limited(i: int) -> dict:
            async with limit:
                return await send(prompts[i], out_lens[i])

        await send(prompts[0][:16], 4)  # warm-up
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
    add_api_flags(parser)
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
