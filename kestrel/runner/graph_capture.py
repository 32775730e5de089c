"""CUDA-graph capture shared by the graph runners: buckets, warm-up, one memory pool, replay.

Each runner (whole decode-like forwards, piecewise prefill segments, a speculative round's kernels)
captures a function once per shape bucket into static buffers and replays the smallest bucket that
holds a call. What they share is here: the bucket lookup, the warm-up before a capture, the memory pool
every graph of a runner captures into, and the outputs each capture returned.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

# Eager runs before a capture: Triton compiles its kernels and cuBLAS picks its algorithms outside the graph.
WARMUP_RUNS = 2


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24] + list(range(32, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def bucket_for(buckets: list[int], size: int) -> int:
    """The smallest bucket (of the sorted `buckets`) that holds `size`."""
    return buckets[bisect.bisect_left(buckets, size)]


class CapturedGraphs:
    """Graphs by key, all captured into one memory pool, with what each captured call returned (static
    tensors that every replay of its graph rewrites). Capture the largest shape first: the temporaries
    of the smaller graphs captured after it then fit in the memory the pool already holds."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Hashable, Any] = {}
        self._pool = None

    def warm_up(self, fn: Callable[[], object]) -> None:
        for _ in range(WARMUP_RUNS):
            fn()
        torch.cuda.synchronize(self.device)

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> None:
        """Capture `fn` (warmed up already) as the graph of `key`; its outputs are kept."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.outputs[key] = fn()
        self._pool = graph.pool()
        self.graphs[key] = graph

    def replay(self, key: Hashable) -> Any:
        """Replay the graph of `key`; the outputs its capture returned, now holding this replay's values."""
        self.graphs[key].replay()
        return self.outputs[key]

    def __iter__(self) -> Iterator[Hashable]:
        """The keys captured."""
        return iter(self.graphs)

    def __len__(self) -> int:
        return len(self.graphs)
