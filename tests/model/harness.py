"""Runs kestrel models on hand-built ForwardBatches through the torch_native backend, keeping each
request's KV between calls (prefill, then decode or more chunks)."""
from __future__ import annotations

import torch

from kestrel.attention.torch_native import TorchNativeBackend
from kestrel.cache.kv_layout import KVLayout
from kestrel.cache.kv_memory import KVPools
from kestrel.cache.req_to_token import ReqToTokenPool
from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode


class Harness:
    def __init__(self, model: torch.nn.Module, num_requests: int, max_len: int = 128,
                 layout: KVLayout | None = None) -> None:
        cfg = model.config
        self.model = model
        layout = layout or KVLayout.full_attention(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                                   next(model.parameters()).dtype)
        self.pools = KVPools(layout, 512, num_requests + 2, "cpu")
        self.req_to_token = ReqToTokenPool(num_requests + 1, max_len, "cpu")
        self.rows = [self.req_to_token.alloc() for _ in range(num_requests)]
        self.lens = [0] * num_requests
        self.next_slot = 1  # slot 0 is reserved for padding

    def batch(self, chunks: list[list[int]], mode: ForwardMode = ForwardMode.EXTEND) -> ForwardBatch:
        """The batch that feeds `chunks[i]` as request i's next tokens (their slots are assigned now)."""
        prefix = list(self.lens)
        extend = [len(c) for c in chunks]
        seq = [p + e for p, e in zip(prefix, extend)]
        positions, slots = [], []
        for i, (p, e) in enumerate(zip(prefix, extend)):
            new_slots = torch.arange(self.next_slot, self.next_slot + e)
            self.next_slot += e
            self.req_to_token.table[self.rows[i], p:p + e] = new_slots
            positions += range(p, p + e)
            slots.append(new_slots)
        self.lens = seq
        return ForwardBatch(
            forward_mode=mode, input_ids=torch.tensor([t for c in chunks for t in c]),
            positions=torch.tensor(positions), out_cache_loc=torch.cat(slots),
            req_pool_indices=torch.tensor(self.rows), seq_lens=torch.tensor(seq), prefix_lens=torch.tensor(prefix),
            extend_lens=torch.tensor(extend), seq_lens_cpu=seq, prefix_lens_cpu=prefix, extend_lens_cpu=extend,
            max_extend=max(extend), logits_indices=torch.tensor(extend).cumsum(0) - 1,
            attn_backend=TorchNativeBackend(self.pools, self.req_to_token),
        )

    def step(self, chunks: list[list[int]], mode: ForwardMode = ForwardMode.EXTEND) -> list[torch.Tensor]:
        """Run a causal LM on the next tokens; returns each request's logits [len, vocab]."""
        batch = self.batch(chunks, mode)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(batch.input_ids, batch.positions, batch))
        return list(logits.split(batch.extend_lens_cpu))
