"""FutureTokens: pending inputs are swapped for the sampled ids on the device, across ring wraps."""
from __future__ import annotations

import pytest
import torch

from kestrel.runner.future_tokens import FutureTokens


def test_resolve_swaps_only_pending_ids_and_the_ring_wraps():
    ring = FutureTokens(capacity=5, device=torch.device("cpu"))
    first = ring.put(torch.tensor([11, 12, 13]))
    assert first == [0, 1, 2]
    ids = torch.tensor([7, -1 - first[2], 0, -1 - first[0]])
    assert ring.resolve(ids).tolist() == [7, 13, 0, 11]
    second = ring.put(torch.tensor([21, 22, 23]))  # does not fit after index 2: starts over at 0
    assert second == [0, 1, 2]
    assert ring.resolve(torch.tensor([-1 - i for i in second])).tolist() == [21, 22, 23]
    with pytest.raises(ValueError, match="capacity"):
        ring.put(torch.arange(6))


def test_request_tokens_name_pending_positions():
    from kestrel.core.request import Request
    from kestrel.core.sampling_params import SamplingParams

    req = Request(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams(), seed=0, arrival=0,
                  output_ids=[4], pending=[9])
    assert req.seq_len == 5 and req.num_generated == 2 and req.fill_ids == [1, 2, 3, 4]
    assert req.tokens(0, 5) == [1, 2, 3, 4, -10]
    assert req.tokens(4, 5) == [-10] and req.tokens(2, 4) == [3, 4]
