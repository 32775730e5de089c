"""Routes each batch to the prefill or the decode backend by forward mode (docs/design/attention-backends.md §3)."""
from __future__ import annotations

import torch

from kestrel.core.forward_batch import ForwardBatch
from kestrel.core.forward_mode import ForwardMode


def serving_half(mode: ForwardMode, speculative_attention_mode: str) -> str:
    """Which half ("prefill" or "decode") serves a forward mode."""
    if mode is ForwardMode.DECODE:
        return "decode"
    if mode is ForwardMode.TARGET_VERIFY:
        return "decode" if speculative_attention_mode == "decode" else "prefill"
    return "prefill"  # EXTEND, MIXED, DRAFT_EXTEND


class HybridBackend:
    """Holds two different backends; its stamp is the pair, each child keeps its own."""

    def __init__(self, prefill, decode, speculative_attention_mode: str) -> None:
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.speculative_attention_mode = speculative_attention_mode
        self.name = f"hybrid(prefill={prefill.name},decode={decode.name})"

    def backend_for(self, mode: ForwardMode):
        half = serving_half(mode, self.speculative_attention_mode)
        return self.prefill_backend if half == "prefill" else self.decode_backend

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.backend_for(batch.forward_mode).init_forward_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, batch: ForwardBatch) -> torch.Tensor:
        return self.backend_for(batch.forward_mode).forward(q, k, v, layer, batch)
