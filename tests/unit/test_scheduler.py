"""Scheduler admission and retraction on the host, without a model: tokens are made up."""
from __future__ import annotations

from kestrel.core.forward_mode import ForwardMode
from kestrel.engine.scheduler import RETRACT_HEADROOM_STEPS
from tests.conftest import SchedulerDriver

STOP = 1  # a stop token that is never sampled: the scheduler cannot know when requests end


def test_retraction_makes_room_for_many_steps_and_re_estimates_the_ratio():
    driver = SchedulerDriver(800, chunked_prefill_size=64)
    scheduler = driver.scheduler
    for i in range(24):
        driver.add(str(i), [10 + i] * (4 + i % 4), 100, arrival=i, stop_token_ids=[STOP])
    while scheduler.num_retractions == 0:
        assert scheduler.has_work(), "the pool never overflowed: make it smaller"
        free = scheduler.kv.free_tokens()
        before = list(scheduler.running)
        driver.step()
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
    params = left[0].params
    used = sum(r.num_generated for r in left) / sum(r.params.max_new_tokens for r in left)
    assert used <= scheduler.budget.new_token_ratio <= used + RETRACT_HEADROOM_STEPS / params.max_new_tokens


def test_retraction_takes_the_fewest_generated_then_the_longest_prompt_and_keeps_their_tokens():
    """a runs alone, then b and c (tied: b has the longer prompt), then d: the pool runs out with d, b
    retracted (c and a left with room for the headroom). Their KV goes to the radix tree and their tokens
    stay; b resumes from its cached KV with one token to run, d (its KV evicted since) from scratch, and
    every request still ends with exactly max_new_tokens tokens."""
    # Conservativeness 0: admission keeps no room for future tokens, so the pool runs out on a known step.
    driver = SchedulerDriver(90, schedule_conservativeness=0)
    scheduler = driver.scheduler
    a = driver.add("a", [5] * 8, 60, arrival=0)
    for _ in range(6):
        driver.step()
    b, c = driver.add("b", [6] * 12, 60, arrival=1), driver.add("c", [7] * 6, 60, arrival=2)
    for _ in range(3):
        driver.step()
    d = driver.add("d", [8] * 4, 60, arrival=3)
    while scheduler.num_retractions == 0:
        generated = {r.rid: r.num_generated for r in scheduler.running}
        fills = {r.rid: r.fill_ids for r in scheduler.running}
        driver.step()
        driver.check_kv()
    assert generated["b"] == generated["c"] > generated["d"] and generated["a"] > generated["b"]
    assert scheduler.running == [a, c] and scheduler.waiting == [b, d] and scheduler.num_retractions == 2
    for req in (b, d):
        assert req.fill_ids == fills[req.rid] and req.req_pool_idx is None and req.kv_len == 0
    # b's KV (every position but its last token's) is in the tree, unlocked; d's was evicted to make room.
    radix = scheduler.kv.radix
    assert len(radix.match_prefix(b.fill_ids)[0]) == len(b.fill_ids) - 1
    assert len(radix.match_prefix(d.fill_ids)[0]) == 0
    assert radix.protected_size() == 0

    batch = driver.step()
    assert batch.mode is ForwardMode.EXTEND and batch.reqs == [b]
    assert batch.prefix_lens == [len(fills["b"]) - 1] and batch.input_ids == fills["b"][-1:]
    while d.req_pool_idx is None:
        batch = driver.step()
    row = batch.reqs.index(d)
    assert batch.prefix_lens[row] == 0 and batch.extend_lens[row] == len(fills["d"])
    while scheduler.has_work():
        driver.step()
        driver.check_kv()
    for req in (a, b, c, d):
        assert len(req.output_ids) == 60 and req.finish_reason == "length"
    assert scheduler.kv.free_tokens() == 90


def test_a_stalled_chunked_prefill_is_retracted_before_any_decode_and_its_chunks_go_to_the_tree():
    """Mixed chunks: c's prompt runs beside the decodes of a and b until its next chunk no longer fits;
    the decodes go on, and when they run out of room c goes back first (a and b have generated more,
    but c got no slots in that step). Its committed chunks go to the radix tree, where the decode that
    needed the room evicts the last one (a leaf)."""
    driver = SchedulerDriver(102, chunked_prefill_size=16, enable_mixed_chunk=True, schedule_conservativeness=0)
    scheduler = driver.scheduler
    a, b = driver.add("a", [5] * 6, 90, arrival=0), driver.add("b", [6] * 6, 90, arrival=1)
    driver.step()
    driver.step()
    c = driver.add("c", list(range(10, 90)), 10, arrival=2)
    modes = []
    while scheduler.num_retractions == 0:
        committed = c.kv_len
        modes.append(driver.step().mode)
        driver.check_kv()
    assert modes[:4] == [ForwardMode.MIXED] * 4 and set(modes[4:]) == {ForwardMode.DECODE} and committed == 64
    assert scheduler.num_retractions == 1 and scheduler.running == [a, b] and scheduler.waiting == [c]
    assert scheduler.chunked is None and c.req_pool_idx is None and c.output_ids == []
    assert len(scheduler.kv.radix.match_prefix(c.prompt_ids)[0]) == committed - 16
    while scheduler.has_work():
        driver.step()
    assert [len(r.output_ids) for r in (a, b, c)] == [90, 90, 10]


def test_retracted_requests_go_back_in_arrival_order_and_resume_first():
    """The waiting queue stays in arrival order: "late", retracted first (it has generated least), goes
    back behind the earlier arrivals and ahead of "latest", which never got in; the earliest resumes first."""
    driver = SchedulerDriver(40, schedule_conservativeness=0)
    scheduler = driver.scheduler
    old = [driver.add(f"old{i}", [10 + i] * 6, 30, arrival=i) for i in range(3)]
    driver.step()
    late = driver.add("late", [20] * 6, 30, arrival=10)
    latest = None
    while scheduler.num_retractions == 0:
        if latest is None and scheduler.kv.free_tokens() < 10:  # too full to admit it
            latest = driver.add("latest", [30] * 6, 30, arrival=20)
        driver.step()
    retracted = [r for r in old if r not in scheduler.running]
    assert len(retracted) == 2 and scheduler.waiting == retracted + [late, latest]
    batch = driver.step()
    assert batch.mode is ForwardMode.EXTEND and batch.reqs[0] is retracted[0]


def test_a_request_whose_pending_token_ends_it_is_not_scheduled_again():
    """Overlap scheduling: the next batch is scheduled before this one's tokens resolve, so a request that
    its pending token takes to max_new_tokens (or the context length) is left out of it."""
    driver = SchedulerDriver(64, context_length=12)
    short = driver.add("short", [5] * 4, 2, arrival=0)
    long = driver.add("long", [6] * 8, 50, arrival=1)
    first = driver.launch()
    second = driver.launch()  # short's second token: its last
    assert second.batch.reqs == [short, long] and short in driver.scheduler.finishing
    third = driver.launch()
    fourth = driver.launch()  # long's fourth token: sequence length 12, the context length
    assert third.batch.reqs == fourth.batch.reqs == [long] and driver.scheduler.running == []
    assert driver.launch() is None
    for launched in (first, second, third, fourth):
        driver.resolve(launched)
    assert short.finish_reason == long.finish_reason == "length"
    assert [len(short.output_ids), len(long.output_ids)] == [2, 4]
    driver.check_kv()
    assert not driver.scheduler.has_work() and driver.scheduler.kv.free_tokens() == 64


def test_admission_stops_at_max_running_requests_and_at_the_prompt_that_does_not_fit():
    driver = SchedulerDriver(64, max_requests=2, schedule_conservativeness=0)
    a, b, c = (driver.add(rid, [30 + i] * 10, 4, arrival=i) for i, rid in enumerate("abc"))
    batch = driver.step()
    assert batch.reqs == [a, b] and driver.scheduler.waiting == [c]
    # A prompt that does not fit blocks those after it in the policy's order (shortest prompt first, at
    # one priority): the shorter "long" goes before "longer", and "longer" is not admitted past it.
    driver = SchedulerDriver(64, schedule_conservativeness=0)
    first = driver.add("first", [1] * 40, 8, arrival=0)
    assert driver.step().reqs == [first]
    longer = driver.add("longer", [2] * 30, 8, arrival=1)
    long = driver.add("long", [3] * 24, 8, arrival=2)
    assert driver.step().reqs == [first]
    assert driver.scheduler.waiting == [longer, long]
    assert driver.scheduler._prefill_order() == [long, longer]
