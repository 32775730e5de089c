"""Scheduler admission and retraction on the host, without a model: tokens are made up."""
from __future__ import annotations

import itertools

from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.radix import RadixCache
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.config import SchedulerConfig
from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.scheduler import RETRACT_HEADROOM_STEPS, Scheduler

STOP = 1  # a stop token that is never sampled: the scheduler cannot know when requests end


def test_retraction_makes_room_for_many_steps_and_re_estimates_the_ratio():
    allocator = TokenToKVPoolAllocator(800, 1, "cpu")
    scheduler = Scheduler(SchedulerConfig(max_running_requests=32, chunked_prefill_size=64), allocator,
                          RadixCache(allocator, 1), ReqToTokenPool(32, 256, "cpu"), set(), 256)
    params = SamplingParams(max_new_tokens=100, stop_token_ids=[STOP])
    for i in range(24):
        scheduler.add(Request(str(i), [10 + i] * (4 + i % 4), params, seed=0, arrival=i))
    futures = itertools.count()
    while scheduler.num_retractions == 0:
        assert scheduler.has_work(), "the pool never overflowed: make it smaller"
        free = scheduler.kv.free_tokens()
        before = list(scheduler.running)
        batch = scheduler.schedule()
        sampled = [batch.reqs[i] for i in scheduler.sampling_rows(batch)]
        ids = [[next(futures)] for _ in sampled]
        scheduler.commit(batch, sampled, ids)
        scheduler.resolve(sampled, [[3]] * len(ids), ids)
    left = scheduler.running
    retracted = [r for r in before if r not in left]
    assert retracted and len(left) > 1
    # The pool could not hold one more decode step; now the requests left have room for the headroom
    # (less the step just taken), not just for the next step.
    assert free < len(before)
    assert scheduler.kv.free_tokens() >= (RETRACT_HEADROOM_STEPS - 1) * len(left)
    # The ones that had generated least went back to the queue.
    assert max(r.num_generated for r in retracted) <= min(r.num_generated for r in left)
    # The ratio starts from what the requests left have really used, not from the start value.
    used = sum(r.num_generated for r in left) / sum(r.params.max_new_tokens for r in left)
    assert used <= scheduler.budget.new_token_ratio <= used + RETRACT_HEADROOM_STEPS / params.max_new_tokens


def test_a_mixed_step_carries_at_most_the_mixed_budget_while_a_lone_prefill_takes_the_full_chunk():
    allocator = TokenToKVPoolAllocator(4000, 1, "cpu")
    config = SchedulerConfig(max_running_requests=8, chunked_prefill_size=64, enable_mixed_chunk=True,
                             mixed_chunk_prefill_size=16)
    scheduler = Scheduler(config, allocator, RadixCache(allocator, 1), ReqToTokenPool(8, 256, "cpu"), set(), 256)
    params = SamplingParams(max_new_tokens=50, stop_token_ids=[STOP])
    scheduler.add(Request("a", [5] * 40, params, seed=0, arrival=0))
    scheduler.add(Request("b", [6] * 60, params, seed=0, arrival=1))
    futures = itertools.count()
    extends = []
    while scheduler.has_work() and len(extends) < 6:
        batch = scheduler.schedule()
        extends.append((batch.mode.name, sum(batch.extend_lens[:batch.num_prefill])))
        sampled = [batch.reqs[i] for i in scheduler.sampling_rows(batch)]
        ids = [[next(futures)] for _ in sampled]
        scheduler.commit(batch, sampled, ids)
        scheduler.resolve(sampled, [[3]] * len(ids), ids)
    # Nothing decodes at first: the whole 64-token chunk (all of a, 24 of b); then b's rest 16 at a time
    # beside a's decode.
    assert extends[:5] == [("EXTEND", 64), ("MIXED", 16), ("MIXED", 16), ("MIXED", 4), ("DECODE", 0)]
