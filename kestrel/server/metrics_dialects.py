"""The engine's figures under vLLM's and SGLang's metric names, for the gateways and dashboards that read them.

Routers pick a replica from its Prometheus metrics as vLLM or SGLang name them: llm-d's endpoint
picker (Gateway API inference extension) reads `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` and `vllm:cache_config_info` (`block_size`, `num_gpu_blocks`), or their
SGLang twins `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`; Dynamo's and
other planners and the vLLM / SGLang Grafana boards read the latency histograms and token counters.
Each dialect keeps its project's names, types, labels, bucket bounds and counting rules (docs/apis.md
lists them), fed by the same events as kestrel's own metrics (`ServerMetrics` passes them on).

A dialect is a Prometheus collector over plain numbers: an update is a few additions (no lock, no
metric object per series), and the families are built when /metrics is scraped. Updates and scrapes
all run on the HTTP process's event loop, so nothing here needs a lock.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kestrel.core.outputs import EngineStats
from kestrel.server.messages import EngineReady


@dataclass
class FinishedRequest:
    """What the metrics learn of a request when it ends (aborted and failed ones too)."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    priority: int
    e2e: float  # seconds from its arrival to its end
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft: float | None  # None: it produced no token
    mean_itl: float | None  # seconds between its tokens on average; None with fewer than two


class PlainHistogram:
    """A histogram as Prometheus exposes it (cumulative `le` buckets, sum, count) kept as a list of ints."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """`times` observations of `value` (bucket `le` holds values <= le: the first bound not below it)."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            cumulative.append((floatToGoString(bound), total))
        family.add_metric(labels, cumulative, self.sum)


def _one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's bounds for per-request token counts."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return bounds
            bounds.append(m * scale)
        scale *= 10


# vLLM's bucket bounds (vllm/v1/metrics/loggers.py).
_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0, 160.0, 640.0, 2560.0)
_VLLM_TOKEN_GAP = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0)
_VLLM_REQUEST_TIME = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                      480.0, 960.0, 1920.0, 7680.0)
_VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values, each series from 0


class VllmMetrics(Collector):
    """vLLM's (V1 engine's) names, labelled `model_name` and `engine` ("0": one engine per server).

    As vLLM counts: one inter-token observation per output step of a request, however many tokens it
    brought; `time_per_output_token_seconds` is the older name of the same histogram, which vLLM
    still exposes; prefix-cache queries and hits in prompt tokens; `num_preemptions` counts retractions.
    """

    def __init__(self, model_name: str) -> None:
        self.labels = [model_name, "0"]
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.engine: EngineReady | None = None
        self.prefix_queries = self.prefix_hits = self.prompt_tokens = self.generation_tokens = 0
        self.preemptions = 0
        self._engine_retractions = 0  # the live engine's count so far (a restarted engine starts at 0)
        self.success = dict.fromkeys(_VLLM_FINISH_REASONS, 0)
        self.ttft = PlainHistogram(_VLLM_TTFT)
        self.itl = PlainHistogram(_VLLM_TOKEN_GAP)
        self.request_tpot = PlainHistogram(_VLLM_TOKEN_GAP)
        self.e2e = PlainHistogram(_VLLM_REQUEST_TIME)
        self.queue_time = PlainHistogram(_VLLM_REQUEST_TIME)
        # Bounded by the context length, which the engine reports when it is ready.
        self.request_prompt = self.request_generation = PlainHistogram(())

    # ---- events ----------------------------------------------------------------------------------
    def on_engine_ready(self, ready: EngineReady) -> None:
        if self.engine is None:  # a restarted engine has the same context length: the counts go on
            bounds = _one_two_five(ready.context_length)
            self.request_prompt, self.request_generation = PlainHistogram(bounds), PlainHistogram(bounds)
        self.engine = ready

    def on_stats(self, stats: EngineStats) -> None:
        self.running, self.waiting, self.kv_usage = stats.num_running, stats.num_waiting, stats.token_usage
        self.preemptions += max(0, stats.num_retractions - self._engine_retractions)
        self._engine_retractions = stats.num_retractions

    def on_queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def on_first_tokens(self, prompt_tokens: int, cached_tokens: int, ttft: float) -> None:
        self.prefix_queries += prompt_tokens
        self.prefix_hits += cached_tokens
        self.prompt_tokens += prompt_tokens
        self.ttft.observe(ttft)

    def on_tokens(self, n: int, since_previous: float | None) -> None:
        self.generation_tokens += n
        if since_previous is not None:
            self.itl.observe(since_previous)

    def on_finish(self, req: FinishedRequest) -> None:
        self.success[req.finish_reason] = self.success.get(req.finish_reason, 0) + 1
        self.e2e.observe(req.e2e)
        self.request_prompt.observe(req.prompt_tokens)
        self.request_generation.observe(req.generated_tokens)
        if req.mean_itl is not None:
            self.request_tpot.observe(req.mean_itl)

    # ---- exposition ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        names, values = ["model_name", "engine"], self.labels
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", names, values,
                     self.running)
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", names, values,
                     self.waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", names, values,
                     self.kv_usage)
        if (engine := self.engine) is not None:  # an info metric: the labels carry the values, the sample is 1
            info = {"engine": "0", "block_size": str(engine.page_size),
                    "num_gpu_blocks": str(engine.max_total_tokens // engine.page_size),
                    "cache_dtype": engine.kv_cache_dtype, "enable_prefix_caching": str(engine.prefix_caching)}
            yield _gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
                         list(info.values()), 1)
        yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                       names, values, self.prefix_queries)
        yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", names,
                       values, self.prefix_hits)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", names, values,
                       self.preemptions)
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names, values,
                       self.prompt_tokens)
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", names, values,
                       self.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*names, "finished_reason"])
        for reason, count in self.success.items():
            success.add_metric([*values, reason], count)
        yield success
        yield _histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         names, values, self.ttft)
        yield _histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                         names, values, self.itl)
        yield _histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds "
                         "(the older name of vllm:inter_token_latency_seconds).", names, values, self.itl)
        yield _histogram("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds "
                         "per request.", names, values, self.request_tpot)
        yield _histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                         names, values, self.e2e)
        yield _histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                         names, values, self.queue_time)
        yield _histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", names, values,
                         self.request_prompt)
        yield _histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", names, values,
                         self.request_generation)


# SGLang's default bucket bounds (python/sglang/srt/metrics/collector.py).
_SGLANG_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_SGLANG_E2E = (*_SGLANG_TTFT, 600, 1200, 1800, 2400)
_SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.6,
               0.8, 1.0, 2.0, 4.0, 6.0, 8.0)


class SglangMetrics(Collector):
    """SGLang's names, labelled `model_name`.

    As SGLang counts: tokens of a request in the totals when it finishes; tokens that arrive together
    split the gap since the request's previous ones evenly (each one observation); `gen_throughput`
    is the generated tokens per second between two engine stats (0 while nothing runs);
    `cache_hit_rate` is cached prompt tokens / prompt tokens since start.
    """

    def __init__(self, model_name: str) -> None:
        self.labels = [model_name]
        self.stats = EngineStats()
        self.gen_throughput = 0.0
        self._generated = 0  # since the previous stats
        self._stats_at: float | None = None
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.requests = self.aborted = 0
        self._first_prompt = self._first_cached = 0  # of requests that started generating, for the hit rate
        self.ttft = PlainHistogram(_SGLANG_TTFT)
        self.itl = PlainHistogram(_SGLANG_ITL)
        self.e2e = PlainHistogram(_SGLANG_E2E)

    # ---- events ----------------------------------------------------------------------------------
    def on_stats(self, stats: EngineStats, now: float) -> None:
        if self._stats_at is not None and now > self._stats_at:
            self.gen_throughput = self._generated / (now - self._stats_at) if stats.num_running else 0.0
        self.stats, self._stats_at, self._generated = stats, now, 0

    def on_first_tokens(self, prompt_tokens: int, cached_tokens: int, ttft: float) -> None:
        self._first_prompt += prompt_tokens
        self._first_cached += cached_tokens
        self.ttft.observe(ttft)

    def on_tokens(self, n: int, since_previous: float | None) -> None:
        self._generated += n
        if since_previous is not None:
            self.itl.observe(since_previous / n, n)

    def on_finish(self, req: FinishedRequest) -> None:
        self.prompt_tokens += req.prompt_tokens
        self.generation_tokens += req.generated_tokens
        self.cached_tokens += req.cached_tokens
        self.requests += 1
        self.aborted += req.finish_reason == "abort"
        self.e2e.observe(req.e2e)

    # ---- exposition ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        names, values, stats = ["model_name"], self.labels, self.stats
        for name, doc, value in (
                ("num_running_reqs", "The number of running requests.", stats.num_running),
                ("num_queue_reqs", "The number of requests in the waiting queue.", stats.num_waiting),
                ("num_used_tokens", "The number of used tokens.", stats.num_used_tokens),
                ("token_usage", "The token usage.", stats.token_usage),
                ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
                 stats.max_total_tokens),
                ("gen_throughput", "The generation throughput (token/s).", self.gen_throughput),
                ("cache_hit_rate", "The prefix cache hit rate.",
                 self._first_cached / self._first_prompt if self._first_prompt else 0.0)):
            yield _gauge(f"sglang:{name}", doc, names, values, value)
        for name, doc, value in (
                ("prompt_tokens_total", "Number of prefill tokens processed.", self.prompt_tokens),
                ("generation_tokens_total", "Number of generation tokens processed.", self.generation_tokens),
                ("cached_tokens_total", "Number of cached prompt tokens.", self.cached_tokens),
                ("num_requests_total", "Number of requests processed.", self.requests),
                ("num_aborted_requests_total", "Number of requests aborted.", self.aborted)):
            yield _counter(f"sglang:{name}", doc, names, values, value)
        yield _histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         names, values, self.ttft)
        yield _histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                         names, values, self.itl)
        yield _histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                         names, values, self.e2e)


def _gauge(name: str, doc: str, label_names: list[str], label_values: list[str], value: float) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=label_names)
    family.add_metric(label_values, value)
    return family


def _counter(name: str, doc: str, label_names: list[str], label_values: list[str], value: float) -> Metric:
    family = CounterMetricFamily(name, doc, labels=label_names)  # the samples get the `_total` suffix
    family.add_metric(label_values, value)
    return family


def _histogram(name: str, doc: str, label_names: list[str], label_values: list[str],
               histogram: PlainHistogram) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=label_names)
    histogram.add_to(family, label_values)
    return family
