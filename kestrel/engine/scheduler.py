"""Continuous batching: waiting/running queues, chunked prefill, retraction, abort.

Each step the scheduler picks one batch: new prefill work first, otherwise a decode step of every
running request; with `enable_mixed_chunk` the decodes ride along with the prefill chunks in one MIXED
batch. Which prompts go first and how many prefill tokens a step may carry beside running decodes is
the policy's (`policy.py`: priorities, shortest remaining prefill first, the ITL target, from the
step-cost model the step loop fits, `step_cost.py`). One prefill at a time is chunked over steps; a
shorter prompt that the policy puts first pauses it (its KV waits in the radix cache). KV slots for the batch are allocated
here, before the forward (`request_kv.py` keeps each request's KV), and admission keeps room for the
tokens the admitted requests will still need (`admission.py`).

A decode step gives each request `decode_tokens` new positions: 1 for plain decoding, more for a
speculative verify (TARGET_VERIFY), whose caller fills in the draft tokens and their tree.

After the forward is launched, `commit()` advances the requests as if their sampled tokens were known
(those are `pending` until `resolve()` gets their values from the device). With overlap scheduling the
engine schedules the next step between the two calls; requests that will reach their length limit
with the pending token are not scheduled again. `resolve()` is the one place where requests take
their tokens, from plain and speculative steps alike; whether a request ends there is decided by
`Finishing` (finishing.py).
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.radix import RadixCache
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.config import SchedulerConfig
from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.request import Request, RequestStatus
from kestrel.engine.admission import AdmissionBudget
from kestrel.engine.finishing import Finishing
from kestrel.engine.policy import SchedulePolicy
from kestrel.engine.request_kv import RequestKV
from kestrel.engine.step_cost import StepCostModel, StepShape
from kestrel.lora.pool import LoRAPool

logger = logging.getLogger(__name__)

# A retraction frees room for this many decode steps of the requests left, so that the next steps do
# not retract one request each.
RETRACT_HEADROOM_STEPS = 20


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: TokenToKVPoolAllocator, radix: RadixCache,
                 req_to_token: ReqToTokenPool, eos_token_ids: set[int], context_length: int,
                 pair_keys: bool = False, clock: Callable[[], float] = time.monotonic,
                 lora: LoRAPool | None = None) -> None:
        """`lora`: the adapter pool (--enable-lora); a batch mixes at most its slots' adapters."""
        self.config = config
        self.clock = clock
        self.allocator = allocator
        self.kv = RequestKV(allocator, radix, req_to_token, pair_keys, lora)
        self.budget = AdmissionBudget(config, allocator.page_size)
        self.finisher = Finishing(eos_token_ids, context_length)
        self.waiting: list[Request] = []  # kept sorted by arrival, so retracted requests go back in place
        self.running: list[Request] = []  # decoding, in admission order
        self.chunked: Request | None = None  # prefill in progress across steps
        self.finishing: set[Request] = set()  # past their last decode, waiting for their last token
        # Requests of a failed step, put back to run their prefill alone (`suspect`), until it resolves.
        self.suspects: set[Request] = set()
        self.num_retractions = 0
        self.cost = StepCostModel()  # fitted by whoever times the steps (the step loop)
        self.policy = SchedulePolicy(config, self.cost, clock)
        # Predicted seconds of the prefill-only steps run since the running requests' last decode step.
        self._gap_spent = 0.0

    # ---- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.queued_at is None:
            req.queued_at = self.clock()
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def live(self) -> list[Request]:
        """Every request that holds KV or waits for it."""
        return self.running + ([self.chunked] if self.chunked else []) + list(self.finishing) + self.waiting

    def abort(self, rid: str) -> Request | None:
        """Finish the request with reason "abort" and free its KV; None if no such live request."""
        for req in self.live():
            if req.rid == rid:
                self.finish(req, "abort")
                return req
        return None

    def finish(self, req: Request, reason: str, matched_stop: int | str | None = None,
               error: str | None = None) -> None:
        """End a live request and release its KV. A failed step's KV is not trusted, so it is not offered
        to the radix cache. Stops and length limits come here through `Finishing`'s decision only."""
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        self.finishing.discard(req)
        self.suspects.discard(req)
        self.kv.release(req, cache=error is None)
        req.status = RequestStatus.FINISHED
        req.pending.clear()  # tokens still on the device for it are dropped when they resolve
        req.finish_reason, req.matched_stop, req.error = reason, matched_stop, error

    def fail(self, req: Request, error: Exception) -> None:
        """finish_reason "error", also over a finish not reported yet (the failure comes after it)."""
        message = f"{type(error).__name__}: {error}"
        if req.finished:
            req.finish_reason, req.matched_stop, req.error = "error", None, message
        else:
            self.finish(req, "error", error=message)

    def finish_if_done(self, req: Request) -> bool:
        """End a request that needs no (more) forward before its first token (`Finishing.decide`);
        returns whether it has ended."""
        finish = self.finisher.decide(req)
        if finish is not None:
            self.finish(req, finish.reason, finish.matched_stop, finish.error)
        return req.finished

    def suspect(self, req: Request) -> None:
        """Put back a request of a step that failed with others: like a retraction it keeps its resolved
        tokens (the pending ones are dropped: its prefill samples them again, from the same seeds), but
        its KV is not trusted, so it is freed. Its prefill then runs alone (`schedule`), so that a
        failure there is its own."""
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        self.finishing.discard(req)
        self.kv.release(req, cache=False)
        req.pending.clear()
        req.status = RequestStatus.WAITING
        self.suspects.add(req)
        self.add(req)

    # ---- batch selection --------------------------------------------------------------------
    def schedule(self, decode_tokens: int = 1) -> ScheduledBatch | None:
        suspect = self._schedule_suspect()
        if suspect is not None:
            return self._batch(ForwardMode.EXTEND, [suspect], 1)
        mixed = self.config.enable_mixed_chunk and decode_tokens == 1
        budget = self.policy.prefill_budget(self.running, mixed, self._gap_spent, self.chunked)
        prefill = self._schedule_prefill(budget=budget)
        if prefill and not (mixed and self.running):
            batch = self._batch(ForwardMode.EXTEND, prefill, len(prefill))
            if self.running:  # the decodes wait for this step: it eats into their gap
                self._gap_spent += self.policy.gap_spent(StepShape.of(batch))
            return batch
        self._gap_spent = 0.0
        decode = self._schedule_decode(protected=prefill, tokens=decode_tokens)
        if prefill:
            return self._batch(ForwardMode.MIXED if decode else ForwardMode.EXTEND, prefill + decode, len(prefill))
        if not decode:
            return None
        return self._batch(ForwardMode.DECODE if decode_tokens == 1 else ForwardMode.TARGET_VERIFY, decode, 0)

    def _batch(self, mode: ForwardMode, reqs: list[Request], num_prefill: int) -> ScheduledBatch:
        """The batch as plain data: each request's new tokens at positions [kv_len, kv_len + extend_len).
        For a verify, the tokens after the first are placeholders for the caller's draft tokens."""
        input_ids, positions, prefix, extend = [], [], [], []
        for req in reqs:
            start, n = req.kv_len, req.extend_len
            known = req.tokens(start, min(start + n, req.seq_len))
            input_ids += known + [0] * (n - len(known))
            positions += range(start, start + n)
            prefix.append(start)
            extend.append(n)
        writes, moves, new_slots = self.kv.drain()
        assert new_slots.numel() == len(input_ids), "allocations must follow the batch order"
        return ScheduledBatch(mode, [r.req_pool_idx for r in reqs], prefix, extend, input_ids, positions,
                              out_cache_loc=new_slots, table_writes=writes, kv_moves=moves,
                              num_prefill=num_prefill, reqs=reqs, lora_slots=[r.lora_slot for r in reqs])

    def _schedule_suspect(self) -> Request | None:
        """A suspect's next prefill chunk, as a batch of its own (the others wait a step), if it fits."""
        if not self.suspects or (self.chunked is not None and self.chunked not in self.suspects):
            return None  # one chunked prefill at a time: the other one finishes first
        if self.chunked in self.suspects:
            req = self.chunked
        else:
            req = next((r for r in self.waiting if r in self.suspects), None)
        picked = self._schedule_prefill([req]) if req is not None else []
        return picked[0] if picked else None

    def _schedule_prefill(self, candidates: list[Request] | None = None, budget: int | None = None) -> list[Request]:
        """Prefill chunks for this step, in the policy's order, within `budget` tokens (None: the
        chunked-prefill size alone)."""
        size = self.config.chunked_prefill_size
        budget = min(float("inf") if size == -1 else size, float("inf") if budget is None else budget)
        picked: list[Request] = []
        if candidates is None:  # suspects run alone (`_schedule_suspect`)
            candidates = self._prefill_order()
        if not candidates or budget <= 0:
            return picked
        running = self.budget.reserve_terms(self.running)
        rows = self.kv.req_to_token
        for req in candidates:
            is_new = req is not self.chunked
            if is_new and (len(self.running) + len(picked) + (self.chunked is not None)
                           >= self.config.max_running_requests or rows.available() == 0):
                # No new request fits, but the prompt in progress (ordered later when a shorter one
                # arrived) must still get its chunk: with no slot for the newcomer, skipping to it is
                # the only way forward (at max_running_requests 1 a `break` here stalled both forever).
                continue
            if is_new and not self.kv.lora_fits(req):
                # Every pool slot holds another running adapter: it waits for one to free up. Once it has
                # aged, nothing new is admitted behind it, so the running adapters drain and free a slot.
                if self.policy.aged(req):
                    break
                continue
            if is_new:
                assert not req.pending, "a waiting request's sampled tokens are resolved before it is admitted"
                cached_slots = self.kv.match(req)
            remaining = req.seq_len - req.kv_len
            take = int(min(remaining, budget))
            # The first request is admitted whenever its prompt fits, so that something always runs.
            first = not self.running and not picked
            need = self.allocator.tokens_needed(req.kv_len, take) if first else \
                self.budget.tokens_to_come(running, picked + [req])
            if take > 0 and need > self.kv.free_tokens() and is_new and self._preempt_for(req, need):
                running = self.budget.reserve_terms(self.running)
                first = not self.running and not picked
                need = self.allocator.tokens_needed(req.kv_len, take) if first else \
                    self.budget.tokens_to_come(running, picked + [req])
            if take <= 0 or need > self.kv.free_tokens():
                if is_new:
                    self.kv.unmatch(req)
                break
            if is_new:
                self.waiting.remove(req)
                self.kv.admit(req, cached_slots)
                req.prefilled_len = 0
                if req.scheduled_at is None:
                    req.scheduled_at = self.clock()
            self.kv.allocate([req], [take])
            picked.append(req)
            budget -= take
            if take < remaining:
                if self.chunked is not None and self.chunked is not req:
                    self._pause(self.chunked)  # the policy put this one first: one chunked prefill at a time
                self.chunked = req
                break
            if req is self.chunked:
                self.chunked = None
        return picked

    def _prefill_order(self) -> list[Request]:
        """Waiting requests and the chunked one, by the policy. Without a radix cache a paused prefill
        would lose its KV, so the chunked one then keeps its place at the head."""
        waiting = [r for r in self.waiting if r not in self.suspects]
        chunked = [self.chunked] if self.chunked is not None and self.chunked not in self.suspects else []
        if self.kv.radix.disabled:
            return chunked + self.policy.order(waiting)
        return self.policy.order(chunked + waiting)

    def _preempt_for(self, req: Request, need: int) -> bool:
        """Retract running requests of a lower priority than `req`, lowest first, until its `need` fits;
        nothing is retracted unless all of them together would free enough. Returns whether any was."""
        victims = self.policy.preemptible(req, self.running)
        if not victims or need > self.kv.free_tokens() + sum(len(v.slots) - v.cached_len for v in victims):
            return False
        for victim in victims:
            self._retract(victim)
            if need <= self.kv.free_tokens():
                break
        return True

    def _schedule_decode(self, protected: list[Request], tokens: int) -> list[Request]:
        """Every running request gets `tokens` slots; requests are retracted when the pool cannot hold them."""
        if self._decode_tokens(1, tokens) > self.kv.free_tokens():
            self._retract_for_room(protected, tokens)
        if self.running:
            self.budget.decay()
            self.kv.allocate(self.running, [tokens] * len(self.running))
        return list(self.running)

    def _decode_tokens(self, steps: int, tokens: int = 1) -> int:
        return sum(self.allocator.tokens_needed(r.kv_len, steps * tokens) for r in self.running)

    def _retract_for_room(self, protected: list[Request], tokens: int) -> None:
        """Retract until the running requests have room for RETRACT_HEADROOM_STEPS decode steps (a last
        one stays if it has room for one), then re-estimate the new-token ratio from those left.

        The chunked prefill goes first, unless it got slots in this step (`protected`); then the running
        requests in the policy's retraction order (lowest priority, fewest generated tokens, longest
        prompt)."""
        if self.chunked is not None and all(self.chunked is not p for p in protected):
            self._retract(self.chunked)
        victims = sorted(self.running, key=self.policy.retraction_key, reverse=True)
        for steps, keep in ((RETRACT_HEADROOM_STEPS, 1), (1, 0)):
            need = self._decode_tokens(steps, tokens)
            while len(self.running) > keep and need > self.kv.free_tokens():
                victim = victims.pop()
                need -= self.allocator.tokens_needed(victim.kv_len, steps * tokens)
                self._retract(victim)
        if self.running:
            self.budget.re_estimate(self.running, RETRACT_HEADROOM_STEPS)

    def _retract(self, req: Request) -> None:
        """Put a request back in the waiting queue; its KV goes to the radix cache (evictable)."""
        self._requeue(req)
        self.num_retractions += 1

    def _pause(self, req: Request) -> None:
        """Stop the chunked prefill for a prompt the policy puts first; its chunks wait in the radix cache."""
        req.prefilled_len = req.kv_len
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self.kv.release(req)
        req.status = RequestStatus.WAITING
        self.add(req)

    # ---- after the forward ------------------------------------------------------------------
    def sampling_rows(self, batch: ScheduledBatch) -> list[int]:
        """Rows of the batch whose fill is complete after this forward: they get a token."""
        return [i for i, r in enumerate(batch.reqs) if r.kv_len + r.extend_len >= r.seq_len and r.params.max_new_tokens]

    def commit(self, batch: ScheduledBatch, sampled: list[Request], futures: list[list[int]]) -> list[Request]:
        """Advance the batch's requests once its forward is launched: every new position now has KV.
        `sampled` got the pending tokens `futures` (FutureTokens indices). Requests that the pending
        tokens take to max_new_tokens or the context length leave the running queue now: they finish
        when the tokens resolve.

        Returns the requests whose prefill ended with nothing to sample (max_new_tokens=0, run for their
        prompt logprobs): they wait in `finishing` until the engine resolves this step."""
        for req in batch.reqs:
            req.kv_len += req.extend_len
            req.extend_len = 0
            if req is self.chunked:
                self.kv.commit_chunk(req)
        prefilled = set(map(id, batch.reqs[:batch.num_prefill]))
        finishing = len(self.finishing)
        for req, pending in zip(sampled, futures):
            req.pending += pending
            if self.finisher.at_length_limit(req, req.num_generated, req.seq_len):
                self.finishing.add(req)
            elif id(req) in prefilled:
                self.running.append(req)
        if len(self.finishing) > finishing:
            self.running = [r for r in self.running if r not in self.finishing]
        prefill_only = [r for r in batch.reqs[:batch.num_prefill]
                        if not r.params.max_new_tokens and r.kv_len >= r.seq_len]
        self.finishing.update(prefill_only)
        return prefill_only

    def keep_new_slots(self, req: Request, num_new: int, nodes: list[int]) -> None:
        """After a committed step of `num_new` new positions (a verify): keep the KV of new tokens
        `nodes` (the accepted path, root first) and give the rest back (KV rollback)."""
        self.kv.keep_new(req, req.kv_len - num_new, nodes)

    def resolve(self, sampled: list[Request], token_lists: list[list[int]],
                futures: list[list[int]] | None = None, logprobs: list[list[float] | None] | None = None,
                top_logprobs: list[list | None] | None = None) -> list[Request]:
        """Give the sampled requests their tokens, in order, with their logprobs (where asked for); `futures`
        names the pending ones they resolve. After each token `Finishing` decides whether the request
        ends there; the tokens after its end are dropped. A request whose own host work on its tokens
        (its grammar, its stop strings) raises finishes with an error; the others go on.

        Returns the requests that got tokens (those finished meanwhile, by abort, drop them)."""
        got = []
        for i, (req, tokens) in enumerate(zip(sampled, token_lists)):
            if req.finished:
                continue
            if futures is not None:
                assert req.pending[:len(tokens)] == futures[i], "pending tokens resolve in order"
                del req.pending[:len(tokens)]
            try:
                for j, token in enumerate(tokens):
                    req.output_ids.append(token)
                    if logprobs is not None and logprobs[i] is not None:
                        req.output_logprobs.append(logprobs[i][j])
                        req.output_top_logprobs.append(top_logprobs[i][j])
                    finish = self.finisher.decide(req, token)
                    if finish is not None:
                        self.finish(req, finish.reason, finish.matched_stop, finish.error)
                        break
            except Exception as e:  # noqa: BLE001 - this request's own host work: it alone fails
                logger.exception("request %s failed while taking its new tokens; it finishes with an error", req.rid)
                self.fail(req, e)
            got.append(req)
            self.suspects.discard(req)  # its prefill ran alone and resolved: it rejoins the batches
        return got
