"""FP8 numerics in plain torch: formats, block-scaled weights, per-token activation groups.

Weights are float8_e4m3fn with one float32 scale per 128 x 128 block, the layout of Qwen3-FP8 and
DeepSeek checkpoints: `weight_scale_inv[i, j]` multiplies block (i, j) back to real values (the name
says it is the inverse of the factor applied when quantizing). Activations are quantized on the fly per
token and 128-input group, so every 128-wide slice of a GEMM's reduction has one activation scale and
one weight scale.
"""
from __future__ import annotations

import torch

BLOCK = 128
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The smallest amax given a scale: an all-zero block gets a finite scale (its values stay 0).
_TINY = 1e-12


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def saturate_to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values cast to `dtype`, clipped to its finite range first (e5m2 would overflow to inf)."""
    limit = fp8_max(dtype)
    return x.clamp(-limit, limit).to(dtype)


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // BLOCK), -(-cols // BLOCK)


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[ceil(rows/128), ceil(cols/128)] (or with leading batch dims) -> [rows, cols], float32."""
    full = scale.float().repeat_interleave(BLOCK, -2)[..., :rows, :]
    return full.repeat_interleave(BLOCK, -1)[..., :cols]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 weight from an FP8 weight [..., rows, cols] and its 128 x 128 block scales."""
    rows, cols = weight.shape[-2:]
    return weight.float() * expand_block_scales(scale_inv, rows, cols)


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(rows/128), ceil(cols/128)]) of a 2-D weight:
    each block's largest magnitude maps to the format's largest value (448)."""
    rows, cols = weight.shape
    nr, nc = _blocks(rows, cols)
    padded = torch.zeros(nr * BLOCK, nc * BLOCK, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    amax = padded.view(nr, BLOCK, nc, BLOCK).abs().amax(dim=(1, 3))
    scale_inv = amax.clamp_min(_TINY) / fp8_max(torch.float8_e4m3fn)
    q = saturate_to_fp8(weight.float() / expand_block_scales(scale_inv, rows, cols), torch.float8_e4m3fn)
    return q, scale_inv


def quantize_token_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 scales [M, ceil(K/128)]) of activations x [M, K]: one scale per
    token and 128-input group. The same arithmetic as the Triton GEMM's in-register quantization
    (multiply by 448 / amax, clip, round), so the two agree bit for bit where rounding does."""
    m, k = x.shape
    groups = -(-k // BLOCK)
    padded = torch.zeros(m, groups * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    padded = padded.view(m, groups, BLOCK)
    amax = padded.abs().amax(-1).clamp_min(_TINY)
    limit = fp8_max(torch.float8_e4m3fn)
    q = saturate_to_fp8(padded * (limit / amax)[..., None], torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k], amax / limit


def dequantize_token_groups(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.repeat_interleave(BLOCK, -1)[:, :q.shape[1]]
