"""Chunked prefill beside running decodes, with and without enable_mixed_chunk, on the host without a
model: tokens are made up."""
from __future__ import annotations

from kestrel.core.forward_mode import ForwardMode
from tests.conftest import SchedulerDriver

CHUNK = 16


def two_decoding(mixed: bool) -> SchedulerDriver:
    """A driver whose requests "a" and "b" are decoding, with room for everything to come."""
    driver = SchedulerDriver(512, chunked_prefill_size=CHUNK, enable_mixed_chunk=mixed)
    driver.add("a", [5] * 6, 20, arrival=0)
    driver.add("b", [6] * 9, 20, arrival=1)
    driver.step()
    driver.step()
    return driver


def test_a_mixed_step_runs_one_prefill_chunk_and_every_decode():
    """Each step holds the next chunk of c's 40-token prompt (first) and a decode of a and b; c's rows
    sample only with its last chunk, which shares the budget with d's first chunk; then c joins the
    decodes after those admitted before it."""
    driver = two_decoding(mixed=True)
    scheduler = driver.scheduler
    a, b = scheduler.running
    c = driver.add("c", list(range(100, 140)), 20, arrival=2)
    for chunk in range(2):
        lens = [a.kv_len, b.kv_len]
        launched = driver.launch()
        batch = launched.batch
        assert batch.mode is ForwardMode.MIXED and batch.reqs == [c, a, b] and batch.num_prefill == 1
        assert batch.prefix_lens == [CHUNK * chunk] + lens and batch.extend_lens == [CHUNK, 1, 1]
        assert batch.input_ids == c.prompt_ids[CHUNK * chunk:CHUNK * (chunk + 1)] + \
            [a.fill_ids[-1], b.fill_ids[-1]]
        assert batch.positions == list(range(CHUNK * chunk, CHUNK * (chunk + 1))) + lens
        assert len(batch.out_cache_loc) == CHUNK + 2
        assert launched.sampled == [a, b]  # c's prompt is not done: no token for it yet
        driver.resolve(launched)
        driver.check_kv()
        # The chunk went to the radix tree, locked for c.
        assert scheduler.chunked is c and c.cached_len == c.kv_len == CHUNK * (chunk + 1)
    d = driver.add("d", list(range(200, 230)), 20, arrival=3)
    launched = driver.launch()
    batch = launched.batch
    assert batch.reqs == [c, d, a, b] and batch.num_prefill == 2 and batch.extend_lens == [8, 8, 1, 1]
    assert launched.sampled == [c, a, b] and scheduler.chunked is d
    driver.resolve(launched)
    assert scheduler.running == [a, b, c]
    assert driver.step().reqs == [d, a, b, c]
    while scheduler.has_work():
        driver.step()
        driver.check_kv()
    assert all(len(r.output_ids) == 20 for r in (a, b, c, d))


def test_without_mixing_the_decodes_wait_for_the_chunked_prefill():
    driver = two_decoding(mixed=False)
    scheduler = driver.scheduler
    a, b = scheduler.running
    c = driver.add("c", list(range(100, 140)), 20, arrival=2)
    generated = [a.num_generated, b.num_generated]
    for _ in range(3):
        batch = driver.step()
        assert batch.mode is ForwardMode.EXTEND and batch.reqs == [c] and batch.num_prefill == 1
    assert [a.num_generated, b.num_generated] == generated and c.num_generated == 1
    batch = driver.step()
    assert batch.mode is ForwardMode.DECODE and batch.reqs == [a, b, c]


def test_a_verify_step_is_never_mixed():
    """A decode of several tokens per request (a speculative verify) does not take prefill rows: the
    prefill runs alone first."""
    driver = two_decoding(mixed=True)
    c = driver.add("c", [7] * 10, 20, arrival=2)
    batch = driver.launch(decode_tokens=3).batch
    assert batch.mode is ForwardMode.EXTEND and batch.reqs == [c]


def test_with_nothing_decoding_a_mixed_scheduler_runs_plain_prefills():
    driver = SchedulerDriver(512, chunked_prefill_size=CHUNK, enable_mixed_chunk=True)
    a = driver.add("a", [5] * 20, 4, arrival=0)
    assert driver.step().mode is ForwardMode.EXTEND
    batch = driver.step()  # a's last chunk rides with no decode: a is not running yet
    assert batch.mode is ForwardMode.EXTEND and batch.reqs == [a] and batch.extend_lens == [4]
    assert driver.step().mode is ForwardMode.DECODE
