"""What runs next under latency targets and priorities (docs/scheduling.md).

Three decisions, asked by the scheduler each step:

- `order`: which waiting (or half-prefilled) request gets prefill first. By priority (vLLM's sense:
  a lower value runs earlier; default 0), then requests already in service (a resumed retraction, which
  streams) and requests past their TTFT target, oldest first; then the rest shortest remaining prefill
  first, so a long prompt cannot hold short ones back. Waiting ages a request: every AGING_TARGETS
  TTFT targets it has waited it rises one priority level and goes before the requests of its new level
  that are not overdue, so neither a long prompt nor a low priority waits for ever. (Aging at the
  target itself would be too soon: a long prompt that cannot meet it anyway would then hold back the
  short ones that can.)
- `prefill_budget`: how many prefill tokens this step may carry while requests decode, so that the
  streams' next token is predicted (`StepCostModel`) to come within the ITL target. Without a target,
  and with nothing decoding, prefill takes the whole chunked_prefill_size.
- `retraction_key` / `preemptible`: under KV pressure the least important requests go first; a request
  that cannot be admitted for memory may retract running requests of a strictly lower priority.
"""
from __future__ import annotations

from typing import Callable

from kestrel.config import SchedulerConfig
from kestrel.core.request import Request
from kestrel.engine.step_cost import StepCostModel, StepShape

# A step's prefill never gets fewer tokens than this (when it gets any), so that prefill progresses
# even where the decodes alone take the whole ITL target.
MIN_PREFILL_TOKENS = 64
# Without a TTFT target, waiting ages a request as if the target were this.
AGING_WITHOUT_TARGET_S = 2.0
AGING_TARGETS = 4


class SchedulePolicy:
    def __init__(self, config: SchedulerConfig, cost: StepCostModel, clock: Callable[[], float]) -> None:
        self.cost = cost
        self.clock = clock
        self.itl_target_s = config.itl_target_ms / 1e3 if config.itl_target_ms is not None else None
        self.target_s = config.ttft_target_ms / 1e3 if config.ttft_target_ms is not None else AGING_WITHOUT_TARGET_S

    # ---- prefill order --------------------------------------------------------------------------
    def order(self, candidates: list[Request]) -> list[Request]:
        now = self.clock()
        return sorted(candidates, key=lambda r: self._rank(r, now))

    def _rank(self, req: Request, now: float) -> tuple:
        waited = now - req.queued_at if req.queued_at is not None else 0.0
        levels = int(waited / (AGING_TARGETS * self.target_s))
        if levels or req.output_ids:
            return req.params.priority - levels, 0, req.arrival
        return req.params.priority, 1, remaining_prefill(req), req.arrival

    # ---- prefill size -----------------------------------------------------------------------------
    def prefill_budget(self, decodes: list[Request], mixed: bool, gap_spent_s: float) -> int | None:
        """Prefill tokens this step may carry beside `decodes` (None: no cap). Mixed, the step itself must
        stay within the target; otherwise the prefill steps since the decodes' last step (`gap_spent_s`)
        and the decode step that follows share it, and 0 means: decode now."""
        if not decodes or self.itl_target_s is None or not self.cost.fitted:
            return None
        context = sum(r.seq_len for r in decodes)
        alone = self.cost.predict(StepShape(len(decodes), context, 0))
        target = self.itl_target_s
        if mixed:
            return max(MIN_PREFILL_TOKENS, self.cost.prefill_tokens_within(target, len(decodes), context))
        tokens = self.cost.prefill_tokens_within(target - alone - gap_spent_s, 0, 0)
        if tokens >= MIN_PREFILL_TOKENS:
            return tokens
        return MIN_PREFILL_TOKENS if gap_spent_s == 0 else 0

    # ---- memory pressure --------------------------------------------------------------------------
    @staticmethod
    def retraction_key(req: Request) -> tuple:
        """Retraction takes the smallest key first: the lowest priority, then the fewest generated tokens
        (the least decoding lost), then the longest prompt (the most KV freed), then the latest arrival."""
        return -req.params.priority, req.num_generated, -len(req.prompt_ids), -req.arrival

    @staticmethod
    def preemptible(req: Request, running: list[Request]) -> list[Request]:
        """Running requests `req` may retract to get the KV it needs: those of a strictly lower priority,
        the first to go first. (Equal priorities never preempt each other: that would trade one
        request's latency for another's and recompute KV for nothing.)"""
        lower = [r for r in running if r.params.priority > req.params.priority]
        return sorted(lower, key=SchedulePolicy.retraction_key)


def remaining_prefill(req: Request) -> int:
    """Prompt tokens still to prefill; a paused chunked prefill counts what it had done (its KV waits in
    the radix cache)."""
    return req.seq_len - max(req.kv_len, req.prefilled_len)
