"""Loads the model, owns the KV memory, turns a scheduled batch into a forward."""
from __future__ import annotations

import importlib.util
import itertools
import logging

import torch

from kestrel.attention.decisions import cuda_graph_backends, shared_triton_kernel
from kestrel.attention.hybrid import HybridBackend
from kestrel.attention.registry import REGISTRY, attention_backends, create_backend
from kestrel.cache.allocator import TokenToKVPoolAllocator
from kestrel.cache.kv_pool import KVPool
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.config import EngineConfig
from kestrel.core.forward_batch import ForwardBatch
from kestrel.engine.scheduler import ScheduledBatch
from kestrel.layers.kernels import Kernels
from kestrel.models.loader import load_model
from kestrel.runner.cuda_graph import CudaGraphRunner
from kestrel.runner.future_tokens import FutureTokens

logger = logging.getLogger(__name__)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        assert config.resolved, "ModelRunner needs a resolved EngineConfig"
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.model.dtype)
        # Triton kernels for the layers here, and for the sampler's argmax (the engine reads this).
        self.triton_on_device = self.device.type == "cuda" and triton_installed()
        kernels = Kernels(triton_rope=self.triton_on_device and shared_triton_kernel(config),
                          triton_elementwise=self.triton_on_device)
        self.model = load_model(config.model.model, self.dtype, self.device, kernels, config.model.load_format)
        arch = self.model.config
        self.vocab_size = arch.vocab_size

        # ---- KV memory -----------------------------------------------------------------------
        page = config.cache.page_size
        per_token = KVPool.bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                                           self.dtype)
        size = config.cache.max_total_tokens or self._tokens_fitting_memory(per_token)
        self.allocator = TokenToKVPoolAllocator(size, page, self.device)
        self.kv_pool = KVPool(arch.num_hidden_layers, (self.allocator.num_pages + 1) * page,
                              arch.num_key_value_heads, arch.head_dim, self.dtype, self.device)
        # A request never holds more tokens than the pool or the context.
        self.max_req_len = min(config.model.context_length, self.allocator.size)
        self.req_to_token = ReqToTokenPool(config.scheduler.max_running_requests, self.max_req_len + 1, self.device)
        # Every sampled request holds a req_to_token row, so a step samples at most max_running_requests.
        self.future_tokens = FutureTokens(2 * config.scheduler.max_running_requests, self.device)
        logger.info("KV pool: %d tokens (%.2f GiB), page size %d", self.allocator.size,
                    self.allocator.size * per_token / 2**30, page)

        # ---- attention -----------------------------------------------------------------------
        pair = attention_backends(config)
        prefill = create_backend(pair.prefill, self.kv_pool, self.req_to_token, config)
        if pair.decode == pair.prefill:
            self.attn_backend = prefill  # one backend serves every mode: no hybrid wrapper
        else:
            decode = create_backend(pair.decode, self.kv_pool, self.req_to_token, config)
            self.attn_backend = HybridBackend(prefill, decode, config.speculative.speculative_attention_mode)
        logger.info("attention backend: %s", self.attn_backend.name)

        # ---- CUDA graphs for decode --------------------------------------------------------------
        self.cuda_graphs = None
        graph_ok = all(REGISTRY[name].cuda_graph for name in cuda_graph_backends(config))
        if self.device.type == "cuda" and not config.cuda_graph.disable_cuda_graph and graph_ok:
            max_bs = min(config.cuda_graph.cuda_graph_max_bs, config.scheduler.max_running_requests)
            self.cuda_graphs = CudaGraphRunner(self.model, self.attn_backend, self.req_to_token.padding_row,
                                               max_bs, self.device)

    def _tokens_fitting_memory(self, per_token: int) -> int:
        """KV pool size on CUDA: what is free after the weights, minus the share kept for activations."""
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - total * (1 - self.config.cache.mem_fraction_static)
        tokens = int(budget // per_token)
        if tokens < self.config.cache.page_size:
            raise ValueError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free); "
                             "raise mem_fraction_static or set max_total_tokens")
        return tokens

    def build_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        """Flatten the requests' new tokens; their slots are already in req_to_token."""
        reqs = batch.reqs
        input_ids, positions, prefix, extend = [], [], [], []
        pending = False
        for req in reqs:
            pending = pending or bool(req.pending)
            input_ids += req.tokens(req.kv_len, req.kv_len + req.extend_len)
            positions += range(req.kv_len, req.kv_len + req.extend_len)
            prefix.append(req.kv_len)
            extend.append(req.extend_len)
        seq = [p + e for p, e in zip(prefix, extend)]
        pool_idx = [r.req_pool_idx for r in reqs]
        ends = list(itertools.accumulate(extend))
        # One host-to-device copy for all the small per-batch tensors.
        packed = torch.tensor([input_ids, positions], dtype=torch.int64).to(self.device, non_blocking=True)
        per_req = torch.tensor([pool_idx, seq, prefix, extend, [e - 1 for e in ends]],
                               dtype=torch.int64).to(self.device, non_blocking=True)
        # Inputs sampled by the step still running are only on the device: fetch them there.
        ids = self.future_tokens.resolve(packed[0]) if pending else packed[0]
        return ForwardBatch(
            forward_mode=batch.mode, input_ids=ids, positions=packed[1], out_cache_loc=batch.out_cache_loc,
            req_pool_indices=per_req[0], seq_lens=per_req[1], prefix_lens=per_req[2], extend_lens=per_req[3],
            seq_lens_cpu=seq, prefix_lens_cpu=prefix, extend_lens_cpu=extend, logits_indices=per_req[4],
            attn_backend=self.attn_backend)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [len(batch.reqs), vocab] (float32) at each request's last new token."""
        fb = self.build_batch(batch)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(fb):
            return self.cuda_graphs.replay(fb)
        fb.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden[fb.logits_indices])
