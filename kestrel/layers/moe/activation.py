"""The experts' gated activations in torch (the Triton grouped GEMM computes the same in its kernel)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.layers.moe.config import ExpertActivation


def gated(gate: torch.Tensor, up: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """[..., I] gate and up projections -> [..., I] (config.ExpertActivation says which)."""
    if act.kind == "silu":
        return F.silu(gate) * up
    if act.kind == "clamped_silu":
        return F.silu(gate.clamp(max=act.limit)) * up.clamp(-act.limit, act.limit)
    gate = gate.clamp(max=act.limit)
    return (up.clamp(-act.limit, act.limit) + 1) * (gate * torch.sigmoid(gate * act.alpha))
