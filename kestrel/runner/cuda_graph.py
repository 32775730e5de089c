"""CUDA-graph capture and replay of decode batches.

A decode step of a large model launches hundreds of small kernels; replaying a captured graph removes
the per-kernel CPU launch cost. One graph per batch-size bucket; a batch is padded up to its bucket
with entries that point at the reserved padding row and slot 0, so padding never touches real KV.
"""
from __future__ import annotations

import bisect
import logging

import torch

from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode

logger = logging.getLogger(__name__)


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24] + list(range(32, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, attn_backend, padding_row: int, max_bs: int,
                 device: torch.device) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = max_bs
        dev = device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.full((max_bs,), padding_row, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.padding_row = padding_row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _batch(self, bs: int) -> ForwardBatch:
        zeros = torch.zeros(bs, dtype=torch.int64, device=self.input_ids.device)
        # Decode kernels read seq_lens (a static buffer, refreshed each replay); prefix/extend lens are
        # built once here and are not refreshed, so a decode backend must not read them.
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.seq_lens[:bs] - 1, extend_lens=zeros + 1,
            seq_lens_cpu=None, prefix_lens_cpu=None, extend_lens_cpu=None,
            logits_indices=torch.arange(bs, device=self.input_ids.device), attn_backend=self.attn_backend)

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(batch)
        return self.model.compute_logits(self.model(batch.input_ids, batch.positions, batch))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Largest first, so smaller graphs reuse the memory pool of the larger ones.
        for bs in reversed(self.buckets):
            batch = self._batch(bs)
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self._run(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._run(batch)
            self.pool = graph.pool()
            self.graphs[bs] = graph
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.forward_mode is ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab] for an eager-built decode batch."""
        bs = batch.batch_size
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc)
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        if bucket > bs:  # padding: reserved row, slot 0, length 1
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
            self.out_cache_loc[bs:bucket].zero_()
            self.req_pool_indices[bs:bucket].fill_(self.padding_row)
            self.seq_lens[bs:bucket].fill_(1)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:bs]
