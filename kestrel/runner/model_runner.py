"""Runs one model over the engine's KV memory: turns a scheduled batch into a forward."""
from __future__ import annotations

import importlib.util
import itertools
import logging

import torch

from kestrel.attention.decisions import cuda_graph_backends, shared_triton_kernel
from kestrel.attention.hybrid import HybridBackend
from kestrel.attention.registry import REGISTRY, create_backend
from kestrel.cache.kv_memory import KVMemory, KVPools
from kestrel.config import EngineConfig
from kestrel.core.batch import ScheduledBatch
from kestrel.core.forward_batch import DeviceInputs, ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.core.forward_output import ForwardOutput
from kestrel.layers.kernels import Kernels
from kestrel.lora.pool import LoRAPool
from kestrel.models.base import ForwardModel
from kestrel.runner.cuda_graph import CudaGraphRunner
from kestrel.runner.future_tokens import FutureTokens
from kestrel.runner.piecewise_graph import PiecewiseGraphRunner, piecewise_unavailable

logger = logging.getLogger(__name__)


def triton_on_device(config: EngineConfig) -> bool:
    """Triton kernels for the layers and the sampler's argmax: on CUDA, when Triton is installed."""
    return config.device != "cpu" and importlib.util.find_spec("triton") is not None


def layer_kernels(config: EngineConfig) -> Kernels:
    on_device = triton_on_device(config)
    return Kernels(triton_rope=on_device and shared_triton_kernel(config), triton_elementwise=on_device,
                   triton_fp8=on_device, triton_int4=on_device, triton_gemv=on_device)


class ModelRunner:
    """`model` over `pools` (its share of `memory`); the attention backends of `config`'s pair."""

    def __init__(self, config: EngineConfig, model: ForwardModel, memory: KVMemory, pools: KVPools,
                 future_tokens: FutureTokens, attn_backend=None, lora: LoRAPool | None = None) -> None:
        """`lora`: the adapter pool whose token slots each forward sets (--enable-lora)."""
        assert config.resolved, "ModelRunner needs a resolved EngineConfig"
        self.config = config
        self.device = memory.device
        self.model = model
        self.memory = memory
        self.req_to_token = memory.req_to_token
        self.future_tokens = future_tokens
        self.vocab_size = model.config.vocab_size
        self.lora = lora

        # A draft model's runner is given its backend by the draft-backend factory (kestrel.speculative).
        self.attn_backend = attn_backend if attn_backend is not None else self._target_backend(config, pools)
        logger.info("attention backend: %s", self.attn_backend.name)

        # Set to a list to time every forward on the GPU: (start, end) CUDA events are appended (benchmarks).
        self.forward_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self.cuda_graphs: dict[tuple[ForwardMode, int], CudaGraphRunner] = {}
        graph_backends = [REGISTRY[name] for name in cuda_graph_backends(config)]
        self._graphs_on = (self.device.type == "cuda" and not config.cuda_graph.disable_cuda_graph
                           and all(b.cuda_graph for b in graph_backends))
        self._spec_graphs_on = self._graphs_on and all(b.cuda_graph_spec for b in graph_backends)
        self.piecewise_graphs: PiecewiseGraphRunner | None = None
        if attn_backend is None:
            self.capture_graphs(ForwardMode.DECODE, 1)
            if config.cuda_graph.enable_piecewise_cuda_graph:
                self._capture_piecewise_graphs()

    def _capture_piecewise_graphs(self) -> None:
        """After the decode graphs, as SGLang does; a draft model's runner never captures them."""
        reason = piecewise_unavailable(self.config, self.model, self.device)
        if reason is not None:
            logger.warning("piecewise CUDA graphs stay off: %s", reason)
            return
        self.piecewise_graphs = PiecewiseGraphRunner(
            self.model, self.config.cuda_graph.piecewise_cuda_graph_max_tokens, self.device)

    def _target_backend(self, config: EngineConfig, pools: KVPools):
        pair = config.attention.backends
        prefill = create_backend(pair.prefill, pools, self.req_to_token, config)
        if pair.decode == pair.prefill:
            return prefill  # one backend serves every mode: no hybrid wrapper
        decode = create_backend(pair.decode, pools, self.req_to_token, config)
        return HybridBackend(prefill, decode, config.speculative.speculative_attention_mode)

    @property
    def graphs_on(self) -> bool:
        return self._graphs_on

    @property
    def spec_graphs_on(self) -> bool:
        """Whether a speculative round's forwards (verify, draft extend) are captured too."""
        return self._spec_graphs_on

    def capture_graphs(self, mode: ForwardMode, tokens_per_request: int, capture_hidden: tuple[int, ...] = (),
                       features: tuple[int, torch.dtype] | None = None) -> None:
        """Capture CUDA graphs for batches of `mode` with this many new tokens per request (a verify
        step's tree size), for every batch-size bucket; a no-op where graphs are off (for any mode but
        DECODE: where the backends capture only decode steps). `features`: the (width, dtype) of a draft
        head's feature input."""
        if not (self._graphs_on if mode is ForwardMode.DECODE else self._spec_graphs_on):
            return
        # A backend whose captured work is sized by the longest sequence (dsv4) says how long it serves.
        max_seq_len = getattr(self.attn_backend, "graph_max_seq_len", None)
        self.cuda_graphs[(mode, tokens_per_request)] = CudaGraphRunner(
            self.model, self.attn_backend, self.req_to_token.padding_row, self.graph_max_bs, self.device, mode,
            tokens_per_request, capture_hidden, features, max_seq_len=max_seq_len)

    @property
    def graph_max_bs(self) -> int:
        return min(self.config.cuda_graph.cuda_graph_max_bs, self.config.scheduler.max_running_requests)

    def build_batch(self, batch: ScheduledBatch, inputs: DeviceInputs | None = None) -> ForwardBatch:
        """Send the batch to the device in one copy, apply its `req_to_token` writes and KV moves;
        `inputs` replace the batch's host token ids / positions."""
        extend, prefix = batch.extend_lens, batch.prefix_lens
        seq = [p + e for p, e in zip(prefix, extend)]
        n, b = batch.num_tokens, batch.batch_size
        rows = batch.logit_rows()
        # Each token's adapter slot (LoRA): the request's, repeated over its new tokens.
        lora = [s for s, e in zip(batch.lora_slots, extend) for _ in range(e)] if self.lora is not None else []
        small = torch.tensor(batch.input_ids + batch.positions + batch.req_pool_indices + seq + prefix + extend + rows
                             + lora, dtype=torch.int64)
        writes, moves = batch.table_writes, batch.kv_moves
        host = torch.cat([small, batch.out_cache_loc, writes.flatten(), moves.flatten()])
        dev = host.to(self.device, non_blocking=True)
        ids, positions, pool_idx, seq_t, prefix_t, extend_t, rows_t, lora_t, loc, w, m = dev.split(
            [n, n, b, b, b, b, len(rows), len(lora), n, writes.numel(), moves.numel()])
        if writes.shape[1]:
            w = w.view(3, -1)
            self.req_to_token.table[w[0], w[1]] = w[2]
        if moves.shape[1]:
            m = m.view(2, -1)
            self.memory.move(m[0], m[1])
        inputs = inputs or DeviceInputs()
        if inputs.input_ids is not None:
            ids = inputs.input_ids
        elif any(t < 0 for t in batch.input_ids):  # sampled by the step still running: only on the device
            ids = self.future_tokens.resolve(ids)
        if inputs.positions is not None:
            positions = inputs.positions
        tree = tree_starts = None
        if batch.tree_mask is not None:
            tree = batch.tree_mask.to(self.device, non_blocking=True)
            tree_starts = torch.tensor([0] + list(itertools.accumulate(e * e for e in extend))[:-1],
                                       dtype=torch.int64).to(self.device, non_blocking=True)
        return ForwardBatch(
            forward_mode=batch.mode, input_ids=ids, positions=positions, out_cache_loc=loc,
            req_pool_indices=pool_idx, seq_lens=seq_t, prefix_lens=prefix_t, extend_lens=extend_t,
            seq_lens_cpu=seq, prefix_lens_cpu=list(prefix), extend_lens_cpu=list(extend), max_extend=max(extend),
            logits_indices=rows_t, attn_backend=self.attn_backend, tree_mask=tree, tree_mask_starts=tree_starts,
            capture_hidden=batch.capture_hidden, spec_features=inputs.features,
            lora_slots=lora_t if lora else None)

    def forward(self, batch: ScheduledBatch, inputs: DeviceInputs | None = None) -> ForwardOutput:
        with torch.inference_mode():
            return self.execute(self.build_batch(batch, inputs))

    def execute(self, fb: ForwardBatch) -> ForwardOutput:
        """Run a built batch: its captured graph when one fits, else eagerly."""
        if self.forward_events is None:
            return self._execute(fb)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self._execute(fb)
        end.record()
        self.forward_events.append((start, end))
        return out

    @torch.inference_mode()
    def _execute(self, fb: ForwardBatch) -> ForwardOutput:
        if self.lora is not None:  # before any graph replays: they read the pool's fixed slot buffer
            self.lora.stage(fb.lora_slots, fb.input_ids.shape[0])
        graph = self.cuda_graphs.get((fb.forward_mode, fb.max_extend))
        if graph is not None and graph.can_run(fb):
            return graph.replay(fb)
        if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(fb):
            return self.piecewise_graphs.replay(fb)
        fb.attn_backend.init_forward_metadata(fb)
        token_hidden = self.model(fb.input_ids, fb.positions, fb)
        hidden = token_hidden[fb.logits_indices]
        return ForwardOutput(self.model.compute_logits(hidden), hidden, fb.captured_hidden, token_hidden)
