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
  streams' next token is predicted (`StepCostModel`) to come within the ITL target, less the model's
  own error (`overrun`: how much longer than predicted the steps it sized took). Before the model is
  fitted, a small chunk (MIN_PREFILL_TOKENS) per decode step; never more than the model trusts itself
  to predict (`trusted_prefill_tokens`): the chunk grows as the model learns. Without a target, and
  with nothing decoding, prefill takes the whole chunked_prefill_size.
- `retraction_key` / `preemptible`: under KV pressure the least important requests go first; a request
  that cannot be admitted for memory may retract running requests of a strictly lower priority.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from kestrel.config import SchedulerConfig
from kestrel.core.request import Request
from kestrel.engine.step_cost import PREFILL_STEP, StepCostModel, StepShape

# A step's prefill never gets fewer tokens than this (when it gets any), so that prefill progresses
# even where the decodes alone take the whole ITL target; and the chunk an unfitted model allows.
MIN_PREFILL_TOKENS = 64
# Whether a step that cannot meet the ITL target carries the tokens that cost as much as a prefilling step's
# fixed cost rather than MIN_PREFILL_TOKENS (`_chunk_past_the_target`); a module constant so that a
# benchmark can compare both in one process.
AMORTIZE_PREFILL_STEP = True
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

    def aged(self, req: Request) -> bool:
        """Whether `req` has waited long enough to have gained a priority level."""
        return self._levels(req, self.clock()) > 0

    def _levels(self, req: Request, now: float) -> int:
        waited = now - req.queued_at if req.queued_at is not None else 0.0
        return int(waited / (AGING_TARGETS * self.target_s))

    def _rank(self, req: Request, now: float) -> tuple:
        levels = self._levels(req, now)
        if levels or req.output_ids:
            return req.params.priority - levels, 0, req.arrival
        return req.params.priority, 1, remaining_prefill(req), req.arrival

    # ---- prefill size -----------------------------------------------------------------------------
    def prefill_budget(self, decodes: list[Request], mixed: bool, gap_spent_s: float,
                       chunked: Request | None = None) -> int | None:
        """Prefill tokens this step may carry beside `decodes` (None: no cap); `chunked` is the prompt
        being chunked, which most likely takes them (its new tokens attend over its done part). Mixed,
        the step itself must stay within the target; otherwise the prefill steps since the decodes' last
        step (`gap_spent_s`) and the decode step that follows share it, and 0 means: decode now."""
        if not decodes or self.itl_target_s is None:
            return None
        if not self.cost.fitted:  # what prefill costs is not known yet: a small chunk, which teaches the model
            return MIN_PREFILL_TOKENS if mixed or gap_spent_s == 0 else 0
        context = sum(r.seq_len for r in decodes)
        target = self.itl_target_s / self.cost.overrun
        prefix = chunked.kv_len if chunked is not None else 0
        if mixed:
            tokens = self.cost.prefill_tokens_within(target, len(decodes), context, prefix)
        else:
            tokens = self._within_gap(target - gap_spent_s, len(decodes), context, prefix)
            if chunked is not None and tokens >= chunked.seq_len - prefix:
                # Its last chunk: the decode step that follows carries it too.
                tokens = self._within_gap(target - gap_spent_s, len(decodes) + 1, context + chunked.seq_len, prefix)
            if tokens < MIN_PREFILL_TOKENS and gap_spent_s > 0:
                return 0
        if tokens == 0:
            return self._chunk_past_the_target(prefix)
        return max(MIN_PREFILL_TOKENS, min(tokens, self.cost.trusted_prefill_tokens))

    def _chunk_past_the_target(self, prefix: int) -> int:
        """The chunk of a step that cannot meet the target whatever it carries (the decodes and a
        prefilling step's fixed cost alone take longer): the tokens whose own work costs as much as that
        fixed cost. A small chunk would pay the fixed cost again and again for little work, and prompts
        would wait ever longer while the running batch drains (on the H100, 64-token chunks under a 16 ms
        target halved the c64 output rate); this one keeps prefill at half its rate or more, and the step
        overshoots the target as little as that allows."""
        if not AMORTIZE_PREFILL_STEP:
            return MIN_PREFILL_TOKENS
        return max(MIN_PREFILL_TOKENS, self.cost.prefill_tokens_costing(self.cost.coef[PREFILL_STEP], prefix))

    def _within_gap(self, seconds: float, decodes: int, context: int, prefix: int) -> int:
        """Prefill tokens of a prefill-only step that, with the decode step after it, fit in `seconds`."""
        alone = self.cost.predict(StepShape(decodes, context, 0))
        return self.cost.prefill_tokens_within(seconds - alone, 0, 0, prefix)

    @contextlib.contextmanager
    def uncapped(self) -> Iterator[None]:
        """Prefill beside decodes takes whole chunks inside: for the start-up profile, there to time them."""
        target, self.itl_target_s = self.itl_target_s, None
        try:
            yield
        finally:
            self.itl_target_s = target

    def gap_spent(self, shape: StepShape) -> float:
        """Seconds of the decodes' gap a prefill-only step of `shape` is predicted to take; before the
        model is fitted, all of it (the decodes step next)."""
        if self.itl_target_s is None:
            return 0.0
        return self.cost.predict(shape) if self.cost.fitted else self.itl_target_s

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
