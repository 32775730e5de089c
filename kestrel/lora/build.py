"""The LoRA pool of a loaded model: its projections wrapped, the start-up adapters loaded."""
from __future__ import annotations

import torch

from kestrel.config import EngineConfig
from kestrel.lora.layers import attach_lora, lora_targets
from kestrel.lora.pool import LoRAPool
from kestrel.lora.resolve import parse_lora_paths


def build_lora_pool(config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                    use_triton: bool) -> LoRAPool:
    """Before the KV pool is sized, so the slots' memory is taken from the weights' side."""
    lora, sched, graphs = config.lora, config.scheduler, config.cuda_graph
    served = lora.lora_target_modules
    # The fixed token-slot buffer covers every forward a CUDA graph replays (decode and verify batches,
    # piecewise prefill steps) and a usual chunked step; larger eager steps get a tensor of their own.
    spec_tokens = config.speculative.speculative_num_draft_tokens or 1
    chunk = max(sched.chunked_prefill_size, 0)
    max_tokens = max(sched.max_running_requests * spec_tokens, graphs.piecewise_cuda_graph_max_tokens,
                     chunk + sched.max_running_requests)
    pool = LoRAPool(lora_targets(model, served), served, lora.max_loras_per_batch, lora.max_lora_rank,
                    lora.max_loaded_loras, dtype, device, max_tokens)
    attach_lora(model, pool, use_triton)
    for name, path in parse_lora_paths(lora.lora_paths):
        pool.load(name, path)
    return pool
