"""The message schema between the HTTP process and the engine process (pickled over pipes).

HTTP → engine: `AddRequests`, `AbortRequests`, `LoRACommand`, `FlushCache`, `Shutdown`.
Engine → HTTP: first exactly one of `EngineReady` / `EngineFailed`; then `Admission` (one per
`AddRequests`, always before any output of its requests), `LoRAReply` (one per `LoRACommand`),
`FlushCacheReply` (one per `FlushCache`), `StepOutput` (one per step that changed something) and
`EngineStats` (when the engine goes idle, and periodically while busy).

Every request reports exactly one `TokenDelta` with `finished=True`, including aborted ones, after
which the engine has forgotten it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.core.outputs import EngineStats  # noqa: F401  (sent as it is: Engine.stats())
from kestrel.core.sampling_params import SamplingParams


# ---- HTTP → engine ------------------------------------------------------------------------------
@dataclass
class NewRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    lora_name: str | None = None  # the LoRA adapter it runs with; None: the base model


@dataclass
class AddRequests:
    """Requests of one HTTP call (n choices × prompts): admitted all together or none."""

    group: str
    reqs: list[NewRequest]


@dataclass
class AbortRequests:
    rids: list[str]


@dataclass
class LoRACommand:
    """Load (`path` given) or unload (`path` None) the LoRA adapter `name`."""

    id: str
    name: str
    path: str | None = None


@dataclass
class FlushCache:
    """Drop every cached prefix (SGLang's /flush_cache); done only while no request is queued or running."""

    id: str


@dataclass
class Shutdown:
    """Abort whatever still runs and exit."""


# ---- engine → HTTP ------------------------------------------------------------------------------
@dataclass
class EngineReady:
    pid: int
    vocab_size: int
    max_req_len: int  # a prompt must be shorter; prompt + output never exceeds it
    max_total_tokens: int  # KV pool size in tokens
    context_length: int
    rank_pids: list[int] = field(default_factory=list)  # tensor-parallel ranks 1.. on this node
    # The KV cache as vLLM's cache_config_info describes it.
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    prefix_caching: bool = True
    lora_adapters: dict[str, str] | None = None  # --enable-lora: loaded adapters, name -> path; None: off


@dataclass
class EngineFailed:
    """The model could not be loaded, or a tensor-parallel rank died: the engine process exits after
    sending this."""

    error: str


@dataclass
class Admission:
    group: str
    error: str | None = None  # None: every request of the group was queued
    status: int = 400  # HTTP status for the error: 400 bad input, 500 an engine bug
    param: str | None = None  # the SamplingParams field at fault, when the engine names one (a grammar)


@dataclass
class TokenDelta:
    """What one request got since its previous delta."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # one per token in token_ids, when logprobs were asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # In a request's first delta, when prompt logprobs were asked for: one per prompt token after the first.
    prompt_logprobs: list[float] | None = None
    prompt_logprob_ranks: list[int] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    pooled: list[float] | None = None  # a finished pooling request's result (SamplingParams.pooling)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    error: str | None = None  # the engine's message when finish_reason is "error" (a failed step)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # In a request's first delta: seconds from its arrival in the engine to its first forward.
    queue_time: float | None = None
    # On a finished request's delta, with speculative decoding: entry k = verify rounds that committed k tokens.
    spec_accept_histogram: list[int] | None = None


@dataclass
class StepOutput:
    deltas: list[TokenDelta] = field(default_factory=list)


@dataclass
class LoRAReply:
    """The outcome of a `LoRACommand`: the adapters loaded now, or the error (status 400 / 404)."""

    id: str
    adapters: dict[str, str]
    error: str | None = None
    status: int = 400


@dataclass
class FlushCacheReply:
    """The outcome of a `FlushCache`: False when requests were queued or running, so nothing was dropped."""

    id: str
    flushed: bool
