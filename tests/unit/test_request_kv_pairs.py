"""A feature draft's radix keys: position p keyed by (token p, token p + 1), since the draft's KV there was
computed from token p + 1 (kestrel.engine.request_kv.cache_key)."""
import pytest

from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.kv_events import BlockStored
from kestrel.cache.kv_events_log import BlockChains, KVEventLog
from kestrel.cache.radix import RadixCache
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.request import Request
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.request_kv import RequestKV, cache_key


def make(pair_keys: bool, page_size: int = 1, events=None) -> RequestKV:
    alloc = TokenToKVPoolAllocator(256, page_size, "cpu")
    return RequestKV(alloc, RadixCache(alloc, page_size, events=events), ReqToTokenPool(8, 64, "cpu"), pair_keys)


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=4), 0, 0)


def run_prompt(kv: RequestKV, req: Request) -> list[int]:
    """Admit `req`, allocate its prompt's uncached tokens; returns the slots it ran with."""
    kv.admit(req, kv.match(req))
    kv.allocate([req], [len(req.prompt_ids) - req.kv_len])
    req.kv_len, req.extend_len = len(req.prompt_ids), 0
    return list(req.slots)


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_chunk_inserted_after_a_branch_keeps_its_own_kv_at_the_branch(page_size):
    """A and B run at once (neither was cached at admission) and share [1, 2, 3, 4]; A's chunk goes to the
    tree first. B's insertion takes A's slots only where the next token agrees too: at position 3 (token 4,
    then 5 for A and 9 for B) the draft's KV differs, and B keeps its own (before: A's)."""
    for pairs in (True, False):
        kv = make(pairs, page_size)
        a, b = request("a", [1, 2, 3, 4, 5, 6, 7]), request("b", [1, 2, 3, 4, 9, 9, 9])
        own_a, own_b = run_prompt(kv, a), run_prompt(kv, b)
        kv.commit_chunk(a)
        kv.commit_chunk(b)
        shared = 3 if pairs else 4
        shared -= shared % page_size
        assert b.slots[:shared] == own_a[:shared]
        assert b.slots[shared:] == own_b[shared:]
        kv.release(a)
        kv.release(b)
        assert kv.allocator.available_size() + kv.radix.evictable_size() == kv.allocator.size


def test_a_match_stops_where_the_next_token_differs():
    """Equal to the token-keyed match minus its last token (what a feature draft recomputed before), and a
    full path is reused up to the last token whose successor is known."""
    kv = make(True)
    a = request("a", [1, 2, 3, 4, 5, 6])
    run_prompt(kv, a)
    a.output_ids = [8]  # sampled, not run: its position has no KV
    kv.release(a)
    for prompt, cached in (([1, 2, 3, 4, 7, 7], 3), ([1, 2, 3, 4, 5, 6, 8, 2], 6), ([1, 2, 3, 4, 5, 6, 9], 5),
                           ([1, 2], 1)):
        req = request("c", prompt)
        kv.match(req)
        assert req.cached_len == cached, prompt
        kv.unmatch(req)


def test_keys_and_events_name_the_real_tokens():
    req = request("a", [5, 6, 7])
    assert cache_key(req) == [5, 6, 7]
    assert cache_key(req, pairs=True) == [5 + (6 << 20), 6 + (7 << 20)]
    assert cache_key(req, 1, pairs=True) == [5 + (6 << 20)]

    class Sink:
        batches = []

        def submit(self, ts, records):
            self.batches.append(records)

    log = KVEventLog(Sink())
    kv = make(True, 1, log)
    run_prompt(kv, req)
    req.output_ids = [9]
    kv.release(req)
    log.end_step()
    (stored,) = BlockChains(1, "").events(Sink.batches[0])
    assert isinstance(stored, BlockStored) and stored.token_ids == [5, 6, 7]
