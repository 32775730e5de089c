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
