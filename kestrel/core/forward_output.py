"""What one model forward returns, for the sampler and for a speculative draft."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, vocab] float32 at the batch's `logit_rows()`
    hidden: torch.Tensor  # [N, hidden]: the final hidden state at the same rows
    captured: torch.Tensor | None  # [T, hidden * k]: the batch's `capture_hidden` layers, every new token
    token_hidden: torch.Tensor  # [T, hidden]: the final hidden state of every new token (EAGLE's features)
