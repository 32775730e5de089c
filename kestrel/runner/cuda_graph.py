"""CUDA-graph capture and replay of decode-like batches: (mode, tokens per request) per runner.

A decode step of a large model launches hundreds of small kernels; replaying a captured graph removes
the per-kernel CPU launch cost. One graph per batch-size bucket; a batch is padded up to its bucket
with entries that point at the reserved padding row and slot 0, so padding never touches real KV.
A runner for t > 1 tokens per request (a speculative verify) computes logits at every token and
takes the tree mask from a static buffer (causal when the batch has none).
"""
from __future__ import annotations

import logging

import torch

from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.forward_output import ForwardOutput
from kestrel.models.base import ForwardModel
from kestrel.runner.graph_capture import CapturedGraphs, batch_size_buckets, bucket_for

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    def __init__(self, model: ForwardModel, attn_backend, padding_row: int, max_bs: int, device: torch.device,
                 mode: ForwardMode = ForwardMode.DECODE, tokens: int = 1, capture_hidden: tuple[int, ...] = (),
                 features: tuple[int, torch.dtype] | None = None, capture: bool = True,
                 max_seq_len: int | None = None) -> None:
        """`features`: (width, dtype) of a draft head's feature input, kept in a static buffer too.
        `capture=False` keeps the static buffers without capturing (`run_uncaptured`, on any device).
        `max_seq_len`: the longest sequence the graphs serve (a backend whose captured work is sized by
        it, as dsv4's); a batch with a longer one runs eagerly."""
        self.model = model
        self.attn_backend = attn_backend
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = max_bs
        self.mode, self.tokens, self.capture_hidden = mode, tokens, capture_hidden
        n = max_bs * tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.full((max_bs,), padding_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((max_bs,), tokens, dtype=torch.int64, device=device)
        self.prefix_lens = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril().flatten()
        self.tree_mask = self.causal.repeat(max_bs) if tokens > 1 else None
        # Fixed by the shape, but the graphs read them: they must live as long as the graphs do.
        self.extend_lens = torch.full((max_bs,), tokens, dtype=torch.int64, device=device)
        self.tree_starts = torch.arange(max_bs, device=device) * tokens * tokens
        self.logits_indices = torch.arange(n, device=device)
        self.features = None if features is None else torch.zeros(n, features[0], dtype=features[1], device=device)
        self.padding_row = padding_row
        self.max_seq_len = max_seq_len
        # By batch-size bucket: (logits, hidden, captured hidden) of the padded batch.
        self.graphs = CapturedGraphs(device)
        if capture:
            self._capture_all()

    def _batch(self, bs: int) -> ForwardBatch:
        t = self.tokens
        n = bs * t
        # Kernels read the static buffers, refreshed each replay (extend_lens, the tree starts and the
        # logits rows are fixed by the shape).
        return ForwardBatch(
            forward_mode=self.mode, input_ids=self.input_ids[:n], positions=self.positions[:n],
            out_cache_loc=self.out_cache_loc[:n], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            seq_lens_cpu=None, prefix_lens_cpu=None, extend_lens_cpu=None, max_extend=t,
            logits_indices=self.logits_indices[:n], attn_backend=self.attn_backend,
            tree_mask=self.tree_mask[:n * t] if self.tree_mask is not None else None,
            tree_mask_starts=self.tree_starts[:bs] if t > 1 else None,
            capture_hidden=self.capture_hidden,
            spec_features=self.features[:n] if self.features is not None else None)

    def _run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden), hidden, batch.captured_hidden

    @torch.inference_mode()
    def _capture_all(self) -> None:
        for bs in reversed(self.buckets):  # largest first (CapturedGraphs)
            batch = self._batch(bs)
            self.graphs.warm_up(lambda: self._run(batch))
            self.graphs.capture(bs, lambda: self._run(batch))
        logger.info("captured CUDA graphs for %s batches of %d token(s) per request, batch sizes %s",
                    self.mode.value, self.tokens, self.buckets)

    def can_run(self, batch: ForwardBatch) -> bool:
        t, n = self.tokens, batch.input_ids.shape[0]
        return (batch.forward_mode is self.mode and batch.batch_size <= self.max_bs and n == batch.batch_size * t
                and batch.capture_hidden == self.capture_hidden
                and (batch.spec_features is None) == (self.features is None)
                and batch.logits_indices.shape[0] == n
                and (batch.extend_lens_cpu is None or all(e == t for e in batch.extend_lens_cpu))
                and (self.max_seq_len is None or batch.seq_lens_cpu is None
                     or max(batch.seq_lens_cpu) <= self.max_seq_len))

    def replay(self, batch: ForwardBatch) -> ForwardOutput:
        """The ForwardOutput of an eager-built batch that `can_run`."""
        return self._output(batch, self.graphs.replay(self._stage(batch)))

    def run_uncaptured(self, batch: ForwardBatch) -> ForwardOutput:
        """What `replay` computes, run eagerly: the batch staged into the static buffers, padded to its
        bucket, through the same forward the graph captured (CPU tests of graph-only paths, debugging)."""
        bucket = self._stage(batch)
        return self._output(batch, self._run(self._batch(bucket)))

    def _stage(self, batch: ForwardBatch) -> int:
        """Copy the batch into the static buffers, pad them to its bucket; the bucket."""
        bs, t = batch.batch_size, self.tokens
        n = bs * t
        bucket = bucket_for(self.buckets, bs)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        self.prefix_lens[:bs].copy_(batch.prefix_lens)
        if self.features is not None:
            self.features[:n].copy_(batch.spec_features)
        if self.tree_mask is not None:
            self.tree_mask[:n * t].copy_(batch.tree_mask if batch.tree_mask is not None else self.causal.repeat(bs))
        if bucket > bs:  # padding: reserved row, slot 0, one page of length t
            self.input_ids[n:bucket * t].zero_()
            self.positions[n:bucket * t].zero_()
            self.out_cache_loc[n:bucket * t].zero_()
            self.req_pool_indices[bs:bucket].fill_(self.padding_row)
            self.seq_lens[bs:bucket].fill_(t)
            self.prefix_lens[bs:bucket].zero_()
        return bucket

    @staticmethod
    def _output(batch: ForwardBatch, outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> ForwardOutput:
        n = batch.input_ids.shape[0]
        logits, hidden, captured = outputs
        # Every row is a logits row (one token per request, or all of a verify's): hidden is per token.
        return ForwardOutput(logits[:n], hidden[:n], captured[:n] if captured is not None else None, hidden[:n])
