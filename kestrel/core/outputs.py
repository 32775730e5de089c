"""What the engine returns for a request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    """The generated part of one request.

    meta keys: id, prompt_tokens, completion_tokens, cached_tokens, finish_reason
    ("stop" | "length" | "abort" | "error"; then `error` holds the message), matched_stop (token id or string that stopped it, or None),
    output_token_logprobs / output_top_logprobs ((logprob, token id) pairs; lists of (token id, logprob))
    when logprobs were asked for, and prompt_token_logprobs / prompt_top_logprobs, the same for every
    prompt token (the first one's logprob and top list are None), when prompt_logprobs were; `pooled`
    (the embedding, or the scores of `pooling.score_token_ids`) for a pooling request.
    """

    text: str
    token_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = True


@dataclass
class EngineStats:
    """A snapshot of the engine's load (the server's gauges)."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_tokens: int = 0  # KV slots held by live requests (cached, unlocked prefixes count as free)
    num_evictable_tokens: int = 0  # KV slots holding unlocked radix-cache prefixes
    max_total_tokens: int = 0
    num_retractions: int = 0
    # New prompt tokens of each step that prefilled, since the previous stats (the engine process fills it).
    step_prefill_tokens: list[int] = field(default_factory=list)
    # Turns of the engine process's loop that stepped the engine (the engine process fills it): its
    # heartbeat, which the HTTP side's liveness check (/health) watches while requests are in flight.
    loop_turns: int = 0

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_tokens if self.max_total_tokens else 0.0


@dataclass
class StepInfo:
    """One engine step that ran a batch: what it was and its wall time, host work included."""

    mode: str  # the forward mode's value ("extend", "decode", "mixed", ...)
    num_reqs: int
    num_tokens: int  # new tokens in the forward
    seconds: float
    num_prefill_tokens: int = 0  # of those, new prompt tokens (prefill chunks)
    # Where the step's wall time went on the host, in seconds (STEP_PHASES): a phase that waits for the
    # device shows the device; one that does not shows the host's own work.
    phases: tuple[float, ...] = ()


# The parts of an engine step, in order: the batch in flight resolved before scheduling (when the next
# batch cannot overlap it), scheduling, launching the new batch (a verify round: the whole round), and
# the batch in flight resolved after the launch (overlapped).
STEP_PHASES = ("resolve_first", "schedule", "launch", "resolve")
