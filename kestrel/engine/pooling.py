"""Pooling requests (`SamplingParams.pooling`): the prefill's final hidden states pooled into an
embedding, or chosen tokens' logits at the last position turned into a score. No second pass and no
sampling: such a request has max_new_tokens=0, so the scheduler finishes it once its prefill ran.

Each prefill chunk of such a request contributes the positions its method reads (`plan`): every one for
a mean (summed into `Request.pool_sum` on the device), position 0 for cls, the last for last. The chunk
that completes the request computes the result on the device and starts its copy to the host
(`launch`); the engine applies it when it resolves the step, before the request finishes, so no step
gets a second sync. The hidden states read are `ForwardOutput.token_hidden` (the final-normed state of
every new token, replicated on every tensor-parallel rank); a score reads the forward's logits at the
request's last row, which every forward computes anyway.
"""
from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

import torch

from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_output import ForwardOutput
from kestrel.core.request import Request
from kestrel.sampling.sampler import copy_to_host


def first_unpooled(req: Request) -> int:
    """The first prompt position this request still has to pool: a cached prefix may cover only those
    before it (the last position always runs, so `last` never limits the match)."""
    pooling = req.params.pooling
    if pooling is None or pooling.method == "last":
        return sys.maxsize
    if pooling.method == "cls":
        return 0 if req.pooled_len == 0 else sys.maxsize
    return req.pooled_len


@dataclass
class PoolAsk:
    """Prompt positions [start, end) of `req` (row `index` of the batch) to pool in this step."""

    req: Request
    index: int
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == len(self.req.prompt_ids) or self.req.params.pooling.method == "cls"


def plan(batch: ScheduledBatch) -> list[PoolAsk]:
    """The positions of the batch's prefill chunks that pooling requests read."""
    asks = []
    for i, req in enumerate(batch.reqs[:batch.num_prefill]):
        pooling = req.params.pooling
        if pooling is None or req.pooled is not None:
            continue
        first, n = batch.prefix_lens[i], len(req.prompt_ids)
        end = first + batch.extend_lens[i]
        if pooling.method == "mean":
            lo, hi = max(first, req.pooled_len), end
        elif pooling.method == "cls":
            lo, hi = (0, 1) if first == 0 and req.pooled_len == 0 else (0, 0)
        else:
            lo, hi = (n - 1, n) if end == n else (0, 0)
        if hi > lo:
            asks.append(PoolAsk(req, i, lo, hi))
    return asks


class PendingPooled:
    """The results of one step's completed pooling requests on their way to the host."""

    def __init__(self, reqs: list[Request], lengths: list[int], values: torch.Tensor) -> None:
        self.reqs, self.lengths = reqs, lengths
        self._values, self._event = copy_to_host(values)

    def apply(self) -> None:
        """Wait for the copy (done by the time the step's sample is) and give each request its result."""
        if self._event is not None:
            self._event.synchronize()
        values = self._values.tolist()
        for req, lo, hi in zip(self.reqs, itertools.accumulate(self.lengths, initial=0),
                               itertools.accumulate(self.lengths)):
            req.pooled = values[lo:hi]


def launch(out: ForwardOutput, batch: ScheduledBatch, asks: list[PoolAsk]) -> PendingPooled | None:
    """Pool the asks' positions from the forward's hidden states; the requests it completes get their
    result computed and sent to the host."""
    token_starts = list(itertools.accumulate(batch.extend_lens, initial=0))
    spans = batch.logit_spans()
    done, results = [], []
    for ask in asks:
        req, pooling = ask.req, ask.req.params.pooling
        first_row = token_starts[ask.index] + ask.start - batch.prefix_lens[ask.index]
        hidden = out.token_hidden[first_row:first_row + ask.end - ask.start].float()
        if pooling.method == "mean":
            chunk_sum = hidden.sum(dim=0)
            req.pool_sum = chunk_sum if req.pool_sum is None else req.pool_sum + chunk_sum
        req.pooled_len = ask.end
        if not ask.completes:
            continue
        if pooling.score_token_ids is not None:
            row = spans[ask.index][0] + spans[ask.index][1] - 1  # the request's last position
            ids = torch.tensor(pooling.score_token_ids, dtype=torch.int64).to(out.logits.device, non_blocking=True)
            result = torch.softmax(out.logits[row].float().index_select(0, ids), dim=0)
        else:
            result = req.pool_sum / len(req.prompt_ids) if pooling.method == "mean" else hidden[0]
            req.pool_sum = None
            if pooling.dimensions is not None:
                result = result[:pooling.dimensions]
            if pooling.normalize:
                result = torch.nn.functional.normalize(result, dim=0)
        done.append(req)
        results.append(result)
    if not done:
        return None
    return PendingPooled(done, [r.numel() for r in results], torch.cat(results))
