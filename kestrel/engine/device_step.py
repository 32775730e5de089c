"""The device half of a step: a batch's forward, then the sample of its rows into FutureTokens.

Rank 0's step loop and every other tensor-parallel rank run exactly this with the same inputs, so their
collectives meet and each rank writes the same tokens into its own FutureTokens (see
kestrel.distributed.step_command). Rank 0 does its host work between the two halves: prompt logprobs
read the forward's logits, and grammar masks are filled once the previous step's tokens are accepted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from kestrel.core.batch import ScheduledBatch
from kestrel.sampling.sampler import PendingSample, Sampler, SamplingBatch, sampled_logits

if TYPE_CHECKING:
    from kestrel.core.forward_output import ForwardOutput


@dataclass
class Forwarded:
    """A launched forward (`out`: its ForwardOutput) and, when it samples, its rows' logits and sampling
    parameters (a grammar's mask may still be added to `sampling` before `DeviceStep.sample`)."""

    out: "ForwardOutput"
    logits: torch.Tensor | None = None
    sampling: SamplingBatch | None = None


class DeviceStep:
    def __init__(self, runner, sampler: Sampler, vocab_size: int, eos_token_ids: set[int],
                 device: torch.device) -> None:
        self.runner, self.sampler = runner, sampler
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, eos_token_ids, device

    def forward(self, batch: ScheduledBatch, rows: Sequence, logit_rows: list[int]) -> Forwarded:
        """Launch the forward; `rows` (Requests, or their SamplingRows on other ranks) sample from
        `logit_rows` of its logits. Nothing here waits for the device."""
        out = self.runner.forward(batch)
        if not rows:
            return Forwarded(out)
        sampling = SamplingBatch.from_requests(rows, self.vocab_size, self.eos_token_ids, self.device)
        return Forwarded(out, sampled_logits(out.logits, logit_rows), sampling)

    def sample(self, forwarded: Forwarded, futures: list[int]) -> PendingSample:
        """Sample the forward's rows and write the tokens into FutureTokens at `futures`."""
        pending = self.sampler.sample(forwarded.logits, forwarded.sampling)
        self.runner.future_tokens.write(futures, pending.token_ids)
        return pending
