"""What gateways read of a real server: /metrics under vLLM's and SGLang's names, a /health that
tells a hung engine loop from a busy one, and what they ask of it: /flush_cache, seen by a KV-events
subscriber (CPU, tiny model, `kestrel serve` as a subprocess)."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.e2e import server_process
from tests.e2e.server_process import ServerProcess, metric_samples, wait_idle
from tests.e2e.test_kv_events import receive_until_cleared

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

NAME = "tiny"
STALL_TIMEOUT = 2.0
VLLM = {"model_name": NAME, "engine": "0"}
SGLANG = {"model_name": NAME}


@pytest.fixture(scope="module")
def events_endpoint(tmp_path_factory) -> str:
    return f"ipc://{tmp_path_factory.mktemp('kv-events')}/pub"


@pytest.fixture(scope="module")
def server(tiny_model, events_endpoint):
    srv = ServerProcess(tiny_model("llama", max_position_embeddings=4096), "--served-model-name", NAME,
                        "--health-stall-timeout", str(STALL_TIMEOUT), "--kv-events-config",
                        json.dumps({"enable_kv_cache_events": True, "endpoint": events_endpoint}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def events(server, events_endpoint):
    """A subscriber to the server's KV-cache events, connected before any test sends a request."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events_endpoint)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
    yield sub
    sub.close(linger=0)
    ctx.term()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def metric(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} is not in /metrics"
    return samples[key]


def test_vllm_and_sglang_names_count_what_was_served(http, events):
    """Fresh server: every count equals what the requests got; gauges read idle; the shared prompt's
    second run is a prefix-cache hit in both dialects."""
    prompts = ["the same long prompt, shared by two requests " * 4] * 2 + ["another one", "a fourth prompt"]
    usages = []
    for i, prompt in enumerate(prompts):
        r = http.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 5 + i,
                                               "ignore_eos": True, "temperature": 0})
        usages.append(r.json()["usage"])
    info = wait_idle(http) and http.get("/server_info").json()
    s = metric_samples(http)
    n = len(prompts)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert cached > 0 and generated == sum(5 + i for i in range(n))

    # vLLM: what llm-d's endpoint picker scrapes, then the counters and histograms dashboards read.
    assert metric(s, "vllm:num_requests_running", **VLLM) == 0
    assert metric(s, "vllm:num_requests_waiting", **VLLM) == 0
    assert metric(s, "vllm:kv_cache_usage_perc", **VLLM) == 0  # idle: cached prefixes count as free
    pool = info["stats"]["max_total_tokens"]
    assert metric(s, "vllm:cache_config_info", engine="0", block_size="1", num_gpu_blocks=str(pool),
                  cache_dtype="auto", enable_prefix_caching="True") == 1
    assert metric(s, "vllm:prefix_cache_queries_total", **VLLM) == prompt
    assert metric(s, "vllm:prefix_cache_hits_total", **VLLM) == cached
    assert metric(s, "vllm:prompt_tokens_total", **VLLM) == prompt
    assert metric(s, "vllm:generation_tokens_total", **VLLM) == generated
    assert metric(s, "vllm:num_preemptions_total", **VLLM) == 0
    assert metric(s, "vllm:request_success_total", finished_reason="length", **VLLM) == n
    assert metric(s, "vllm:request_success_total", finished_reason="stop", **VLLM) == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_time_per_output_token_seconds"):
        assert metric(s, f"vllm:{name}_count", **VLLM) == n, name
        assert metric(s, f"vllm:{name}_bucket", le="+Inf", **VLLM) == n, name
    assert metric(s, "vllm:request_prompt_tokens_sum", **VLLM) == prompt
    # One token per step here: one inter-token gap per token after each request's first.
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert metric(s, f"vllm:{name}_count", **VLLM) == generated - n, name
    assert 0 < metric(s, "vllm:time_to_first_token_seconds_sum", **VLLM) <= \
        metric(s, "vllm:e2e_request_latency_seconds_sum", **VLLM)

    # SGLang: the load gauges routers read, then the totals and histograms.
    assert metric(s, "sglang:num_running_reqs", **SGLANG) == 0
    assert metric(s, "sglang:num_queue_reqs", **SGLANG) == 0
    assert metric(s, "sglang:token_usage", **SGLANG) == 0 and metric(s, "sglang:num_used_tokens", **SGLANG) == 0
    assert metric(s, "sglang:max_total_num_tokens", **SGLANG) == pool
    assert metric(s, "sglang:gen_throughput", **SGLANG) == 0  # nothing runs
    assert metric(s, "sglang:cache_hit_rate", **SGLANG) == pytest.approx(cached / prompt)
    assert metric(s, "sglang:prompt_tokens_total", **SGLANG) == prompt
    assert metric(s, "sglang:generation_tokens_total", **SGLANG) == generated
    assert metric(s, "sglang:cached_tokens_total", **SGLANG) == cached
    assert metric(s, "sglang:num_requests_total", **SGLANG) == n
    assert metric(s, "sglang:num_aborted_requests_total", **SGLANG) == 0
    assert metric(s, "sglang:time_to_first_token_seconds_count", **SGLANG) == n
    assert metric(s, "sglang:e2e_request_latency_seconds_count", **SGLANG) == n
    assert metric(s, "sglang:inter_token_latency_seconds_count", **SGLANG) == generated - n
    assert metric(s, "kestrel:engine_stall_seconds", model_name=NAME) == 0


def _wait_health(http: httpx.Client, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (r := http.get("/health")).status_code != status:
        assert time.monotonic() < deadline, f"/health stayed {r.status_code}: {r.text}"
        time.sleep(0.1)
    return r


def test_health_is_503_while_the_engine_loop_is_stuck_with_work_then_200_once_it_advances(http):
    """The engine process is stopped (SIGSTOP: alive, but its loop does not turn). Idle, that is no
    stall; with a request in flight, /health (and /ping) turn 503 `engine_stalled` past
    --health-stall-timeout and the stall shows in /metrics; once the process continues, the stream
    goes on and /health is 200 again."""
    engine_pid = http.get("/server_info").json()["engine_pid"]
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_TIMEOUT + 1)
        assert http.get("/health").status_code == 200  # no work: nothing to advance
    finally:
        os.kill(engine_pid, signal.SIGCONT)

    body = {"model": NAME, "prompt": "a long story", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        events = (line for line in stream.iter_lines() if line.startswith("data: "))
        next(events)
        deadline = time.monotonic() + 20
        while metric(metric_samples(http), "vllm:num_requests_running", **VLLM) != 1:  # stats of it running
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            r = _wait_health(http, 503, timeout=STALL_TIMEOUT + 10)
            error = r.json()["error"]
            assert error["code"] == "engine_stalled" and "has not advanced" in error["message"], error
            assert http.get("/ping").status_code == 503
            s = metric_samples(http)
            assert metric(s, "kestrel:engine_stall_seconds", model_name=NAME) > STALL_TIMEOUT
            assert metric(s, "kestrel:engine_alive", model_name=NAME) == 1  # its process lives
            assert metric(s, "vllm:num_requests_running", **VLLM) == 1  # the stats before the stop
            assert 0 < metric(s, "vllm:kv_cache_usage_perc", **VLLM) <= 1
            assert 0 < metric(s, "sglang:token_usage", **SGLANG) <= 1
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        for _ in range(5):  # it advances again
            assert "choices" in json.loads(next(events)[len("data: "):])
        r = _wait_health(http, 200, timeout=10)
        assert r.json() == {"status": "ok"}
    wait_idle(http)  # the stream closed early: its request was aborted
    s = metric_samples(http)
    assert metric(s, "kestrel:engine_stall_seconds", model_name=NAME) == 0
    assert metric(s, "vllm:request_success_total", finished_reason="abort", **VLLM) == 1
    assert metric(s, "sglang:num_aborted_requests_total", **SGLANG) == 1
    assert server_process.pid_exists(engine_pid)  # the same engine process: reported, not restarted


def test_flush_cache_is_refused_while_a_request_runs_then_drops_every_cached_prefix(http, events):
    """SGLang's /flush_cache: 400 while a request runs (nothing dropped: the prefix is still a cache hit),
    200 "Cache flushed." once idle; then the same prompt hits nothing, and the event stream says
    AllBlocksCleared."""
    prompt = "a prompt the cache keeps until it is flushed " * 3
    body = {"model": NAME, "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True, "n": 4}
    refused = []
    for _ in range(5):  # the tiny model may finish its answers before the flush arrives: then try again
        with http.stream("POST", "/v1/completions", json=body) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data: "))  # it runs
            r = http.post("/flush_cache")
            refused.append(r.status_code)
        wait_idle(http)  # the stream closed early: its request was aborted, its prefix cached
        if r.status_code == 400:
            assert r.json()["error"]["code"] == "requests_running", r.text
            break
        assert r.status_code == 200, r.text
    assert refused[-1] == 400, refused

    def cached_tokens() -> int:
        r = http.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 1})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached_tokens() > 0
    wait_idle(http)
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.text == "Cache flushed.\n" and r.headers["content-type"].startswith("text/plain")
    batches = [msgpack.unpackb(payload) for _, _, payload in receive_until_cleared(events)]
    assert ["AllBlocksCleared"] in batches[-1][1]
    assert any(e[0] == "BlockStored" for _, evs, _ in batches for e in evs)  # what the flush dropped
    assert cached_tokens() == 0
    wait_idle(http)
    assert http.get("/flush_cache").status_code == 200  # SGLang takes GET too
