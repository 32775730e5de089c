"""What every rank builds the same way: the model (its shard), its KV memory and the model runner.

The engine (rank 0) and each tensor-parallel worker rank call `build_runner`; only rank 0 adds a
tokenizer, a scheduler and the outputs on top.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kestrel.cache.kv_memory import KVMemory, pool_size
from kestrel.config import EngineConfig
from kestrel.distributed.parallel_state import ParallelState
from kestrel.lora.build import build_lora_pool
from kestrel.lora.pool import LoRAPool
from kestrel.models.base import CausalLM
from kestrel.models.loader import load_model
from kestrel.quant.kv import kv_cache_dtype
from kestrel.runner.future_tokens import FutureTokens
from kestrel.runner.model_runner import ModelRunner, layer_kernels
from kestrel.speculative.draft_model import Draft, load_draft
from kestrel.speculative.draft_worker import DraftWorker
from kestrel.speculative.resolve import DRAFT_MODEL_ALGORITHMS

logger = logging.getLogger(__name__)


@dataclass
class RunnerParts:
    config: EngineConfig  # as given, or with the radix cache turned off for a model that cannot reuse prefixes
    model: CausalLM
    draft: Draft | None
    kv_memory: KVMemory
    future_tokens: FutureTokens
    runner: ModelRunner
    lora: LoRAPool | None  # --enable-lora: the adapters and their device slots


def build_runner(config: EngineConfig, device: torch.device, parallel: ParallelState) -> RunnerParts:
    # ---- model ---------------------------------------------------------------------------
    spec = config.speculative
    dtype = getattr(torch, config.model.dtype)
    model = load_model(config.model.model, dtype, device, layer_kernels(config), config.model.load_format,
                       config.model.hf_config, config.model.quantization, parallel)
    lora = None
    if config.lora.enable_lora:
        lora = build_lora_pool(config, model, dtype, device, layer_kernels(config).triton_elementwise)
    draft = None
    if spec.speculative_algorithm in DRAFT_MODEL_ALGORITHMS:
        draft = load_draft(config, model, dtype, device, layer_kernels(config))

    # ---- KV memory: the engine's, shaped by the model (and its draft) -------------------------
    sched = config.scheduler
    # A verify step's new tokens, all written before acceptance rolls some back.
    step_tokens = (spec.speculative_num_draft_tokens or 1) if spec.speculative_algorithm else 1
    # A draft head's KV stays in the model dtype: its pool is small, and FP8 there would cost acceptance.
    # A NEXTN draft's (the MTP layer's) follows the target's: one entry per slot grows with the tokens.
    target_layout = model.kv_layout(kv_cache_dtype(config.cache.kv_cache_dtype, dtype), step_tokens)
    if target_layout.has_rings and config.cache.disable_window_rings:
        target_layout = target_layout.without_rings
    if target_layout.has_rings and ((spec.speculative_eagle_topk or 1) > 1 or spec.speculative_algorithm == "NGRAM"):
        # A tree's accepted path is moved into place per token; a ring's entries cannot be moved so. NGRAM
        # pads a short chain with more children of the root: a tree whatever its topk.
        raise ValueError(f"speculative trees ({spec.speculative_algorithm}, speculative_eagle_topk="
                         f"{spec.speculative_eagle_topk}) cannot run over this model's sliding-window rings; use "
                         "an EAGLE or STANDALONE chain (speculative_eagle_topk 1) or --disable-window-rings")
    layouts = [target_layout] + ([draft.kv_layout] if draft is not None else [])
    if layouts[0].prefix_cache_unsupported and not config.cache.disable_radix_cache:
        if parallel.is_driver:
            logger.warning("prefix caching is off for this model: %s", layouts[0].prefix_cache_unsupported)
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, disable_radix_cache=True))
    size = pool_size(config.cache, layouts, sched.max_running_requests, device)
    if parallel.tp_size > 1:  # every rank's slot space must be the same: the smallest any rank's memory allows
        size = parallel.all_min(size)
    kv_memory = KVMemory(layouts, size, config.cache.page_size, sched.max_running_requests,
                         config.model.context_length, device, step_slack=step_tokens - 1,
                         draft_scratch=DraftWorker.scratch_slots(config) if draft is not None else 0)
    alloc = kv_memory.allocator
    if parallel.is_driver:
        # Per-request state (window rings) is fixed per running request, apart from the tokens' bytes.
        logger.info("KV pool: %d tokens (%.2f GiB%s, %s), page size %d; %d B per token, %.2f MiB per request%s",
                    alloc.size, alloc.size * kv_memory.bytes_per_token / 2**30,
                    " per rank" if parallel.tp_size > 1 else "", config.cache.kv_cache_dtype, alloc.page_size,
                    kv_memory.bytes_per_token, kv_memory.bytes_per_request / 2**20,
                    f" ({', '.join(layouts[0].per_request_groups())})" if kv_memory.bytes_per_request else "")
    # Every sampled request holds a req_to_token row, so a step samples at most max_running_requests.
    future_tokens = FutureTokens(2 * sched.max_running_requests, device)
    runner = ModelRunner(config, model, kv_memory, kv_memory.pools[0], future_tokens, lora=lora)
    return RunnerParts(config, model, draft, kv_memory, future_tokens, runner, lora)
