"""V4's rope: interleaved pairs on the last `rope_dim` dims, per-layer theta, optional YaRN
(docs/design/deepseek-v4.md §2.1)."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.layers.rotary import yarn_frequencies
from kestrel.models.deepseek_v4.config import V4Config, YarnConfig


def rope_frequencies(rope_dim: int, theta: float, yarn: YarnConfig | None) -> torch.Tensor:
    """float32 [rope_dim // 2]: theta^(-2k/r), blended towards /factor above the YaRN ramp. No mscale:
    V4 keeps cos/sin unscaled and the softmax scale at head_dim^-1/2."""
    if yarn is None:
        k = torch.arange(rope_dim // 2, dtype=torch.float64)
        return (theta ** (-2 * k / rope_dim)).float()
    return yarn_frequencies(rope_dim, theta, yarn.factor, yarn.original_max_position_embeddings, yarn.beta_fast,
                            yarn.beta_slow, truncate=True)


class V4Rope(nn.Module):
    """Rotates x [T, ..., D] at positions [T]: pairs (x[2k], x[2k+1]) of the last `rope_dim` dims turn
    by position * omega_k (by -position * omega_k when `inverse`). Angles in float32, shape and dtype kept.
    No cos/sin cache: at 1M positions it would be larger than the step's work. With `triton` set (the
    model's fused kernels, CUDA), one Triton launch (`triton_ops.rope`) in place of ~9 torch ones."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnConfig | None) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.triton = False
        self.register_buffer("omega", rope_frequencies(rope_dim, theta, yarn), persistent=False)

    @classmethod
    def for_ratio(cls, cfg: V4Config, ratio: int) -> "V4Rope":
        """Sliding-only layers: rope_theta without YaRN; compressed layers: compress_rope_theta with YaRN."""
        if ratio == 0:
            return cls(cfg.qk_rope_head_dim, cfg.rope_theta, None)
        return cls(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.yarn)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        r = self.rope_dim
        if self.triton:
            from kestrel.models.deepseek_v4 import triton_ops  # triton is optional

            return triton_ops.rope(x, positions, self.omega, r, inverse)
        angle = positions.float()[:, None] * self.omega[None, :]
        # The pairs as complex numbers times e^{±i angle}: the same products as the real form, in fewer
        # ops (a decode step runs this six times per ratio-4 layer, launch-bound).
        turn = torch.polar(torch.ones_like(angle), -angle if inverse else angle)
        turn = turn.view((x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,))
        pairs = torch.view_as_complex(x[..., -r:].float().unflatten(-1, (r // 2, 2)))
        turned = torch.view_as_real(pairs * turn).flatten(-2)
        return torch.cat([x[..., :-r], turned.to(x.dtype)], dim=-1)
