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
    `req_to_token[req_pool_idx, :kv_len]`; the first `cached_len` of them belong to the radix tree
    (locked through `last_node`), the rest to the request. A retracted request loses both and keeps
    its `output_ids`; it resumes by prefilling `fill_ids` again.
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
    last_slot: int = 0  # host copy of the slot of position kv_len + extend_len - 1 (continues its page)
    cached_tokens: int = 0  # prompt tokens reused from the radix cache at first admission
    admitted: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        """len(fill_ids), without building the list (the decode loop asks every step)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without concatenating prompt and output."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - n)]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
