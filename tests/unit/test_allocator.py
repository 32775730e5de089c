import pytest
import torch

from kestrel.cache.allocator import TokenToKVPoolAllocator


def test_size_rounding_and_reserved_page():
    a = TokenToKVPoolAllocator(10, 4, "cpu")
    assert (a.size, a.num_pages, a.available_size(), a.used_size()) == (8, 2, 8, 0)
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(3, 4, "cpu")
    slots = a.alloc_for(0, 8, 0)
    assert slots.min() >= 4, "page 0 is reserved for padding"
    assert sorted(slots.tolist()) == list(range(4, 12))
    a.check()


def test_page_size_1_round_trip_fifo():
    a = TokenToKVPoolAllocator(100, 1, "cpu")
    s1 = a.alloc_for(0, 5, 0)
    assert s1.dtype == torch.int64 and s1.tolist() == [1, 2, 3, 4, 5]
    s2 = a.alloc_for(5, 3, int(s1[-1]))  # last_loc is irrelevant with page_size 1
    assert s2.tolist() == [6, 7, 8]
    assert a.used_size() == 8 and a.available_size() == 92
    a.free(s1)
    a.check()
    assert a.available_size() == 97
    # FIFO: freed pages go to the back of the free list.
    assert a.alloc_for(0, 92, 0).tolist() == list(range(9, 101))
    assert a.alloc_for(0, 5, 0).tolist() == [1, 2, 3, 4, 5]
    a.free(s2)
    a.check()
    assert a.available_size() == 3


def test_page_size_1_large_alloc_is_vectorized():
    a = TokenToKVPoolAllocator(200_000, 1, "cpu")
    for _ in range(20):
        s = a.alloc_for(0, 10_000, 0)
        assert s.numel() == 10_000
        a.free(s)
    a.check()
    assert a.available_size() == a.size


@pytest.mark.parametrize("seq_start,n,expected", [
    (0, 0, 0), (0, 1, 4), (0, 4, 4), (0, 5, 8),
    (1, 3, 0), (1, 4, 4), (3, 1, 0), (3, 2, 4), (4, 1, 4), (6, 5, 4), (6, 2, 0), (7, 10, 12),
])
def test_tokens_needed_partial_pages(seq_start, n, expected):
    a = TokenToKVPoolAllocator(64, 4, "cpu")
    assert a.tokens_needed(seq_start, n) == expected


def test_page_size_4_alloc_continues_partial_page():
    a = TokenToKVPoolAllocator(64, 4, "cpu")
    s1 = a.alloc_for(0, 6, 0)
    assert s1.tolist() == [4, 5, 6, 7, 8, 9]
    assert a.used_size() == 8
    s2 = a.alloc_for(6, 5, int(s1[-1]))  # 2 tokens fill page 2, 3 go into a new page
    assert s2.tolist() == [10, 11, 12, 13, 14]
    assert a.used_size() == 12
    s3 = a.alloc_for(11, 1, int(s2[-1]))  # fits in the partial page: no new page
    assert s3.tolist() == [15] and a.used_size() == 12
    # Positions map to page * ps + pos % ps.
    row = torch.cat([s1, s2, s3])
    assert ((row % 4) == torch.arange(12) % 4).all()
    a.free(row)
    a.check()
    assert a.available_size() == a.size


def test_exact_accounting_many_requests():
    a = TokenToKVPoolAllocator(4 * 50, 4, "cpu")
    rows = []
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(1, 12, (1,), generator=g))
        if a.tokens_needed(0, n) > a.available_size():
            break
        rows.append(a.alloc_for(0, n, 0))
        used = sum(-(-r.numel() // 4) * 4 for r in rows)
        assert a.used_size() == used
        a.check()
    all_pages = torch.cat([r // 4 for r in rows]).unique()
    assert all_pages.numel() * 4 == a.used_size()
    for r in rows:
        a.free(r)
        a.check()
    assert a.available_size() == a.size


def test_all_or_nothing_failure():
    a = TokenToKVPoolAllocator(8, 4, "cpu")
    s = a.alloc_for(0, 3, 0)
    # 1 token fits in the partial page, the other 5 need two new pages but only one is free.
    assert a.tokens_needed(3, 6) == 8 and a.available_size() == 4
    with pytest.raises(RuntimeError):
        a.alloc_for(3, 6, int(s[-1]))
    assert a.available_size() == 4 and a.used_size() == 4
    a.check()
    assert a.alloc_for(3, 5, int(s[-1])).tolist() == [7, 8, 9, 10, 11]
    with pytest.raises(RuntimeError):
        a.alloc_for(0, 1, 0)
    a.check()


def test_double_free_and_page0_detected():
    a = TokenToKVPoolAllocator(16, 4, "cpu")
    s = a.alloc_for(0, 4, 0)
    a.free(s)
    with pytest.raises(RuntimeError):
        a.free(s)
    with pytest.raises(RuntimeError):
        a.free(torch.tensor([0, 1]))
    with pytest.raises(RuntimeError):
        a.free(torch.tensor([16 + 4]))  # beyond the last usable page
    a.check()
    assert a.available_size() == 16
    a.free(torch.empty(0, dtype=torch.int64))  # no-op
