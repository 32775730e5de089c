"""Aborting a request whose prompt is being prefilled in chunks, on the host without a model: tokens are
made up. The engine aborts between steps, so with overlap scheduling the aborted request's last chunk (or
its first token) may still be in flight."""
from __future__ import annotations

from kestrel.core.forward_mode import ForwardMode
from kestrel.core.request import Request
from tests.conftest import SchedulerDriver

CHUNK = 16
POOL = 512


def decoding_beside(prompt_len: int) -> tuple[SchedulerDriver, list[Request], Request | None]:
    """A mixed-chunk driver with "a" and "b" decoding and "c" (a prompt of prompt_len) waiting."""
    driver = SchedulerDriver(POOL, chunked_prefill_size=CHUNK, enable_mixed_chunk=True)
    running = [driver.add("a", [5] * 6, 20, arrival=0), driver.add("b", [6] * 9, 20, arrival=1)]
    driver.step()
    driver.step()
    c = driver.add("c", list(range(100, 100 + prompt_len)), 20, arrival=2) if prompt_len else None
    return driver, running, c


def run_to_the_end(driver: SchedulerDriver) -> int:
    steps = 0
    while driver.scheduler.has_work():
        driver.step()
        driver.check_kv()
        steps += 1
    return steps


def test_abort_during_a_chunked_prefill_frees_its_kv_keeps_its_chunks_cached_and_spares_the_others():
    driver, (a, b), c = decoding_beside(50)
    scheduler, radix = driver.scheduler, driver.scheduler.kv.radix
    driver.step()
    launched = driver.launch()  # c's second chunk, in flight when the abort comes
    assert launched.batch.reqs == [c, a, b] and scheduler.chunked is c and c.kv_len == 2 * CHUNK
    lens = [a.kv_len, b.kv_len]

    assert scheduler.abort("c") is c
    assert c.finished and c.finish_reason == "abort" and c.output_ids == [] and c.req_pool_idx is None
    assert scheduler.chunked is None and c not in scheduler.live() and scheduler.abort("c") is None
    # Its committed chunks are in the radix tree, no longer locked; every other slot of it is free.
    assert len(radix.match_prefix(c.prompt_ids)[0]) == 2 * CHUNK and radix.protected_size() == 0
    driver.check_kv()
    assert driver.scheduler.kv.free_tokens() == POOL - sum(len(r.slots) for r in (a, b))

    driver.resolve(launched)
    batch = driver.step()
    assert batch.mode is ForwardMode.DECODE and batch.reqs == [a, b] and batch.prefix_lens == lens
    steps = run_to_the_end(driver)
    # a and b end as they would have without c (they decoded in c's two chunk steps and the one after
    # the abort too), and their KV with c's chunks is all evictable.
    alone, (a_alone, b_alone), _ = decoding_beside(0)
    assert run_to_the_end(alone) == 3 + steps
    assert [a.output_ids, b.output_ids] == [a_alone.output_ids, b_alone.output_ids]
    assert a.finish_reason == b.finish_reason == "length"
    assert scheduler.kv.free_tokens() == POOL and radix.protected_size() == 0

    # A later request with c's prompt reuses the chunks c left behind.
    again = driver.add("again", c.prompt_ids, 4, arrival=3)
    batch = driver.step()
    assert batch.reqs == [again] and batch.prefix_lens == [2 * CHUNK] and again.cached_tokens == 2 * CHUNK


def test_abort_while_the_first_token_is_in_flight_drops_the_token():
    """c's last chunk ran and its first token is pending: after the abort the token resolves into
    nothing, and c is in no batch again. Its prompt's KV (the forward that writes it was launched) goes to
    the radix tree, the last chunk too."""
    driver, (a, b), c = decoding_beside(20)
    scheduler = driver.scheduler
    driver.step()
    launched = driver.launch()
    assert c in launched.sampled and c.pending and scheduler.running == [a, b, c]
    assert scheduler.abort("c") is c and scheduler.running == [a, b] and not c.pending
    assert len(scheduler.kv.radix.match_prefix(c.prompt_ids)[0]) == 20
    driver.check_kv()
    nxt = driver.launch()  # overlap: the next batch is scheduled before the aborted one resolves
    assert nxt.batch.reqs == [a, b]
    driver.resolve(launched)
    driver.resolve(nxt)
    assert c.output_ids == [] and c.finish_reason == "abort"
    run_to_the_end(driver)
    assert scheduler.kv.free_tokens() == POOL


def test_abort_of_a_waiting_request_touches_no_kv():
    driver, _, c = decoding_beside(20)
    free = driver.scheduler.kv.free_tokens()
    assert driver.scheduler.abort("c") is c and c.finish_reason == "abort"
    assert driver.scheduler.waiting == [] and driver.scheduler.kv.free_tokens() == free
    driver.check_kv()
