"""Continuous batching: waiting/running queues, chunked prefill, retraction, abort.

Each step the scheduler picks one batch: new prefill work first (FCFS, within the chunked-prefill
token budget), otherwise a decode step of every running request; with `enable_mixed_chunk` the
decodes ride along with the prefill chunks in one MIXED batch. KV slots for the batch are allocated
here, before the forward, and written into the request's `req_to_token` row (and its host copy,
`req.slots`, so that freeing KV never reads the device).

Admission keeps room for the tokens the admitted requests will still need, so that prefills do not
fill the pool only to be retracted later. A request that ignores EOS and has no stop condition runs
to max_new_tokens: its need is known, and so is the moment it frees its KV, so the room kept is the
exact peak of those requests' occupancy. Other requests may stop any time: each counts a fraction of
its remaining max_new_tokens (SGLang's "new token ratio"), which starts high, decays with every
decode step and is re-estimated from the running requests at each retraction.

After the forward is launched, `commit()` advances the requests as if their sampled tokens were known
(those are `pending` until `resolve()` gets their values from the device). With overlap scheduling the
engine schedules the next step between the two calls; requests that will reach their length limit
with the pending token are not scheduled again.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.radix import RadixCache
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.config import SchedulerConfig
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.request import Request, RequestStatus


# New-token-ratio estimate: start at INIT x conservativeness, fall linearly to MIN over DECAY_STEPS
# decode steps; a request's remaining budget counts at most CLIP_NEW_TOKENS.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600
CLIP_NEW_TOKENS = 4096
# A retraction frees room for this many decode steps of the requests left, so that the next steps do
# not retract one request each.
RETRACT_HEADROOM_STEPS = 20


@dataclass
class ScheduledBatch:
    """Requests of one forward, each with `kv_len` tokens already cached and `extend_len` new ones."""

    mode: ForwardMode
    reqs: list[Request]
    num_prefill: int  # reqs[:num_prefill] are prefill work, the rest decodes
    out_cache_loc: torch.Tensor  # [sum of extend_len] KV slots of the new tokens, request by request (device)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: TokenToKVPoolAllocator, radix: RadixCache,
                 req_to_token: ReqToTokenPool, eos_token_ids: set[int], context_length: int) -> None:
        self.config = config
        self.allocator = allocator
        self.radix = radix
        self.req_to_token = req_to_token
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.waiting: list[Request] = []  # kept sorted by arrival, so retracted requests go back in place
        self.running: list[Request] = []  # decoding, in admission order
        self.chunked: Request | None = None  # prefill in progress across steps
        self.finishing: set[Request] = set()  # past their last decode, waiting for their last token
        self.num_retractions = 0
        self.init_ratio = INIT_NEW_TOKEN_RATIO * config.schedule_conservativeness
        self.min_ratio = min(MIN_NEW_TOKEN_RATIO * config.schedule_conservativeness, self.init_ratio)
        self.new_token_ratio = self.init_ratio
        # This step's allocations, in batch order: the requests, their new-token counts, host slot tensors.
        self._pending_reqs: list[Request] = []
        self._pending_counts: list[int] = []
        self._pending_slots: list[torch.Tensor] = []

    # ---- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def abort(self, rid: str) -> Request | None:
        """Finish the request with reason "abort" and free its KV; None if no such live request."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._mark_finished(req, "abort")
                return req
        for req in self.running + ([self.chunked] if self.chunked else []) + list(self.finishing):
            if req.rid == rid:
                self.finish(req, "abort")
                return req
        return None

    def finish(self, req: Request, reason: str, matched_stop: int | str | None = None) -> None:
        """End a live request (also used by the engine for stop strings) and release its KV."""
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        self.finishing.discard(req)
        self._release(req)
        self._mark_finished(req, reason, matched_stop)

    # ---- batch selection --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        self._pending_reqs, self._pending_counts, self._pending_slots = [], [], []
        prefill = self._schedule_prefill()
        if prefill and not (self.config.enable_mixed_chunk and self.running):
            return self._batch(ForwardMode.EXTEND, prefill, len(prefill))
        decode = self._schedule_decode(protected=prefill)
        if prefill:
            return self._batch(ForwardMode.MIXED if decode else ForwardMode.EXTEND, prefill + decode, len(prefill))
        return self._batch(ForwardMode.DECODE, decode, 0) if decode else None

    def _batch(self, mode: ForwardMode, reqs: list[Request], num_prefill: int) -> ScheduledBatch:
        """Send the step's new slots to the device and into the requests' req_to_token rows, in one copy."""
        assert self._pending_reqs == reqs, "allocations must follow the batch order"
        rows, cols = [], []
        for req, n in zip(reqs, self._pending_counts):
            rows += [req.req_pool_idx] * n
            cols += range(req.kv_len, req.kv_len + n)
        slots = torch.cat(self._pending_slots)
        host = torch.stack([slots, torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)])
        on_device = host.to(self.req_to_token.table.device, non_blocking=True)
        self.req_to_token.table[on_device[1], on_device[2]] = on_device[0]
        return ScheduledBatch(mode, reqs, num_prefill, on_device[0])

    def _free_tokens(self) -> int:
        return self.allocator.available_size() + self.radix.evictable_size()

    def _schedule_prefill(self) -> list[Request]:
        budget = self.config.chunked_prefill_size
        budget = float("inf") if budget == -1 else budget
        picked: list[Request] = []
        candidates = ([self.chunked] if self.chunked else []) + list(self.waiting)
        if not candidates:
            return picked
        running = self._reserve_terms(self.running)  # the same for every candidate
        for req in candidates:
            is_new = req is not self.chunked
            if is_new and (len(self.running) + len(picked) + (self.chunked is not None)
                           >= self.config.max_running_requests or self.req_to_token.available() == 0):
                break
            if is_new:
                assert not req.pending, "a waiting request's sampled tokens are resolved before it is admitted"
                # Match at most len - 1 tokens: the last one must run to give the next token's logits.
                slots, node = self.radix.match_prefix(req.fill_ids[:-1])
                self.radix.inc_lock_ref(node)
                req.last_node, req.cached_len, req.kv_len = node, len(slots), len(slots)
            remaining = req.seq_len - req.kv_len
            take = int(min(remaining, budget))
            # The first request is admitted whenever its prompt fits, so that something always runs.
            first = not self.running and not picked
            need = self.allocator.tokens_needed(req.kv_len, take) if first else \
                self._tokens_to_come(running, picked + [req])
            if take <= 0 or need > self._free_tokens():
                if is_new:
                    self.radix.dec_lock_ref(req.last_node)
                    req.last_node, req.cached_len, req.kv_len = None, 0, 0
                break
            if is_new:
                self.waiting.remove(req)
                req.req_pool_idx = self.req_to_token.alloc()
                req.slots = slots.tolist()
                if req.cached_len:
                    self.req_to_token.write(req.req_pool_idx, 0, slots)
                if not req.admitted:
                    req.cached_tokens = req.cached_len
                    req.admitted = True
                req.status = RequestStatus.RUNNING
            self._allocate(req, take)
            picked.append(req)
            budget -= take
            if take < remaining:
                self.chunked = req
                break
            if req is self.chunked:
                self.chunked = None
        return picked

    def _reserve_terms(self, reqs: list[Request]) -> tuple[int, list[tuple[int, int]]]:
        """The parts of `_tokens_to_come` for reqs: the tokens that simply add up (the unplaced rest of
        each sequence, rounded to pages, and the ratio estimate of requests that may stop early), and
        (tokens left, seq_len) of each request that runs to max_new_tokens."""
        page = self.allocator.page_size
        flat, known = 0, []
        for r in reqs:
            seq_len, params = r.seq_len, r.params
            flat += seq_len - r.kv_len - r.extend_len + page - 1
            if params.ignore_eos and not params.stop_token_ids and not params.stop_strs:
                known.append((max(0, params.max_new_tokens - r.num_generated), seq_len))
            else:
                flat += self._expected_new_tokens(r)
        return flat, known

    def _tokens_to_come(self, running: tuple[int, list[tuple[int, int]]], reqs: list[Request]) -> int:
        """KV tokens that the running requests (given as their `_reserve_terms`) and reqs will need
        beyond the slots they hold now, at the fullest moment ahead: the rest of each sequence (this
        step's decode token, prompt chunks still to prefill) rounded to pages, plus the tokens they will
        generate, which schedule_conservativeness scales."""
        flat, known = self._reserve_terms(reqs)
        known = sorted(running[1] + known, reverse=True)
        # s steps ahead, the requests that run to max_new_tokens and are not done hold sum(seq_len + s);
        # that peaks just before one of them finishes and frees its KV. Visit those moments, latest first.
        held = peak = 0
        for count, (left, seq_len) in enumerate(known, 1):
            held += seq_len
            peak = max(peak, held + count * left)
        return running[0] + flat + int((peak - held) * self.config.schedule_conservativeness)

    def _expected_new_tokens(self, req: Request) -> int:
        left = min(req.params.max_new_tokens - req.num_generated, CLIP_NEW_TOKENS)
        return int(max(0, left) * self.new_token_ratio)

    def _schedule_decode(self, protected: list[Request]) -> list[Request]:
        """Every running request gets one slot; requests are retracted when the pool cannot hold them."""
        need = self._decode_tokens(1)
        if need > self._free_tokens():
            self._retract_for_room(protected)
            need = self._decode_tokens(1)
        if self.running:
            step = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
            self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - step)
            self._make_room(need)
            ones = [1] * len(self.running)
            slots = self.allocator.alloc_many([r.kv_len for r in self.running], ones,
                                              [r.last_slot for r in self.running])
            self._record(self.running, ones, slots)
        return list(self.running)

    def _decode_tokens(self, steps: int) -> int:
        return sum(self.allocator.tokens_needed(r.kv_len, steps) for r in self.running)

    def _retract_for_room(self, protected: list[Request]) -> None:
        """Retract until the running requests have room for RETRACT_HEADROOM_STEPS decode steps (a last
        one stays if it has room for one), then re-estimate new_token_ratio from those left.

        The chunked prefill goes first, unless it got slots in this step (`protected`); then the requests
        with the fewest generated tokens, which lose the least decoding, and of those the longest
        prompts, which free the most."""
        if self.chunked is not None and all(self.chunked is not p for p in protected):
            self._retract(self.chunked)
        victims = sorted(self.running, key=lambda r: (r.num_generated, -len(r.prompt_ids)), reverse=True)
        for steps, keep in ((RETRACT_HEADROOM_STEPS, 1), (1, 0)):
            need = self._decode_tokens(steps)
            while len(self.running) > keep and need > self._free_tokens():
                victim = victims.pop()
                need -= self.allocator.tokens_needed(victim.kv_len, steps)
                self._retract(victim)
        if self.running:
            # The estimate let the pool overflow. The requests left have used this share of their
            # budgets so far (with the headroom): a lower bound of what they will use in the end, and
            # the estimate to decay from. (Resetting to the start value instead made the ratio cycle.)
            generated = sum(r.num_generated for r in self.running) + RETRACT_HEADROOM_STEPS * len(self.running)
            share = generated / max(1, sum(r.params.max_new_tokens for r in self.running))
            self.new_token_ratio = min(1.0, share) * self.config.schedule_conservativeness

    def _allocate(self, req: Request, n: int) -> None:
        """Give req KV slots for fill positions [kv_len, kv_len + n), evicting cached prefixes if needed."""
        self._make_room(self.allocator.tokens_needed(req.kv_len, n))
        self._record([req], [n], self.allocator.alloc_for(req.kv_len, n, req.last_slot))

    def _make_room(self, tokens: int) -> None:
        if tokens > self.allocator.available_size():
            self.radix.evict(tokens - self.allocator.available_size())

    def _record(self, reqs: list[Request], counts: list[int], slots: torch.Tensor) -> None:
        """Note host `slots` (the requests' new tokens, concatenated) for this step's batch."""
        values = slots.tolist()  # a host tensor: no device sync
        end = 0
        for req, n in zip(reqs, counts):
            req.slots += values[end:end + n]
            req.extend_len = n
            end += n
        self._pending_reqs += reqs
        self._pending_counts += counts
        self._pending_slots.append(slots)

    def _retract(self, req: Request) -> None:
        """Put a request back in the waiting queue; its KV goes to the radix cache (evictable)."""
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        self.num_retractions += 1
        self.add(req)

    def _release(self, req: Request) -> None:
        if req.req_pool_idx is None:
            return
        assert len(req.slots) == req.kv_len, "KV is released between steps, after commit()"
        slots = torch.tensor(req.slots, dtype=torch.int64)
        self.radix.cache_finished(req.fill_ids[:req.kv_len], slots, req.cached_len, req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.kv_len, req.cached_len, req.extend_len = None, None, 0, 0, 0
        req.slots = []

    def _mark_finished(self, req: Request, reason: str, matched_stop: int | str | None = None) -> None:
        req.status = RequestStatus.FINISHED
        req.pending.clear()  # tokens still on the device for it are dropped when they resolve
        req.finish_reason = reason
        req.matched_stop = matched_stop

    # ---- after the forward ------------------------------------------------------------------
    def sampling_rows(self, batch: ScheduledBatch) -> list[int]:
        """Rows of the batch whose fill is complete after this forward: they get a token."""
        return [i for i, r in enumerate(batch.reqs) if r.kv_len + r.extend_len == r.seq_len]

    def commit(self, batch: ScheduledBatch, sampled: list[Request], futures: list[int]) -> None:
        """Advance the batch's requests once its forward is launched; `sampled` got the pending tokens
        `futures` (FutureTokens indices). Requests that the pending token takes to max_new_tokens or
        the context length leave the running queue now: they finish when the token resolves."""
        for req in batch.reqs:
            req.kv_len += req.extend_len
            req.extend_len = 0
            if req is self.chunked:
                # Chunked-so-far tokens go to the tree so the request (and others) can share them.
                slots = torch.tensor(req.slots, dtype=torch.int64)
                tree_slots, node, cached = self.radix.cache_unfinished(
                    req.fill_ids[:req.kv_len], slots, req.cached_len, req.last_node)
                req.slots[:cached] = tree_slots.tolist()
                self.req_to_token.write(req.req_pool_idx, 0, tree_slots)
                req.last_node, req.cached_len = node, cached
        prefilled = set(map(id, batch.reqs[:batch.num_prefill]))
        finishing = len(self.finishing)
        for req, future in zip(sampled, futures):
            req.pending.append(future)
            if self._at_length_limit(req, req.num_generated, req.seq_len):
                self.finishing.add(req)
            elif id(req) in prefilled:
                self.running.append(req)
        if len(self.finishing) > finishing:
            self.running = [r for r in self.running if r not in self.finishing]

    def resolve(self, sampled: list[Request], futures: list[int], token_ids: list[int]) -> list[Request]:
        """Give pending tokens their sampled values; finish requests that hit a stop condition.

        Returns the requests that got their token (those finished meanwhile, by abort or a stop
        string, drop it)."""
        got = []
        for req, future, token in zip(sampled, futures, token_ids):
            if req.finished:
                continue
            assert req.pending and req.pending[0] == future, "pending tokens resolve in order"
            req.pending.pop(0)
            req.output_ids.append(token)
            got.append(req)
            params = req.params
            if params.stop_token_ids and token in params.stop_token_ids:
                self.finish(req, "stop", token)
            elif not params.ignore_eos and token in self.eos_token_ids:
                self.finish(req, "stop", token)
            # Resolved tokens only: a token launched after this one may still be pending.
            elif self._at_length_limit(req, len(req.output_ids), len(req.prompt_ids) + len(req.output_ids)):
                self.finish(req, "length")
        return got

    def _at_length_limit(self, req: Request, generated: int, seq_len: int) -> bool:
        return generated >= req.params.max_new_tokens or seq_len >= self.context_length
