"""Fixtures and helpers every test folder shares. Without a GPU, Triton kernels run through Triton's
interpreter (set before any kestrel module that defines one is imported)."""
import itertools
import os
import time
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kestrel.cache.allocator import TokenToKVPoolAllocator  # noqa: E402 - after TRITON_INTERPRET
from kestrel.cache.radix import RadixCache  # noqa: E402
from kestrel.cache.req_to_token import ReqToTokenPool  # noqa: E402
from kestrel.config import SchedulerConfig  # noqa: E402
from kestrel.core.batch import ScheduledBatch  # noqa: E402
from kestrel.core.request import Request  # noqa: E402
from kestrel.core.sampling_params import SamplingParams  # noqa: E402
from kestrel.engine.scheduler import Scheduler  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of thousands of tiny ops (DeepSeek-V4's tests, grammar-masked decoding): with the CPU
    shared, a second thread's spin-waits cost far more than it gives (up to 50x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Launched:
    """A batch scheduled and committed, its sampled tokens not yet resolved."""

    batch: ScheduledBatch
    sampled: list[Request]
    futures: list[list[int]]


class SchedulerDriver:
    """A real Scheduler over a host KV pool of page size 1, driven step by step as the engine drives it,
    without a model: every sampled token is `token`. `launch` schedules a batch and commits it (applying
    its table writes, as the runner would); `resolve` gives its sampled requests their tokens. Overlap
    scheduling launches the next batch between the two; `step` is a step without overlap."""

    def __init__(self, pool_tokens: int, context_length: int = 256, max_requests: int = 32,
                 chunked_prefill_size: int = -1, token: int = 3, clock: Callable[[], float] = time.monotonic,
                 **config) -> None:
        """`config`: the other SchedulerConfig fields (schedule_conservativeness, enable_mixed_chunk);
        `clock`: the scheduler's (a simulated one makes waiting times exact)."""
        allocator = TokenToKVPoolAllocator(pool_tokens, 1, "cpu")
        config = SchedulerConfig(max_running_requests=max_requests, chunked_prefill_size=chunked_prefill_size,
                                 **config)
        # As in the engine, no request outgrows the pool: the length limit is the smaller of the two.
        self.max_req_len = min(context_length, pool_tokens)
        self.scheduler = Scheduler(config, allocator, RadixCache(allocator, 1),
                                   ReqToTokenPool(max_requests, self.max_req_len + 1, "cpu"), set(), self.max_req_len,
                                   clock=clock)
        self.token = token
        self._futures = itertools.count()

    def add(self, rid: str, prompt: list[int], max_new_tokens: int, arrival: int, **params) -> Request:
        """Queue a request the engine would accept (it refuses one that could outgrow the pool)."""
        assert len(prompt) < self.max_req_len and len(prompt) + max_new_tokens <= self.scheduler.allocator.size
        req = Request(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, **params), seed=0, arrival=arrival)
        self.scheduler.add(req)
        return req

    def launch(self, decode_tokens: int = 1) -> Launched | None:
        """Schedule and commit one batch (None when there is nothing to run)."""
        batch = self.scheduler.schedule(decode_tokens)
        if batch is None:
            return None
        rows, cols, slots = batch.table_writes
        self.scheduler.kv.req_to_token.table[rows, cols] = slots
        sampled = [batch.reqs[i] for i in self.scheduler.sampling_rows(batch)]
        futures = [[next(self._futures)] for _ in sampled]
        self.scheduler.commit(batch, sampled, futures)
        return Launched(batch, sampled, futures)

    def resolve(self, launched: Launched) -> None:
        self.scheduler.resolve(launched.sampled, [[self.token]] * len(launched.sampled), launched.futures)

    def step(self) -> ScheduledBatch | None:
        """One step without overlap: its batch (None when there is nothing to run)."""
        launched = self.launch()
        if launched is None:
            assert not self.scheduler.has_work(), "the scheduler stalled: requests wait but nothing runs"
            return None
        self.resolve(launched)
        return launched.batch

    def check_kv(self) -> None:
        """Every KV slot is free, in the radix tree, or owned by the one live request whose row lists it;
        each tree node is locked once per request whose cached prefix runs through it."""
        kv = self.scheduler.kv
        alloc, radix = kv.allocator, kv.radix
        alloc.check()
        holders = [r for r in self.scheduler.live() if r.req_pool_idx is not None]
        assert kv.req_to_token.available() == kv.req_to_token.max_requests - len(holders)
        locks: dict[object, int] = {}
        owned: list[int] = []
        for req in holders:
            assert req.cached_len <= req.kv_len <= len(req.slots) == req.kv_len + req.extend_len
            assert kv.req_to_token.table[req.req_pool_idx, :len(req.slots)].tolist() == req.slots
            tree_slots, _ = radix.match_prefix(req.fill_ids[:req.cached_len])
            assert tree_slots.tolist() == req.slots[:req.cached_len], "a cached prefix is not the tree's"
            owned += req.slots[req.cached_len:]
            node = req.last_node
            while node is not radix.root:
                locks[node] = locks.get(node, 0) + 1
                node = node.parent
        assert len(set(owned)) == len(owned), "a slot is owned by two requests"
        assert alloc.used_size() == radix.total_size() + len(owned)
        stack, protected = list(radix.root.children.values()), 0
        while stack:
            node = stack.pop()
            stack += node.children.values()
            assert node.lock_ref == locks.get(node, 0), "a radix lock count disagrees with the requests"
            protected += len(node.key) if node.lock_ref else 0
        assert radix.protected_size() == protected
