"""What the engine's step loop asks of a speculative algorithm, and the one worker it holds.

A worker proposes and verifies; the step loop alone changes the scheduler. A decode round:
1. `decode_tokens(num_running)` sizes the next decode step: a verify tree's nodes per request, or 1
   where speculation stops paying (`speculative_disable_batch_size`);
2. `verify(batch)` drafts, runs the target's TARGET_VERIFY and accepts, and returns a `CommitPlan`;
3. the step loop commits the plan: the batch's positions advance, each accepted path keeps its KV and
   the other new slots are freed;
4. a worker with a draft model (`has_draft_kv`) then runs the draft over the committed tokens
   (`after_commit`), with the KV rollback's row writes and moves drained from the scheduler;
5. the step loop gives the committed tokens to their requests, as it does a plain step's.
After every plain step (prefill chunks, decodes) `after_forward` lets a draft model catch up on the
same positions. EAGLE, EAGLE-3, NEXTN (MTP) and STANDALONE are `DraftWorker`s; NGRAM is `NgramWorker`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from kestrel.core.batch import ScheduledBatch
from kestrel.speculative.draft_worker import DraftWorker
from kestrel.speculative.ngram_worker import NgramWorker
from kestrel.speculative.verify import CommitPlan

if TYPE_CHECKING:
    from kestrel.config import EngineConfig
    from kestrel.core.forward_output import ForwardOutput


class SpeculativeWorker(Protocol):
    accept_lengths: list[int]  # tokens committed per request-round, for statistics
    # Target layers whose input hidden states the draft reads: every target forward captures them.
    target_capture: tuple[int, ...]
    # A draft model with KV of its own, which runs after each target forward and each commit.
    has_draft_kv: bool

    def decode_tokens(self, num_running: int) -> int:
        """New positions per running request in the next decode step."""

    def verify(self, batch: ScheduledBatch) -> CommitPlan:
        """Draft, verify and accept for a TARGET_VERIFY batch; changes nothing in the scheduler."""

    def after_forward(self, batch: ScheduledBatch, out: "ForwardOutput", sampled_rows: list[int],
                      futures: list[int]) -> None:
        """A plain step's forward was launched and sampled into `futures` (FutureTokens indices)."""

    def after_commit(self, batch: ScheduledBatch, plan: CommitPlan, writes: torch.Tensor,
                     moves: torch.Tensor) -> None:
        """`plan` was committed; `writes` and `moves` are its KV rollback (only with `has_draft_kv`)."""


def create_worker(config: "EngineConfig", runner, draft, kv_memory, future_tokens,
                  eos_token_ids: set[int]) -> SpeculativeWorker | None:
    """The worker of `config.speculative.speculative_algorithm`; None when speculative decoding is off.
    `draft` is the loaded draft model of the draft-model algorithms (None for NGRAM)."""
    if config.speculative.speculative_algorithm == "NGRAM":
        return NgramWorker(config.speculative, runner, eos_token_ids)
    if draft is not None:
        return DraftWorker(config, runner, draft, kv_memory, future_tokens, eos_token_ids)
    return None
