"""Soak: hundreds of concurrent requests of mixed kinds and lengths against a live `kestrel serve`, some
clients leaving mid-stream, an oversized body and a hostile input in the middle of it all.

Afterwards nothing is lost (every request the server took is counted finished or aborted, every
client that stayed got a well-formed answer of exactly the tokens it asked for), the KV pool is
full again, and the HTTP process's memory stayed within a bound. Bounded: a fixed number of
requests, an overall deadline, traffic to 127.0.0.1 only.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, memory_mib, metric, metric_samples, wait_idle

NUM_REQUESTS = 300
LEAVE_SHARE = 0.15  # clients that disconnect after a few events
DEADLINE_S = 150
MEMORY_BOUND_MIB = 200  # growth of the HTTP process's peak RSS over the whole run
NAME = "soak"


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ServerProcess(tiny_model("llama", max_position_embeddings=1024), "--served-model-name", NAME)
    yield srv
    srv.stop()


def plan(rng: random.Random) -> list[dict]:
    """One spec per request: endpoint, streamed or not, tokens asked, whether the client leaves early."""
    specs = []
    for i in range(NUM_REQUESTS):
        leaves = rng.random() < LEAVE_SHARE
        specs.append({"i": i, "kind": rng.choice(["completion", "chat", "generate"]),
                      "stream": leaves or rng.random() < 0.8, "leaves": leaves,
                      "tokens": rng.randint(30, 40) if leaves else rng.randint(1, 24),
                      "leave_after": rng.randint(1, 3), "prompt": " ".join(rng.choice("abcdefgh") * rng.randint(1, 9)
                                                                            for _ in range(rng.randint(1, 30)))})
    return specs


def request_of(spec: dict) -> tuple[str, dict]:
    common = {"temperature": 0.8, "seed": spec["i"], "stream": spec["stream"]}
    if spec["kind"] == "generate":
        return "/generate", {"text": spec["prompt"], "stream": spec["stream"], "sampling_params": {
            "max_new_tokens": spec["tokens"], "ignore_eos": True, "temperature": 0.8, "seed": spec["i"]}}
    body = {**common, "max_tokens": spec["tokens"], "ignore_eos": True,
            "stream_options": {"include_usage": True} if spec["stream"] else None}
    if spec["kind"] == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": spec["prompt"]}]}
    return "/v1/completions", {**body, "prompt": spec["prompt"]}


def check_stream(spec: dict, events: list[str]) -> None:
    """Every event JSON, [DONE] last and only there, one finish_reason, exactly the tokens asked for."""
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1], (spec, events[-3:])
    payloads = [json.loads(e) for e in events[:-1]]
    if spec["kind"] == "generate":
        last = payloads[-1]["meta_info"]
        assert last["finish_reason"] == {"type": "length", "length": spec["tokens"]}, (spec, last)
        assert all(p["meta_info"]["finish_reason"] is None for p in payloads[:-1])
        return
    reasons = [p["choices"][0]["finish_reason"] for p in payloads if p["choices"]]
    assert reasons[-1] == "length" and reasons.count("length") == 1 and set(reasons[:-1]) <= {None}, (spec, reasons)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == spec["tokens"], spec


def check_whole(spec: dict, body: dict) -> None:
    if spec["kind"] == "generate":
        assert body["meta_info"]["completion_tokens"] == spec["tokens"], (spec, body)
    else:
        assert body["usage"]["completion_tokens"] == spec["tokens"] and body["choices"][0]["finish_reason"] == \
            "length", (spec, body)


async def one(client: httpx.AsyncClient, spec: dict, started: asyncio.Event) -> str:
    path, body = request_of(spec)
    if not spec["stream"]:
        r = await client.post(path, json=body)
        started.set()
        assert r.status_code == 200, (spec, r.text)
        check_whole(spec, r.json())
        return "whole"
    events: list[str] = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, (spec, await r.aread())
        started.set()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if spec["leaves"] and len(events) >= spec["leave_after"]:
                    return "left"  # leaving the block closes the connection mid-stream
    check_stream(spec, events)
    return "stream"


async def middle(client: httpx.AsyncClient, half_started: asyncio.Event) -> list[float]:
    """Once half the requests are under way: an oversized body, a lone surrogate, /health timings."""
    await half_started.wait()
    oversized = await client.post("/v1/completions", content=b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}',
                                  headers={"Content-Type": "application/json"})
    assert oversized.status_code == 413 and oversized.json()["error"]["code"] == "request_too_large"
    hostile = await client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": '
                                                                b'"\\udead"}]}', headers={"Content-Type": "application/json"})
    assert hostile.status_code == 400 and hostile.json()["error"]["param"] == "messages"
    latencies = []
    for _ in range(20):
        start = time.perf_counter()
        assert (await client.get("/health")).status_code == 200
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.05)
    return latencies


async def soak(url: str, specs: list[dict]) -> tuple[list[str], list[float]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    # A non-streaming request near the end of the queue waits for most of the run: only the overall
    # deadline bounds it.
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S, limits=limits) as client:
        started = [asyncio.Event() for _ in specs]
        half = asyncio.Event()

        async def watch_half() -> None:
            for event in started[:len(started) // 2]:
                await event.wait()
            half.set()

        watcher = asyncio.create_task(watch_half())
        results = await asyncio.gather(*(one(client, s, e) for s, e in zip(specs, started)), middle(client, half))
        watcher.cancel()
    return list(results[:-1]), results[-1]


def test_soak_hundreds_of_streams_with_disconnects_and_hostile_input(server):
    rng = random.Random(12)
    specs = plan(rng)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2})
        wait_idle(http)
        before_metrics = metric_samples(http)
        before = memory_mib(server.proc.pid)
        start = time.monotonic()
        outcomes, health = asyncio.run(asyncio.wait_for(soak(server.url, specs), DEADLINE_S))
        elapsed = time.monotonic() - start
        stats = wait_idle(http)  # nothing running or queued, and the KV pool is full again
        after = memory_mib(server.proc.pid)
        after_metrics = metric_samples(http)
        info = http.get("/server_info").json()
    assert stats["num_used_tokens"] == 0 and info["admission"]["requests"] == 0
    left = outcomes.count("left")
    assert left == sum(s["leaves"] for s in specs) and left > 20
    assert outcomes.count("stream") + outcomes.count("whole") == NUM_REQUESTS - left

    def finished(reason: str) -> float:
        return metric(after_metrics, "kestrel:num_requests_total", model_name=NAME, finish_reason=reason) - \
            metric(before_metrics, "kestrel:num_requests_total", model_name=NAME, finish_reason=reason)

    # Nothing lost: every request the server took ended exactly once, as asked or aborted (a client that
    # left after its last token was generated may still count as finished).
    assert finished("length") + finished("abort") == NUM_REQUESTS
    assert NUM_REQUESTS - left <= finished("length") and finished("abort") <= left
    assert finished("error") == 0
    assert max(health) < 0.5, health  # under full load, on a shared 2-core box
    assert after["VmHWM"] - before["VmRSS"] < MEMORY_BOUND_MIB, (before, after)
    print(f"\nsoak: {NUM_REQUESTS} requests ({left} left early) in {elapsed:.1f} s; /health max "
          f"{1e3 * max(health):.0f} ms; HTTP process RSS {before['VmRSS']:.0f} -> {after['VmRSS']:.0f} MiB "
          f"(peak {after['VmHWM']:.0f})")
