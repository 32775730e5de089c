"""Prometheus metrics, exported by the HTTP process at `/metrics`.

Token counters and latency histograms are updated from the engine's output messages as they
arrive; the gauges come from the engine's periodic `EngineStats`, and so do the per-step prefill
tokens. Names follow SGLang's (`sglang:num_running_reqs` → `kestrel:num_running_reqs`) so existing
dashboards carry over.

Goodput: each finished request that produced a token counts in `kestrel:requests_within_targets`
(labels `priority` and `outcome` "met" / "missed") against the engine's targets: its TTFT within
--ttft-target-ms and its mean inter-token latency within --itl-target-ms, each where set (with
neither set every request counts as met).
`kestrel:engine_alive` is 0 while the engine process is dead (until its restart has loaded the
model), and the engine's gauges then read 0 rather than its last values: nothing runs.
`kestrel:engine_stall_seconds` is how long the engine has held requests without its loop advancing
(0 while it advances or has none); past --health-stall-timeout, /health answers 503.

The same events feed the vLLM and SGLang names the gateways read (see metrics_dialects).
"""
from __future__ import annotations

import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from kestrel.server.messages import EngineReady, EngineStats
from kestrel.server.metrics_dialects import FinishedRequest, SglangMetrics, VllmMetrics

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """One registry per server (not the process-global one), so several apps can live in one process."""

    def __init__(self, model_name: str, ttft_target_s: float | None = None, itl_target_s: float | None = None) -> None:
        disable_created_metrics()  # no `_created` series next to every counter: noise for dashboards
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kestrel:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kestrel:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kestrel:{name}", doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.engine_alive = gauge("engine_alive", "1 while the engine process runs; 0 while it is dead or restarting")
        self.engine_restarts = counter("engine_restarts", "Times the engine process died and a new one was started")
        self.engine_stall = gauge("engine_stall_seconds", "Seconds the engine has held requests without its loop "
                                                          "advancing (0 while it advances or holds none)")
        self.num_running = gauge("num_running_reqs", "Requests running in the engine (prefill or decode)")
        self.num_waiting = gauge("num_queue_reqs", "Requests waiting in the engine's queue")
        self.token_usage = gauge("token_usage", "Share of the KV pool held by live requests (0..1)")
        self.num_used_tokens = gauge("num_used_tokens", "KV pool slots held by live requests")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens, "
                                                      "over all requests that started generating (0..1)")
        self._prompt_sum = self._cached_sum = 0  # the two counters' values, for the gauge
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self._requests = Counter("kestrel:num_requests", "Finished requests, by finish reason",
                                 labels + ["finish_reason"], registry=registry)
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token", _E2E_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", "Time from arrival in the engine to its first forward",
                                    _TTFT_BUCKETS)
        self.step_prefill = histogram("prefill_tokens_per_step", "New prompt tokens of each engine step that "
                                      "prefilled", _PREFILL_BUCKETS)
        self._targets = ttft_target_s, itl_target_s
        self._within = Counter("kestrel:requests_within_targets", "Finished requests that produced a token, by "
                               "priority and whether they met the TTFT and ITL targets (goodput)",
                               labels + ["priority", "outcome"], registry=registry)
        self.spec_rounds = histogram("spec_accept_length_per_round", "Tokens a speculative verify round committed "
                                     "(accepted drafts + the bonus), counted when the request finishes", _ACCEPT_BUCKETS)
        self.spec_accept_length = gauge("spec_accept_length", "Mean tokens per speculative verify round, over the "
                                                              "finished requests")
        self._spec_sums = [0, 0]  # tokens, rounds
        self.vllm = VllmMetrics(model_name)
        self.sglang = SglangMetrics(model_name)
        registry.register(self.vllm)
        registry.register(self.sglang)

    def on_engine_ready(self, ready: EngineReady) -> None:
        self.engine_alive.set(1)
        self.vllm.on_engine_ready(ready)

    def on_engine_dead(self) -> None:
        self.engine_alive.set(0)
        self.on_stats(EngineStats())

    def on_stats(self, stats: EngineStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.token_usage.set(stats.token_usage)
        self.num_used_tokens.set(stats.num_used_tokens)
        for tokens in stats.step_prefill_tokens:
            self.step_prefill.observe(tokens)
        self.vllm.on_stats(stats)
        self.sglang.on_stats(stats, time.monotonic())

    def on_queued(self, seconds: float) -> None:
        self.queue_time.observe(seconds)
        self.vllm.on_queued(seconds)

    def on_first_tokens(self, prompt_tokens: int, cached_tokens: int, ttft: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_sum += prompt_tokens
        self._cached_sum += cached_tokens
        self.cache_hit_rate.set(self._cached_sum / self._prompt_sum if self._prompt_sum else 0.0)
        self.ttft.observe(ttft)
        self.vllm.on_first_tokens(prompt_tokens, cached_tokens, ttft)
        self.sglang.on_first_tokens(prompt_tokens, cached_tokens, ttft)

    def on_tokens(self, n: int, since_previous: float | None) -> None:
        """`n` tokens arrived together, `since_previous` seconds after the request's previous ones."""
        self.generation_tokens.inc(n)
        if since_previous is not None:
            for _ in range(n):
                self.itl.observe(since_previous / n)
        self.vllm.on_tokens(n, since_previous)
        self.sglang.on_tokens(n, since_previous)

    def on_finish(self, req: FinishedRequest) -> None:
        self._requests.labels(self._model_name, req.finish_reason).inc()
        self.e2e.observe(req.e2e)
        if req.ttft is not None:  # goodput: its TTFT and mean inter-token latency against the targets
            ttft_target, itl_target = self._targets
            met = (ttft_target is None or req.ttft <= ttft_target) and \
                (itl_target is None or req.mean_itl is None or req.mean_itl <= itl_target)
            self._within.labels(self._model_name, str(req.priority), "met" if met else "missed").inc()
        self.vllm.on_finish(req)
        self.sglang.on_finish(req)

    def on_spec_rounds(self, histogram: list[int]) -> None:
        """A finished request's verify rounds: entry k counts the rounds that committed k tokens."""
        for tokens, rounds in enumerate(histogram):
            for _ in range(rounds):
                self.spec_rounds.observe(tokens)
            self._spec_sums[0] += tokens * rounds
            self._spec_sums[1] += rounds
        self.spec_accept_length.set(self._spec_sums[0] / max(1, self._spec_sums[1]))

    def render(self) -> bytes:
        return generate_latest(self.registry)
