"""Drives a DeepSeek-V4 model (or one of its layers) through its incremental path, as the engine would:
the KV memory built from the model's `KVLayout`, pages from the allocator, `req_to_token` rows
filled before each step, one ForwardBatch per step with the dsv4 backend. With `with_mtp`, the memory
also has the MTP layer's pools (a NEXTN draft's) behind the same slots, served by `mtp_backend`."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kestrel.attention.dsv4 import DSV4Backend
from kestrel.cache.kv_memory import KVMemory
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode
from kestrel.models.deepseek_v4.config import parse_v4_config
from kestrel.models.deepseek_v4.kv_layout import mtp_kv_layout
from kestrel.models.deepseek_v4.model import DeepseekV4ForCausalLM

PAGE_SIZE = 128


def reference_model(cfg, weights: dict[str, torch.Tensor]) -> DeepseekV4ForCausalLM:
    """The engine's model of the reference config `cfg` (tests/model/dsv4_reference.py) with its weights."""
    model = DeepseekV4ForCausalLM(parse_v4_config(cfg.native_config()))
    model.load_checkpoint(weights.items(), "reference weights")
    return model.eval()


class V4Harness:
    def __init__(self, model: torch.nn.Module, num_requests: int, max_context: int = 1024,
                 pool_tokens: int = 8192, with_mtp: bool = False, kv_dtype: torch.dtype = torch.float32) -> None:
        """`kv_dtype`: the pools' (float32, the model's; float8_e4m3fn: packed FP8 entries)."""
        self.model = model
        layouts = [model.kv_layout(kv_dtype)] + ([mtp_kv_layout(model.config, kv_dtype)] if with_mtp else [])
        self.memory = KVMemory(layouts, pool_tokens, PAGE_SIZE, num_requests, max_context, "cpu")
        self.backend = DSV4Backend(self.memory.pools[0], self.memory.req_to_token)
        self.mtp_backend = DSV4Backend(self.memory.pools[1], self.memory.req_to_token) if with_mtp else None
        self.rows = [self.memory.req_to_token.alloc() for _ in range(num_requests)]
        self.lens = [0] * num_requests
        self.last_loc = [0] * num_requests

    def batch(self, chunks: list[list[int]], requests: list[int], backend: DSV4Backend) -> ForwardBatch:
        """Allocate slots for `chunks[j]` as request `requests[j]`'s next tokens; the step's batch."""
        prefix = [self.lens[r] for r in requests]
        extend = [len(c) for c in chunks]
        positions, slots = [], []
        table = self.memory.req_to_token.table
        for r, p, e in zip(requests, prefix, extend):
            new = self.memory.allocator.alloc_for(p, e, self.last_loc[r])
            table[self.rows[r], p:p + e] = new
            self.last_loc[r] = int(new[-1])
            self.lens[r] = p + e
            positions += range(p, p + e)
            slots.append(new)
        seq = [p + e for p, e in zip(prefix, extend)]
        mode = ForwardMode.DECODE if all(e == 1 for e in extend) else ForwardMode.EXTEND
        return ForwardBatch(
            forward_mode=mode, input_ids=torch.tensor([t for c in chunks for t in c]),
            positions=torch.tensor(positions), out_cache_loc=torch.cat(slots),
            req_pool_indices=torch.tensor([self.rows[r] for r in requests]), seq_lens=torch.tensor(seq),
            prefix_lens=torch.tensor(prefix), extend_lens=torch.tensor(extend), seq_lens_cpu=seq,
            prefix_lens_cpu=prefix, extend_lens_cpu=extend, max_extend=max(extend),
            logits_indices=torch.tensor(extend).cumsum(0) - 1,
            attn_backend=backend)

    def run(self, fn: Callable[[torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor],
            chunks: list[list[int]], requests: list[int] | None = None, mtp: bool = False) -> list[torch.Tensor]:
        """One step of `fn(input_ids, positions, batch)` (on the MTP layer's pools with `mtp`); its
        output split per request."""
        requests = list(range(len(chunks))) if requests is None else requests
        backend = self.mtp_backend if mtp else self.backend
        batch = self.batch(chunks, requests, backend)
        backend.init_forward_metadata(batch)
        with torch.no_grad():
            out = fn(batch.input_ids, batch.positions, batch)
        return list(out.split(batch.extend_lens_cpu))

    def logits(self, chunks: list[list[int]], requests: list[int] | None = None) -> list[torch.Tensor]:
        """Every new token's logits [extend, vocab], per request."""
        model = self.model
        return self.run(lambda ids, pos, b: model.compute_logits(model(ids, pos, b)), chunks, requests)
