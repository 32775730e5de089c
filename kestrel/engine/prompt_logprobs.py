"""Prompt logprobs (`SamplingParams.prompt_logprobs`) from the prefill's own logits: no second pass.

A prefill chunk over positions [s, e) of a request in the batch's `full_logits` returns logits at
each of those positions; the logits at position p score prompt token p + 1. `plan` picks, per chunk,
the positions still to score (a request resumed after retraction has scored some already);
`launch` turns their logits into logprobs on the device and starts their copy to the host; the
engine applies them when it resolves the step, after waiting for the sample's copy that it waits for
anyway, so no step gets a second sync.

Memory: the logits of a scored chunk are [chunk tokens, vocab] float32 (the chunked prefill size
bounds them); log-softmax runs over slices of `SLICE_ROWS` rows so it does not double that.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.core.batch import ScheduledBatch
from kestrel.core.request import Request
from kestrel.sampling.sampler import copy_to_host

SLICE_ROWS = 1024


@dataclass
class PromptLogprobAsk:
    """Positions [start, start + count) of `req` to score in this step; `index` is its row in the batch."""

    req: Request
    index: int
    start: int
    count: int


def plan(batch: ScheduledBatch) -> list[PromptLogprobAsk]:
    """The prompt positions of the batch's prefill chunks whose logprobs are still owed."""
    asks = []
    for i, req in enumerate(batch.reqs[:batch.num_prefill]):
        if req.params.prompt_logprobs is None:
            continue
        first = batch.prefix_lens[i]
        lo = max(first, req.prompt_logprob_len)
        hi = min(first + batch.extend_lens[i], len(req.prompt_ids) - 1)  # the last prompt position scores no prompt token
        if hi > lo:
            asks.append(PromptLogprobAsk(req, i, lo, hi - lo))
    return asks


class PendingPromptLogprobs:
    """The logprobs of one step's asks on their way to the host."""

    def __init__(self, asks: list[PromptLogprobAsk], values: torch.Tensor, ids: torch.Tensor | None) -> None:
        self.asks = asks
        self._ids = ids.to("cpu", non_blocking=True) if ids is not None else None  # [R, n]
        # [R, 2 + n]: the prompt token's logprob and rank, then the top n; recorded after the ids' copy, so
        # it covers both.
        self._values, self._event = copy_to_host(values)

    def apply(self) -> None:
        """Wait for the copy (done by the time the step's sample is) and append to each request."""
        if self._event is not None:
            self._event.synchronize()
        values = self._values.tolist()
        ids = self._ids.tolist() if self._ids is not None else [[]] * len(values)
        row = 0
        for ask in self.asks:
            top_n = ask.req.params.prompt_logprobs
            for vals, top_ids in zip(values[row:row + ask.count], ids[row:row + ask.count]):
                ask.req.prompt_logprobs.append(vals[0])
                ask.req.prompt_logprob_ranks.append(int(vals[1]))
                ask.req.prompt_top_logprobs.append(list(zip(top_ids[:top_n], vals[2:2 + top_n])))
            row += ask.count


def launch(logits: torch.Tensor, batch: ScheduledBatch, asks: list[PromptLogprobAsk]) -> PendingPromptLogprobs:
    """Score the asks' positions from `logits` (the forward's, at `batch.logit_rows()`, with every ask's
    request in `batch.full_logits`) and mark them scored on their requests."""
    spans = batch.logit_spans()
    rows, targets = [], []
    for ask in asks:
        first_row = spans[ask.index][0] + ask.start - batch.prefix_lens[ask.index]
        rows += range(first_row, first_row + ask.count)
        targets += ask.req.prompt_ids[ask.start + 1:ask.start + ask.count + 1]
        ask.req.prompt_logprob_len = ask.start + ask.count
    device = logits.device
    rows_t = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    targets_t = torch.tensor(targets, dtype=torch.int64).to(device, non_blocking=True)
    n = max(ask.req.params.prompt_logprobs for ask in asks)
    values, ids = [], []
    for lo in range(0, len(rows), SLICE_ROWS):
        lp = torch.log_softmax(logits.index_select(0, rows_t[lo:lo + SLICE_ROWS]).float(), dim=-1)
        chosen = lp.gather(1, targets_t[lo:lo + SLICE_ROWS, None])
        # vLLM's rank: 1 + the tokens more likely than the prompt's (exact in float32 for any vocabulary < 2^24)
        rank = (lp > chosen).sum(dim=1, keepdim=True, dtype=torch.float32) + 1
        if n:
            top_vals, top_ids = lp.topk(n, dim=-1)  # sorted descending
            values.append(torch.cat([chosen, rank, top_vals], dim=1))
            ids.append(top_ids)
        else:
            values.append(torch.cat([chosen, rank], dim=1))
    return PendingPromptLogprobs(asks, torch.cat(values), torch.cat(ids) if ids else None)
