"""Rotary position embedding, neox style (rotate-half), with a cos/sin cache over positions."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `factor` etc. only mean something for the scaled rope types."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # YaRN: the ramp between kept and slowed frequencies, in rotations over the original context;
    # `truncate` rounds its ends to whole dims; `attention_factor` scales cos/sin (None: from `factor`).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    # DeepSeek's YaRN: with both set (and no attention_factor), cos/sin are scaled by
    # yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim), and an MLA model's softmax
    # scale by yarn_mscale(factor, mscale_all_dim) ** 2 (`yarn_softmax_scale`).
    mscale: float | None = None
    mscale_all_dim: float | None = None


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, scaled as `rope.rope_type` asks."""
    if rope.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return yarn_frequencies(head_dim, rope.theta, rope.factor, rope.original_max_position_embeddings,
                                rope.beta_fast, rope.beta_slow, rope.truncate)
    return inv_freq


def yarn_frequencies(rope_dim: int, theta: float, factor: float, original_max: int, beta_fast: float,
                     beta_slow: float, truncate: bool) -> torch.Tensor:
    """YaRN's float32 [rope_dim // 2] frequencies: theta^(-2k/r) for dims that turn more than `beta_fast`
    times over the original context (kept), / factor for those under `beta_slow` (interpolated), a
    linear ramp between. Computed in float64."""
    k = torch.arange(rope_dim // 2, dtype=torch.float64)
    omega = theta ** (-2 * k / rope_dim)

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original_max / (2 * math.pi * rotations)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rope_dim - 1)
    # As the reference: only equal ends are separated; reversed ends (a context shorter than 2 pi x
    # beta_slow, or beta_fast < beta_slow) keep their negative span, which turns the ramp around.
    ramp = ((k - lo) / (hi - lo if hi != lo else 1e-3)).clamp(0, 1)
    return (omega * (1 - ramp) + omega / factor * ramp).float()


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1 mscale ln(factor) + 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def attention_scaling(rope: RopeConfig) -> float:
    """What cos/sin are multiplied by: YaRN's 0.1 ln(factor) + 1 (unless the config gives it, or gives
    DeepSeek's mscale pair), else 1."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def yarn_softmax_scale(rope: RopeConfig, scale: float) -> float:
    """An MLA model's softmax scale: `scale` (head_dim ** -0.5) times yarn_mscale(factor,
    mscale_all_dim) ** 2 under a scaled rope with `mscale_all_dim`, since DeepSeek scales every
    dimension of q . k, not only the rotated ones."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return scale
    return scale * yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rope at `positions` [T] to x [T, heads * D]: the query and key heads side by side, so
    one call (one kernel on the Triton path) rotates both. Shape and dtype are kept.

    The cache is float32 [max_positions, D] (cos in the first half, sin in the second, both times the
    rope's attention scaling) and is not a checkpoint parameter; cos/sin are cast to the activation
    dtype before use, as transformers does.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, use_triton: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.triton_kernel = None
        if use_triton:  # decided by attention.decisions.shared_triton_kernel; triton is optional
            from kestrel.layers.rope_triton import rope_triton

            self.triton_kernel = rope_triton
        inv_freq = inv_frequencies(head_dim, rope)
        # Built on the default device: the loader constructs models under the target device.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling(rope)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.triton_kernel is not None:
            return self.triton_kernel(x, positions, self.cos_sin_cache, self.head_dim)
        cos, sin = self.cos_sin_cache[positions].to(x.dtype).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2], broadcast over heads
        x1, x2 = x.view(x.shape[0], -1, self.head_dim).chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(1)
