"""What rank 0 broadcasts each step: the scheduled batch and how to sample it, as plain data.

Every rank runs the same forward on its shard and samples the same rows with the same inputs. The
sampler's randomness is a pure function of (request seed, position, token id) and the vocab-parallel
LM head all-gathers the logits, so each rank holds bit-identical logits and draws the same tokens
without a broadcast of them. Each rank writes its tokens into its own FutureTokens at the indices
rank 0 chose, so the next batch's not-yet-known inputs resolve to the same ids everywhere.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kestrel.core.batch import ScheduledBatch
from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """The fields of a Request that `SamplingBatch.from_requests` reads. The token lists travel only
    for penalties, the one stage that reads them."""

    params: SamplingParams
    seed: int
    seq_len: int
    num_generated: int
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, req: Request) -> "SamplingRow":
        tokens = {}
        if req.params.has_penalties:
            tokens = dict(prompt_ids=req.prompt_ids, output_ids=req.output_ids, pending=req.pending)
        return cls(req.params, req.seed, req.seq_len, req.num_generated, **tokens)


@dataclass
class StepCommand:
    """`batch` without its Request objects; when the step samples, `rows` (one per sampled request),
    the logits rows they sample from and their FutureTokens indices."""

    batch: ScheduledBatch
    rows: list[SamplingRow]
    logit_rows: list[int]
    futures: list[int]

    @classmethod
    def of(cls, batch: ScheduledBatch, sampled: list[Request], logit_rows: list[int],
           futures: list[int]) -> "StepCommand":
        return cls(dataclasses.replace(batch, reqs=[]), [SamplingRow.of(r) for r in sampled], logit_rows, futures)
