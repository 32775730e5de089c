"""Piecewise CUDA graphs: prefill (EXTEND) and MIXED forwards replayed between their attention calls.

An eager prefill of a few hundred tokens waits on the host for about a third of its time: each layer
launches ~10 kernels, half of them Triton kernels with a slow Python launch path. The whole forward
cannot be one graph: the attention kernels' grids and metadata follow the batch's host lengths. So the
decoder is cut at its attention calls into segments, each captured once per token-count bucket:

    segment 0       embed .. layer 0's input norm, q/k/v, rope
    segment i       layer i-1's o_proj, post-attention norm, MLP .. layer i's input norm, q/k/v, rope
    segment L       layer L-1's o_proj, post-attention norm, MLP, final norm

A step's tokens are padded up to their bucket (token 0 at position 0) in static buffers; the segments
replay on the bucket, and each attention runs eagerly in between, on the real tokens only, so padded
rows never reach the KV pool; the LM head runs eagerly on the real rows. Every op in a segment works
row by row (GEMMs, norms, rope, activation, per-token FP8 quantization), so padded rows cannot change
real ones. The segments exchange state through static buffers shared by every bucket; all graphs share
one memory pool, so a segment's temporaries take the memory of the largest one only.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable

import torch

from kestrel.attention.decisions import piecewise_graph_prefill
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.forward_output import ForwardOutput
from kestrel.models.base import ForwardModel
from kestrel.runner.graph_capture import CapturedGraphs, bucket_for

if TYPE_CHECKING:
    from kestrel.config import EngineConfig

logger = logging.getLogger(__name__)

MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts a graph is captured for: steps of 64 up to 1024, of 128 up to 2048, of 256 up to
    4096, then of 512. Padded rows cost GEMM time: at most 64 of them up to 1024 tokens, under 12.5 %
    above; a MIXED step of a 1000-token chunk and 64 decodes pads 1064 to 1152."""
    sizes = list(range(64, 1025, 64)) + list(range(1152, 2049, 128)) + list(range(2304, 4097, 256)) + \
        list(range(4608, max_tokens + 1, 512))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def piecewise_unavailable(config: "EngineConfig", model: ForwardModel, device: torch.device) -> str | None:
    """Why this engine cannot use piecewise graphs although they were asked for; None if it can."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if config.cuda_graph.disable_cuda_graph:
        return "--disable-cuda-graph turns every CUDA graph off"
    if not piecewise_graph_prefill(config):
        return "the prefill attention backend does not run between piecewise graphs (triton does)"
    if config.parallel.tp_size > 1:
        return "tensor parallelism: the all-reduces inside the segments are not captured piecewise (untested)"
    if model.segmented_decoder() is None:
        return f"{type(model).__name__} does not split its forward at the attention calls (Llama family only)"
    return None


def batch_fallback(batch: ForwardBatch, max_tokens: int) -> str | None:
    """Why this batch runs eagerly instead; None if the piecewise graphs serve it."""
    if batch.forward_mode not in MODES:
        return f"{batch.forward_mode.value} batch (EXTEND and MIXED only)"
    if batch.input_ids.shape[0] > max_tokens:
        return "more new tokens than --piecewise-cuda-graph-max-tokens"
    if batch.capture_hidden:
        return "hidden states of inner layers asked for (an EAGLE-3 draft's features)"
    if batch.spec_features is not None or batch.tree_mask is not None:
        return "a draft head's feature input or a verify tree"
    return None


class PiecewiseGraphRunner:
    """Runs EXTEND / MIXED forwards of `model` through its segments, captured per token bucket.
    `capture=False` keeps the static buffers without capturing (`run_uncaptured`, on any device)."""

    def __init__(self, model: ForwardModel, max_tokens: int, device: torch.device, capture: bool = True) -> None:
        self.model = model
        decoder = model.segmented_decoder()
        assert decoder is not None, "piecewise_unavailable says which models have no segmented decoder"
        self.decoder = decoder
        self.layers = decoder.layers
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = max_tokens
        free_before = torch.cuda.mem_get_info(device)[0] if capture else 0
        shapes = decoder.segment_shapes()
        n, dtype = max_tokens, shapes.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        # State handed from one segment to the next. Padded rows of `attn_out` keep whatever an earlier
        # step left there: finite values that only padded rows read.
        self.residual = torch.zeros(n, shapes.hidden_size, dtype=dtype, device=device)
        self.q = torch.zeros(n, shapes.q_size, dtype=dtype, device=device)
        self.k = torch.zeros(n, shapes.kv_size, dtype=dtype, device=device)
        self.v = torch.zeros(n, shapes.kv_size, dtype=dtype, device=device)
        self.attn_out = torch.zeros(n, shapes.q_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, shapes.hidden_size, dtype=dtype, device=device)  # the final norm's output
        self.graphs = CapturedGraphs(device)  # by (bucket, segment)
        self.replays: Counter[ForwardMode] = Counter()  # forwards served by replaying, by mode (tests, benches)
        self.graph_memory = 0  # device bytes taken: static buffers, graphs and their pool, warm-up's cache
        if capture:
            self._capture_all(device)
            self.graph_memory = free_before - torch.cuda.mem_get_info(device)[0]
            logger.info("piecewise CUDA graphs take %.2f GiB of device memory", self.graph_memory / 2**30)

    @property
    def num_segments(self) -> int:
        return len(self.layers) + 1

    def _segment(self, i: int, tokens: int) -> None:
        """Segment i on the first `tokens` rows of the static buffers (see the module docstring)."""
        if i == 0:
            hidden, residual = self.decoder.embed(self.input_ids[:tokens]), None
        else:
            hidden, residual = self.layers[i - 1].post_attention(self.attn_out[:tokens], self.residual[:tokens])
        if i == len(self.layers):
            _store(self.hidden[:tokens], self.decoder.final_norm(hidden, residual))
            return
        q, k, v, residual = self.layers[i].pre_attention(self.positions[:tokens], hidden, residual)
        for buf, value in ((self.q, q), (self.k, k), (self.v, v), (self.residual, residual)):
            _store(buf[:tokens], value)

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        start = time.perf_counter()
        for bucket in reversed(self.buckets):  # largest first (CapturedGraphs)
            self.graphs.warm_up(lambda: [self._segment(i, bucket) for i in range(self.num_segments)])
            for i in range(self.num_segments):
                self.graphs.capture((bucket, i), lambda: self._segment(i, bucket))
        torch.cuda.synchronize(device)
        logger.info("captured piecewise CUDA graphs for EXTEND/MIXED: %d segments x %d token buckets %s in %.1f s",
                    self.num_segments, len(self.buckets), self.buckets, time.perf_counter() - start)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch_fallback(batch, self.max_tokens) is None

    def replay(self, batch: ForwardBatch) -> ForwardOutput:
        """The ForwardOutput of an eager-built batch that `can_run`."""
        self.replays[batch.forward_mode] += 1
        return self._forward(batch, lambda i, bucket: self.graphs.replay((bucket, i)))

    def run_uncaptured(self, batch: ForwardBatch) -> ForwardOutput:
        """What `replay` computes, run eagerly: the same padding, static buffers and segments (CPU tests)."""
        return self._forward(batch, lambda i, bucket: self._segment(i, bucket))

    def _forward(self, batch: ForwardBatch, run_segment: Callable[[int, int], None]) -> ForwardOutput:
        n = batch.input_ids.shape[0]
        bucket = bucket_for(self.buckets, n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        if bucket > n:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
        batch.attn_backend.init_forward_metadata(batch)
        for i, layer in enumerate(self.layers):
            run_segment(i, bucket)
            self.attn_out[:n].copy_(layer.attention(self.q[:n], self.k[:n], self.v[:n], batch))
        run_segment(len(self.layers), bucket)
        # A view of the static buffer, as a decode graph's outputs are: read before the next forward.
        token_hidden = self.hidden[:n]
        hidden = token_hidden[batch.logits_indices]
        return ForwardOutput(self.model.compute_logits(hidden), hidden, None, token_hidden)


def _store(buf: torch.Tensor, value: torch.Tensor) -> None:
    """Put a segment's result into its static buffer, unless it was computed there in place (the
    fused Triton norm updates the residual where it lies)."""
    if value.data_ptr() != buf.data_ptr():
        buf.copy_(value)
