"""Request state owned by the scheduler."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kestrel.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request.

    KV invariant while the request holds a `req_pool_idx`: slots of tokens `fill_ids[:kv_len]` are in
    `req_to_token[req_pool_idx, :kv_len]` and, on the host, in `slots`; the first `cached_len` of them
    belong to the radix tree (locked through `last_node`), the rest to the request. A retracted
    request loses both and keeps its `output_ids`; it resumes by prefilling `fill_ids` again.

    Overlap scheduling launches the next step before this step's sampled tokens reach the host: such
    tokens are `pending` (indices into the device-side FutureTokens buffer, oldest first) until the
    engine resolves them into `output_ids`. They count in `seq_len`; `fill_ids` holds resolved tokens.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    req_pool_idx: int | None = None
    kv_len: int = 0
    cached_len: int = 0
    last_node: Any = None
    extend_len: int = 0  # new tokens in the step being run
    slots: list[int] = field(default_factory=list)  # host copy of this request's req_to_token row
    pending: list[int] = field(default_factory=list)  # FutureTokens indices of sampled, unresolved tokens
    cached_tokens: int = 0  # prompt tokens reused from the radix cache at first admission
    admitted: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # what went wrong, when finish_reason is "error"
    matched_stop: int | str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    grammar: Any = None  # kestrel.engine.grammar.GrammarState when params has a grammar
    spec_accept_counts: dict[int, int] = field(default_factory=dict)  # verify rounds by tokens committed
    # Scheduler clock: first queued (kept through retraction, so waiting ages it), first given a forward.
    queued_at: float | None = None
    scheduled_at: float | None = None
    prefilled_len: int = 0  # prompt tokens prefilled before its chunked prefill was paused (policy.py)
    lora: Any = None  # kestrel.lora.adapter.LoRAAdapter the request runs with; None: the base model
    lora_slot: int = -1  # its adapter's pool slot while admitted (pinned), else -1

    @property
    def spec_rounds(self) -> int:
        return sum(self.spec_accept_counts.values())

    @property
    def spec_accept_length(self) -> float:
        """Mean tokens committed per verify round (accepted drafts + the bonus)."""
        return sum(k * n for k, n in self.spec_accept_counts.items()) / max(1, self.spec_rounds)

    @property
    def spec_accept_histogram(self) -> list[int]:
        """Entry k: verify rounds that committed k tokens."""
        top = max(self.spec_accept_counts, default=0)
        return [self.spec_accept_counts.get(k, 0) for k in range(top + 1)]
    # params.prompt_logprobs: entry i is prompt token i + 1 given tokens [0, i]. Positions below
    # prompt_logprob_len had their logits launched; a resumed request never matches a cached prefix
    # past it, so every position is computed exactly once.
    prompt_logprob_len: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_logprob_ranks: list[int] = field(default_factory=list)  # 1 + the tokens more likely than the prompt's
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    # params.pooling (kestrel.engine.pooling): prompt positions pooled so far (a mean's running sum of
    # their hidden states, on the device, in `pool_sum`); a resumed request never matches a cached
    # prefix past the positions it still has to pool. `pooled` is the result, set by the last chunk.
    pooled_len: int = 0
    pool_sum: Any = None
    pooled: list[float] | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence so far, pending ones included (the decode loop asks every step)."""
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + len(self.pending)

    @property
    def last_slot(self) -> int:
        """Slot of the last position with KV (continues its page); 0 before any."""
        return self.slots[-1] if self.slots else 0

    def tokens(self, start: int, end: int) -> list[int]:
        """Sequence tokens [start, end) without concatenating; a pending token is -1 - its future index."""
        n, m = len(self.prompt_ids), len(self.prompt_ids) + len(self.output_ids)
        out = self.prompt_ids[start:end] if start < n else []
        if end > n:
            out = out + self.output_ids[max(0, start - n):end - n]
        if end > m:
            out += [-1 - f for f in self.pending[max(0, start - m):end - m]]
        return out

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
